"""Command-line usage errors of every ``dcpgw`` command (a bad option value, an unknown option or command, a
missing or malformed argument) are one ``error:`` line on stderr and exit status 2, never click's / rich's
multi-line box (docs/reliability.md "Start-up failures and command-line errors"). Run as real processes, both
as ``python -m gateway.cli`` and through the console script's entry point named in pyproject.toml."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.cli import main

ROOT = Path(__file__).resolve().parents[2]
_ENV = {k: v for k, v in os.environ.items()
        if not k.startswith("DCPGW_") and k not in ("KAFKA_BOOTSTRAP_SERVERS",)}


def entry_point() -> list[str]:
    """The ``dcpgw`` console script of pyproject.toml, as a python command line."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["dcpgw"]
    module, func = spec.split(":")
    return [sys.executable, "-c", f"import sys, {module} as m; sys.argv[0] = 'dcpgw'; m.{func}()"]


def run(cmd: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cmd, *args], env=_ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)


MODULE = [sys.executable, "-m", "gateway.cli"]

USAGE_ERRORS = [
    (("load", "--docs", "0"), "--docs"),
    (("load", "--batch", "100001"), "--batch"),
    (("load", "--size", "abc"), "--size"),
    (("load", "--no-such-option"), "--no-such-option"),
    (("no-such-command",), "no-such-command"),
    (("tail",), "vbucket"),
    (("tail", "abc"), "vbucket"),
    (("status", "--top", "-1"), "--top"),
    (("up", "--nodes", "0"), "--nodes"),
    (("up", "--replicas", "9"), "--replicas"),
    (("broker", "--port", "x"), "--port"),
    (("replicate", "--bogus"), "--bogus"),
    (("cluster", "failover"), "node"),
    (("cluster", "nope"), "nope"),
    (("version", "extra"), "extra"),
]


@pytest.mark.parametrize(("args", "names"), USAGE_ERRORS, ids=[" ".join(a) for a, _n in USAGE_ERRORS])
def test_usage_error_is_one_line_and_exit_2(args: tuple[str, ...], names: str) -> None:
    res = run(MODULE, *args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("error: dcpgw"), line
    assert names in line, line
    assert "Traceback" not in res.stderr and "╭" not in res.stderr and "Usage:" not in res.stderr
    assert res.stdout == ""


def test_console_script_entry_point_has_the_same_one_line_errors() -> None:
    res = run(entry_point(), "load", "--docs", "0")
    assert res.returncode == 2, res
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: dcpgw load: ") and "--docs" in lines[0], res.stderr
    ok = run(entry_point(), "version")
    assert ok.returncode == 0 and ok.stdout.strip(), ok


def test_help_and_no_arguments_still_print_the_help() -> None:
    res = run(MODULE, "load", "--help")
    assert res.returncode == 0 and "--docs" in res.stdout and not res.stderr.strip(), res
    res = run(MODULE)
    assert res.returncode == 2 and "load" in res.stdout + res.stderr and "error:" not in res.stderr, res


def test_command_errors_keep_their_exit_status(tmp_path: Path) -> None:
    """A command's own failure (typer.Exit) keeps its status through the entry point: here `dcpgw status`
    with no gateway to reach, one line, exit 2."""
    res = run(MODULE, "status", "--url", "http://127.0.0.1:1")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "cannot reach the gateway" in lines[0], res


# ------------------------------------------------------------------ property, in process (fast)
_bad_count = st.one_of(st.integers(max_value=0).map(str),
                       st.text(alphabet="abcxyz.-+ é", min_size=1, max_size=8).filter(
                           lambda t: not t.strip().lstrip("+").isdigit()))


@settings(max_examples=60, deadline=None)
@given(command=st.sampled_from([["load", "--docs"], ["load", "--batch"], ["load", "--size"], ["status", "--top"],
                                ["up", "--nodes"], ["load", "--max-wait"]]),
       value=_bad_count)
def test_any_bad_option_value_is_one_line(command: list[str], value: str) -> None:
    if command[-1] == "--top" and value.lstrip("-").isdigit():
        value = "-1" if value == "0" else value  # --top 0 is valid
    if command[-1] == "--max-wait" and value.lstrip("-").isdigit():
        value = "-1" if value == "0" else value  # --max-wait 0 is valid
    if command[-1] == "--size" and value.lstrip("-").isdigit():
        value = str(min(int(value), 15))  # below the 16-byte minimum
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            pytest.raises(SystemExit) as ex:
        main([*command, value])
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert ex.value.code == 2, err.getvalue()
    assert len(lines) == 1 and lines[0].startswith("error: dcpgw "), err.getvalue()


@settings(max_examples=40, deadline=None)
@given(name=st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12))
def test_any_unknown_option_is_one_line(name: str) -> None:
    known = {"docs", "size", "batch", "prefix", "start", "url", "data-dir", "max-wait", "help"}
    assume(name not in known and not name.startswith("-"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            pytest.raises(SystemExit) as ex:
        main(["load", f"--{name}"])
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert ex.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: dcpgw load: "), err.getvalue()
