"""engine/compiled.py: the engine's compiled modules run only when they match their sources; else the sources."""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import engine.kv.vbucket
from engine import compiled
from engine.compiled import (
    DEPENDS,
    MODULES,
    PURE_PYTHON_ENV,
    source_path,
    source_reason,
    sources_digest,
    stamp_path,
)

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def fake_checkout(root: Path, *, compiled: bool = True, stamp: bool = True) -> None:
    """Sources of MODULES and DEPENDS under ``root``; with ``compiled`` an extension file of each module; with
    ``stamp`` the build stamp of these sources."""
    for m in (*MODULES, *DEPENDS):
        src = source_path(m, root)
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# the source of {m}\n")
        if compiled and m in MODULES:
            src.with_name(src.stem + SUFFIX).write_bytes(b"\x7fELF")
    if stamp:
        stamp_path(root).write_text(json.dumps(sources_digest(root)))


def test_compiled_from_these_sources_is_used(tmp_path: Path) -> None:
    fake_checkout(tmp_path)
    assert source_reason({}, tmp_path) is None


def test_missing_extension_means_sources(tmp_path: Path) -> None:
    fake_checkout(tmp_path, compiled=False)
    reason = source_reason({}, tmp_path)
    assert reason is not None and reason.startswith("not compiled") and "engine.kv.vbucket" in reason


def test_missing_stamp_means_sources(tmp_path: Path) -> None:
    fake_checkout(tmp_path, stamp=False)
    reason = source_reason({}, tmp_path)
    assert reason is not None and "no build stamp" in reason


@pytest.mark.parametrize("edited", [MODULES[-1], DEPENDS[0]])
def test_source_edited_after_the_build_means_sources(tmp_path: Path, edited: str) -> None:
    fake_checkout(tmp_path)
    src = source_path(edited, tmp_path)
    src.write_text(src.read_text() + "X: int = 1\n")
    reason = source_reason({}, tmp_path)
    assert reason is not None
    assert reason.startswith(str(src.relative_to(tmp_path)) + " changed") and "pip install -e ." in reason


def test_pure_python_environment_variable_wins(tmp_path: Path) -> None:
    fake_checkout(tmp_path)
    assert source_reason({PURE_PYTHON_ENV: "1"}, tmp_path) == f"{PURE_PYTHON_ENV} is set"
    assert source_reason({PURE_PYTHON_ENV: ""}, tmp_path) is None


def test_pure_python_process_imports_the_sources_and_works() -> None:
    code = (
        "import engine, engine.kv.vbucket as v, engine.compiled as c\n"
        "from engine import Bucket, BucketConfig\n"
        "import tempfile, pathlib\n"
        "d = tempfile.mkdtemp()\n"
        "b = Bucket(BucketConfig(data_dir=pathlib.Path(d), num_vbuckets=4))\n"
        "b.set(b'k', b'{\"a\": 1}'); b.set(b'k', b'{\"a\": 2}')\n"
        "assert b.get(b'k').value == b'{\"a\": 2}'\n"
        "b.close()\n"
        "print(c.mode, v.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, PURE_PYTHON_ENV: "1"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out[0] == "source:" and out[-1].endswith("vbucket.py"), out


def test_this_install_runs_the_compiled_engine() -> None:
    """CI installs from a clean clone: its tests, and the benchmarks, run the compiled modules."""
    if PURE_PYTHON_ENV in compiled.mode or "changed after" in compiled.mode:
        pytest.skip(f"a developer's checkout: {compiled.mode}")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if compiled.mode.startswith("source: not compiled") and shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the install could not compile the engine")
    assert compiled.mode == "compiled", compiled.mode
    assert not engine.kv.vbucket.__file__.endswith(".py"), engine.kv.vbucket.__file__
