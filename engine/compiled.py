"""The engine's compiled modules: its ingest path compiled to C by mypyc at install (docs/performance.md
"Compiled modules").

``setup.py`` compiles :data:`MODULES` -- the same typed source the tests check, no second implementation -- into
extension modules next to their sources (``pip install -e .`` and a regular install alike). They are used only
when they match the source: this module decides at the engine's first import, before any of them is imported.
Every one of them is imported from its ``.py`` source instead when

* ``DCPGW_PURE_PYTHON`` is set (also at install: nothing is compiled), e.g. to profile the engine with py-spy,
  which sees no Python frames inside compiled code;
* one of them was not compiled (no C compiler, an install with ``DCPGW_PURE_PYTHON``);
* a source the compiled code came from -- :data:`MODULES` and the project modules they import, :data:`DEPENDS`
  (mypyc inlines their ``Final`` constants) -- differs from what the build compiled (the sha256 of each, in the
  build stamp :func:`stamp_path`): a checkout edited or switched after its last install, whose extensions
  would run the old code. ``pip install -e .`` compiles them again.

All or none: compiled modules call each other's functions directly in C, so a compiled module next to a source
one would still run the compiled copy of the other. Standard library only: ``setup.py`` loads this file on its
own (not the engine) for :data:`MODULES` and the stamp.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

#: compiled by setup.py, in this order; the ingest path (Bucket.set -> VBucket.store -> CheckpointManager)
MODULES: Final = (
    "engine.kv.item",
    "engine.kv.stored_value",
    "engine.kv.checkpoint",
    "engine.kv.vbucket",
)
#: the project modules :data:`MODULES` import: their sources count for staleness too
DEPENDS: Final = ("engine.exceptions", "engine.kv.locks", "schemas.dcp", "schemas.failover_log")
#: mypyc's shared library of the group (``engine/kv/native__mypyc....so``)
GROUP: Final = "engine.kv.native"
#: set (non-empty) at install: compile nothing; at run time: import :data:`MODULES` from their sources
PURE_PYTHON_ENV: Final = "DCPGW_PURE_PYTHON"

_ROOT: Final = Path(__file__).resolve().parent.parent


def source_path(module: str, root: Path = _ROOT) -> Path:
    """The ``.py`` file of a project module."""
    return root.joinpath(*module.split(".")).with_suffix(".py")


def extension_path(module: str, root: Path = _ROOT) -> Path | None:
    """The compiled extension of ``module`` this interpreter would import, or None."""
    base = source_path(module, root).with_suffix("")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = base.with_name(base.name + suffix)
        if p.exists():
            return p
    return None


def sources_digest(root: Path = _ROOT, modules: Sequence[str] = (*MODULES, *DEPENDS)) -> dict[str, str]:
    """sha256 of each source the compiled code comes from (what the build stamp records)."""
    return {m: hashlib.sha256(source_path(m, root).read_bytes()).hexdigest() for m in modules}


def stamp_path(root: Path = _ROOT) -> Path:
    """The build stamp, next to the group's shared library: :func:`sources_digest` at compile time (JSON)."""
    return source_path(GROUP, root).with_suffix(".sources.json")


def source_reason(environ: Mapping[str, str] = os.environ, root: Path = _ROOT,
                  modules: Sequence[str] = MODULES, depends: Sequence[str] = DEPENDS) -> str | None:
    """Why :data:`MODULES` must be imported from their sources (see the module docstring), or None: every one
    is compiled, from the sources there are now."""
    if environ.get(PURE_PYTHON_ENV):
        return f"{PURE_PYTHON_ENV} is set"
    missing = [m for m in modules if extension_path(m, root) is None]
    if missing:
        return f"not compiled ({', '.join(missing)})"
    try:
        built = json.loads(stamp_path(root).read_text())
    except (OSError, ValueError):
        return f"not compiled (no build stamp {stamp_path(root).name})"
    now = sources_digest(root, (*modules, *depends))
    changed = [m for m in now if built.get(m) != now[m]]
    if changed:
        return (f"{', '.join(str(source_path(m, root).relative_to(root)) for m in changed)} changed after the engine "
                f"was compiled (`pip install -e .` compiles it again)")
    return None


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports :data:`MODULES` from their ``.py`` files (ahead of the path finder, which prefers extensions)."""

    def __init__(self, root: Path, modules: Sequence[str]) -> None:
        self.sources = {m: source_path(m, root) for m in modules}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        src = self.sources.get(fullname)
        if src is None:
            return None
        return importlib.util.spec_from_file_location(fullname, src)


#: how this process runs :data:`MODULES`: ``"compiled"``, or ``"source: <reason>"`` (set by :func:`install`)
mode = "not decided"


def install() -> str:
    """Decide once per process, before the engine imports :data:`MODULES`; returns :data:`mode`. A stale
    compiled build also warns (RuntimeWarning): the engine runs, slower, from its sources."""
    global mode
    if mode != "not decided":
        return mode
    reason = source_reason()
    if reason is None:
        mode = "compiled"
        return mode
    mode = f"source: {reason}"
    sys.meta_path.insert(0, _SourceFinder(_ROOT, MODULES))
    if "changed after" in reason:
        warnings.warn(f"engine: running the source of its compiled modules: {reason}", RuntimeWarning,
                      stacklevel=2)
    return mode


if __name__ == "engine.compiled":  # the engine package imports this module first (setup.py only reads it)
    install()

__all__ = ["DEPENDS", "GROUP", "MODULES", "PURE_PYTHON_ENV", "extension_path", "install", "mode",
           "source_path", "source_reason", "sources_digest", "stamp_path"]
