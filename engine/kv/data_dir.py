"""One process per data directory, and what a data directory holds (docs/reliability.md "Data directory").

:class:`DataDirLock` is an exclusive ``flock(2)`` on ``<data dir>/dcpgw.lock`` held for the life of the process
that owns the directory (``dcpgw up``, an ``engine.network.server`` node process). The file holds the owner's pid, so a
second process names it when it is refused. The kernel drops the lock when the holder exits, however it exits
(kill -9 included); the file itself stays (it is never the lock, only where the pid is written).

:func:`layout` tells a single bucket's directory (``<bucket>.sqlite3`` at the top) from a cluster's (the vbucket
map ``vbucket_map.json`` and one sub-directory per node holding that node's ``<bucket>.sqlite3``), so a gateway
started in the other mode refuses instead of ignoring the data there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from enum import StrEnum
from pathlib import Path
from typing import Self

from engine.exceptions import InvalidArgument

__all__ = [
    "LOCK_FILE", "MAP_FILE", "DataDirLock", "DataDirLocked", "DataDirMismatch", "Layout", "check_layout",
    "cluster_node_dirs", "layout", "single_bucket_files",
]

LOCK_FILE = "dcpgw.lock"
#: the cluster's vbucket map under its base directory (engine/cluster/local.py)
MAP_FILE = "vbucket_map.json"
#: a bucket's SQLite file is ``<bucket name>`` + this (engine/bucket.py)
STORE_SUFFIX = ".sqlite3"


class DataDirLocked(InvalidArgument):
    """Another live process holds the data directory's lock."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        self.data_dir = data_dir
        self.pid = pid
        holder = f"process {pid}" if pid else "another process"
        super().__init__(f"data directory {data_dir} is in use by {holder} (lock {data_dir / LOCK_FILE}); "
                         f"stop it first or use another --data-dir")


class DataDirMismatch(InvalidArgument):
    """The data directory holds data of the other mode (a single bucket vs a cluster)."""


class DataDirLock:
    """An exclusive lock on a data directory for as long as this object holds it (see the module doc)."""

    def __init__(self, data_dir: Path | str) -> None:
        self.data_dir = Path(data_dir)
        self._fd: int | None = None

    @classmethod
    def acquire(cls, data_dir: Path | str) -> DataDirLock:
        lock = cls(data_dir)
        lock.lock()
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def lock(self) -> None:
        """Take the lock (creating the directory if needed) or raise :class:`DataDirLocked` at once, naming the
        holder's pid. Other failures (not a directory, no permission) raise ``OSError``."""
        if self._fd is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        path = self.data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DataDirLocked(self.data_dir, holder_pid(self.data_dir)) from None
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the pid is cleared first, while still held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> Self:
        self.lock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_pid(data_dir: Path | str, wait_s: float = 1.0) -> int | None:
    """The pid written in the lock file (the holder writes it right after locking: wait briefly for it)."""
    path = Path(data_dir) / LOCK_FILE
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text().strip()
            if text:
                return int(text)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


class Layout(StrEnum):
    EMPTY = "empty"
    BUCKET = "bucket"
    CLUSTER = "cluster"


def single_bucket_files(data_dir: Path | str) -> list[Path]:
    """The bucket stores at the top of ``data_dir`` (a single bucket's data)."""
    d = Path(data_dir)
    return sorted(p for p in d.glob(f"*{STORE_SUFFIX}") if p.is_file()) if d.is_dir() else []


def cluster_node_dirs(data_dir: Path | str) -> list[Path]:
    """Sub-directories of ``data_dir`` holding a bucket store (cluster nodes' data)."""
    d = Path(data_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and any(p.glob(f"*{STORE_SUFFIX}")))


def layout(data_dir: Path | str) -> Layout:
    """What ``data_dir`` holds: a cluster (a map file, damaged or not, or node directories), a single bucket,
    or nothing yet."""
    d = Path(data_dir)
    if (d / MAP_FILE).exists() or cluster_node_dirs(d):
        return Layout.CLUSTER
    if single_bucket_files(d):
        return Layout.BUCKET
    return Layout.EMPTY


def check_layout(data_dir: Path | str, *, cluster: bool) -> Layout:
    """Refuse (:class:`DataDirMismatch`) to start a cluster on a single bucket's directory or a single bucket on
    a cluster's; returns the layout found."""
    d = Path(data_dir)
    found = layout(d)
    if cluster and found is Layout.BUCKET:
        names = ", ".join(p.name for p in single_bucket_files(d))
        raise DataDirMismatch(f"data directory {d} holds single-bucket data ({names}): start it without --nodes, "
                              f"or use another --data-dir for a cluster")
    if not cluster and found is Layout.CLUSTER:
        nodes = ", ".join(p.name for p in cluster_node_dirs(d)) or "none"
        raise DataDirMismatch(f"data directory {d} holds a cluster (vbucket map / nodes: {nodes}): start it with "
                              f"--nodes N, or use another --data-dir for a single bucket")
    return found
