"""Writing a small state file so that a crash at any instant leaves either the old or the new content.

The vbucket map, the gateway's state file and every other JSON file under a data directory go through
:func:`write_atomically`: the new bytes are written to a temporary file in the same directory, fsynced, renamed
over the target (``rename(2)`` is atomic within one filesystem) and the directory is fsynced so the rename itself
survives a power loss. Truncating and rewriting a file in place (what ``Path.write_text`` does) leaves an empty or
half-written file when the process dies in between (docs/reliability.md "Data directory").
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["TEMP_SUFFIX", "fsync_dir", "write_atomically"]

#: temporary files are named ``.<name>.<pid>.tmp`` next to their target (a crash may leave one behind; it is
#: never read, and the next write of the same process id replaces it)
TEMP_SUFFIX = ".tmp"


def fsync_dir(directory: Path | str) -> None:
    """fsync a directory (its entries: a rename or a new file in it become durable)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path | str, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync of the directory.

    Readers (and a restart after a crash at any point) see the old content or the new, never a mix or an empty
    file. On an error (disk full, permissions) the temp file is removed, the target is untouched, and the
    ``OSError`` propagates. ``mode`` is the new file's permission bits (0o600 for a file holding secrets,
    docs/security.md); the temporary file is created with them, so the content is never readable by others."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            if not mode & 0o077:  # owner-only: narrow a leftover temp file of the same name too
                os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)
