"""Build step of the package (everything else is in pyproject.toml): compiles the engine's ingest path with
mypyc (engine/compiled.py, docs/performance.md "Compiled modules").

``DCPGW_PURE_PYTHON=1 pip install -e .`` compiles nothing; the engine then runs its sources (the same code), as
it does when an extension fails to build (no C compiler: the install warns and goes on).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def compiled_rules() -> ModuleType:
    """engine/compiled.py on its own (standard library only): the module list and the build stamp's rules,
    without importing the engine."""
    spec = importlib.util.spec_from_file_location("dcpgw_build_compiled", ROOT / "engine" / "compiled.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithStamp(build_ext):
    """build_ext, then the build stamp next to the compiled modules: which sources they were compiled from."""

    def run(self) -> None:
        super().run()
        rules = compiled_rules()
        out = rules.stamp_path(ROOT if self.inplace else Path(self.build_lib))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rules.sources_digest(ROOT), indent=1, sort_keys=True) + "\n")


def ext_modules() -> list[Any]:
    rules = compiled_rules()
    if os.environ.get(rules.PURE_PYTHON_ENV):
        return []
    from mypyc.build import mypycify

    paths = [str(rules.source_path(m, Path("."))) for m in rules.MODULES]
    # No config file (pyproject's [tool.mypy] loads the pydantic plugin, absent from the build environment);
    # imported modules are read for their types only, and their errors are mypy's job in CI, not the build's.
    options = ["--config-file=", "--python-version=3.11", "--follow-imports=silent", "--ignore-missing-imports"]
    extensions = mypycify([*options, *paths], opt_level="3", group_name=rules.GROUP)
    for ext in extensions:
        # no C compiler: the install goes on without them, and the engine runs its sources (engine/compiled.py)
        ext.optional = True
    return list(extensions)


setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildWithStamp})
