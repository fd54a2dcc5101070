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


@pytest.mark.slow
def test_a_build_without_c_compiler_succeeds_and_the_engine_runs_its_sources(tmp_path: Path) -> None:
    """setup.py's extensions are optional (docs/performance.md "Compiled modules"): where no C compiler runs (a
    slim image), the build warns and goes on, and the engine of that tree runs from its sources. Real build:
    mypyc generates the C, the compiler it is handed does not exist."""
    root = Path(engine.__file__).resolve().parent.parent
    tree = tmp_path / "tree"
    tree.mkdir()
    for f in ("setup.py", "pyproject.toml"):
        shutil.copy2(root / f, tree / f)
    for pkg in ("engine", "schemas"):  # MODULES, DEPENDS and what they import
        shutil.copytree(root / pkg, tree / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.sources.json"))
    env = {k: v for k, v in os.environ.items() if k != PURE_PYTHON_ENV}
    built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree,
                           env={**env, "CC": str(tmp_path / "no-such-cc")}, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    for m in MODULES:  # mypyc ran (its C is there), the compiler did not: each extension failed, with a warning
        assert f'building extension "{m}" failed' in built.stdout + built.stderr, m
    assert not [p for p in tree.rglob("*") if p.suffix in (".so", ".pyd")]
    code = (
        "import pathlib, tempfile\n"
        "import engine, engine.compiled as c, engine.kv.vbucket as v\n"
        "from engine import Bucket, BucketConfig\n"
        "b = Bucket(BucketConfig(data_dir=pathlib.Path(tempfile.mkdtemp()), num_vbuckets=4))\n"
        "b.set(b'k', b'{\"a\": 1}'); b.set(b'k', b'{\"a\": 2}'); b.flush()\n"
        "assert b.get(b'k').value == b'{\"a\": 2}'\n"
        "b.close()\n"
        "print(engine.__file__); print(c.mode); print(v.__file__)\n"
    )
    ran = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    where, mode, vbucket = ran.stdout.splitlines()
    assert Path(where).resolve().is_relative_to(tree), where  # the tree built here, not this checkout
    assert mode.startswith("source: not compiled"), mode
    assert vbucket.endswith("vbucket.py"), vbucket
