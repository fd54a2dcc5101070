"""Start-up failures and bad command-line input, run as real ``dcpgw`` processes: each is one ``error:`` line on
stderr and a non-zero exit, never a traceback, never silence (docs/reliability.md, "Start-up failures and
command-line errors")."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.broker import Broker
from tests.credentials import auth_headers
from tests.gateway import processes
from tests.gateway.processes import CLEAN_ENV, GatewayProc, dcpgw_background


def dcpgw(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """``dcpgw ARGS`` with CLEAN_ENV and ``env``."""
    return processes.dcpgw(*args, env={**CLEAN_ENV, **env}, timeout=timeout)


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    """The run failed with exactly one non-empty stderr line, an ``error:`` line; returns it."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr and "╭" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------------- dcpgw up
def test_unreachable_kafka_fails_within_the_connect_timeout_naming_the_address(tmp_path: Path) -> None:
    started = time.monotonic()
    res = dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--http-port", "0",
                KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    took = time.monotonic() - started
    line = one_error_line(res)
    assert "127.0.0.1:1" in line and "unreachable" in line, line
    assert "kafka_connect_timeout_s" in line
    assert took < 25, f"took {took:.1f}s with the default 10 s connect timeout"  # "did not hang" bound
    assert "%3|" not in res.stdout + res.stderr  # no raw librdkafka log lines


def test_kafka_connect_timeout_setting(tmp_path: Path) -> None:
    started = time.monotonic()
    res = dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--http-port", "0",
                KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1", DCPGW_KAFKA_CONNECT_TIMEOUT_S="1")
    assert "no answer within 1s" in one_error_line(res)
    assert time.monotonic() - started < 15


def test_issue_3_option_names_port_and_vbuckets(tmp_path: Path) -> None:
    """``dcpgw up --port`` and ``--vbuckets`` (issue 3's names of --http-port and --num-vbuckets) are accepted:
    the port taken is reported under its setting's name, a bad vbucket count names the setting."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_error_line(dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--port", str(port),
                                    "--vbuckets", "16", KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1"))
    assert f"127.0.0.1:{port} (http_port)" in line, line
    line = one_error_line(dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--port", "0",
                                "--vbuckets", "0", KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1"))
    assert "num_vbuckets" in line, line


def test_a_malformed_url_is_one_line(tmp_path: Path) -> None:
    for cmd in (("load", "--docs", "10"), ("status",)):
        line = one_error_line(dcpgw(*cmd, "--url", "notaurl", "--data-dir", str(tmp_path)))
        assert "--url 'notaurl'" in line and "http://" in line, line


def test_replicas_without_nodes_is_refused(tmp_path: Path) -> None:
    line = one_error_line(dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--replicas", "2",
                                KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1"))
    assert "--replicas needs --nodes" in line, line


def test_http_port_in_use(kafka_broker: Broker, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--http-port", str(port),
                    KAFKA_BOOTSTRAP_SERVERS=kafka_broker.bootstrap_servers)
    line = one_error_line(res)
    assert f"127.0.0.1:{port}" in line and "in use" in line, line


def test_data_dir_that_cannot_be_written(kafka_broker: Broker, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    res = dcpgw("up", "--no-progress", "--data-dir", str(a_file / "data"), "--http-port", "0",
                KAFKA_BOOTSTRAP_SERVERS=kafka_broker.bootstrap_servers)
    line = one_error_line(res)
    assert str(a_file / "data") in line and "not writable" in line, line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_data_dir_without_write_permission(kafka_broker: Broker, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        res = dcpgw("up", "--no-progress", "--data-dir", str(ro), "--http-port", "0",
                    KAFKA_BOOTSTRAP_SERVERS=kafka_broker.bootstrap_servers)
        assert "Permission denied" in one_error_line(res)
    finally:
        ro.chmod(0o700)


def test_embedded_broker_that_does_not_start(tmp_path: Path) -> None:
    res = dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), "--http-port", "0",
                DCPGW_BROKER="embedded", CALF_TANSU_BIN="/bin/false")
    line = one_error_line(res)
    assert "did not get ready" in line and "broker log:" in line, line
    res = dcpgw("up", "--no-progress", "--data-dir", str(tmp_path / "d"), DCPGW_BROKER="nope")
    assert "DCPGW_BROKER" in one_error_line(res)


def test_user_commands_on_a_data_directory_that_does_not_exist(tmp_path: Path) -> None:
    """A mistyped --data-dir of `dcpgw user list / delete / passwd` is one error line, not an empty new store;
    `dcpgw user add` creates the directory."""
    typo = tmp_path / "typo"
    for args in (("list",), ("delete", "bob"), ("passwd", "bob", "--password", "pw-1")):
        line = one_error_line(dcpgw("user", *args, "--data-dir", str(typo)))
        assert str(typo) in line and "does not exist" in line, line
        assert not typo.exists()
    res = dcpgw("user", "add", "bob", "--password", "pw-1", "--role", "data_reader", "--data-dir", str(typo))
    assert res.returncode == 0 and "added user bob" in res.stdout, res.stderr
    assert dcpgw("user", "list", "--data-dir", str(typo)).stdout.splitlines() == ["bob\tdata_reader"]


def test_bad_config_value_and_invalid_toml(tmp_path: Path) -> None:
    assert "http_port" in one_error_line(dcpgw("up", DCPGW_HTTP_PORT="-1"))
    bad = tmp_path / "bad.toml"
    bad.write_text('http_port = [\n')
    assert "not valid TOML" in one_error_line(dcpgw("up", "-c", str(bad)))
    two = tmp_path / "two.toml"
    two.write_text('http_port = "x"\nbucket = "a%b"\n')
    line = one_error_line(dcpgw("up", "-c", str(two)))
    assert "http_port" in line and "bucket" in line and "2 problems" in line


# ------------------------------------------------------------------------------------------- dcpgw tail
def test_tail_rejects_a_vbucket_outside_the_topic(kafka_broker: Broker, make_topic: Any, tmp_path: Path) -> None:
    topic = make_topic(partitions=4)
    common = ("--topic", topic, "--bootstrap", kafka_broker.bootstrap_servers, "--data-dir", str(tmp_path))
    line = one_error_line(dcpgw("tail", "99999", *common))
    assert "99999" in line and "4 partitions" in line, line
    one_error_line(dcpgw("tail", "4", *common))
    assert "negative" in one_error_line(dcpgw("tail", *common, "--", "-1"))
    ok = dcpgw("tail", "3", *common)  # exists, empty: prints nothing, exit 0
    assert ok.returncode == 0, ok.stderr
    # the running gateway's state names the bucket's vbucket count
    (tmp_path / "dcpgw-state.json").write_text(json.dumps(
        {"topic": topic, "bootstrap_servers": kafka_broker.bootstrap_servers, "num_vbuckets": 2}))
    line = one_error_line(dcpgw("tail", "3", "--data-dir", str(tmp_path)))
    assert "2 vbuckets" in line, line


def test_tail_and_replicate_with_unreachable_kafka(tmp_path: Path) -> None:
    for cmd in (("tail", "0"), ("replicate", "--db", str(tmp_path / "r.sqlite"))):
        started = time.monotonic()
        res = dcpgw(*cmd, "--topic", "t", "--bootstrap", "127.0.0.1:1", "--data-dir", str(tmp_path),
                    DCPGW_KAFKA_CONNECT_TIMEOUT_S="1")
        assert "127.0.0.1:1" in one_error_line(res)
        assert time.monotonic() - started < 15


# ------------------------------------------------------------------------------------------- dcpgw load
@pytest.fixture
def gateway(kafka_broker: Broker, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    gw = GatewayProc(kafka_broker, tmp_path / "gw", f"l{uuid.uuid4().hex[:8]}", nvb=8, base_env=CLEAN_ENV,
                     checkpoint_interval_s=None)
    gw.start()
    try:
        assert gw.proc is not None
        yield gw.proc, gw.url
    finally:
        gw.close()


def _exists(url: str, key: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/docs/{key}", headers=auth_headers()),
                                    timeout=10):
            return True
    except urllib.error.HTTPError as e:
        assert e.code == 404
        return False


def _load_until_written(url: str, *args: str) -> subprocess.Popen[str]:
    """A running `dcpgw load` of many documents, once it has counted at least two batches as acknowledged: it
    sends one batch at a time, so a third batch in the gateway means the answer to the second was counted (the
    second batch alone in the gateway does not: its answer may still be on its way when the signal comes)."""
    proc = dcpgw_background("load", "--url", url, "--docs", "10000000", "--batch", "200", "--size", "64", *args)
    deadline = time.monotonic() + 60
    prefix = args[args.index("--prefix") + 1]
    while not _exists(url, f"{prefix}{599:07d}"):  # keys PREFIX + 7 digits  # three batches written: two acknowledged and counted
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


def _acknowledged(stderr: str) -> int:
    line = [ln for ln in stderr.splitlines() if ln.strip()][-1]
    assert line.startswith("error: ") and "of 10000000 documents acknowledged" in line, stderr[-2000:]
    return int(line.split(": ")[-1].split(" of ")[0])


@pytest.mark.parametrize(("sig", "code", "why"), [(signal.SIGINT, 130, "interrupted"),
                                                 (signal.SIGTERM, 143, "terminated")])
def test_load_killed_midway_says_how_many_documents_were_acknowledged(
        gateway: tuple[subprocess.Popen[bytes], str], sig: int, code: int, why: str) -> None:
    _gw, url = gateway
    proc = _load_until_written(url, "--prefix", "k:")
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert why in err and "Traceback" not in err, err
    n = _acknowledged(err)
    assert n >= 400 and n % 200 == 0
    assert _exists(url, f"k:{n - 1:07d}")  # every acknowledged document is there


def test_load_when_the_gateway_goes_away_says_how_many_were_acknowledged(
        gateway: tuple[subprocess.Popen[bytes], str]) -> None:
    gw, url = gateway
    proc = _load_until_written(url, "--prefix", "g:")
    gw.send_signal(signal.SIGKILL)
    _out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err
    assert "cannot reach the gateway" in err or "HTTP" in err, err
    assert "Traceback" not in err
    assert _acknowledged(err) >= 400
