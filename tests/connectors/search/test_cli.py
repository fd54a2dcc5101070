"""``dcpgw index`` as a process: an invalid mapping fails at start in one line; kill -9 mid-indexing, a failover
with a rollback, and a restart end with the index equal to the source (docs/search.md)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from connectors.search.indexer import SearchIndexer
from connectors.search.mapping import DocumentMapping
from tests.connectors.search.helpers import expected_index, index_contents
from tests.gateway.processes import CLEAN_ENV, call, dcpgw, dcpgw_background
from tests.harness import Harness, write


@pytest.mark.parametrize(("text", "suffix", "message"), [
    ("{not json", ".json", "not valid JSON"),
    ("types = [", ".toml", "not valid TOML"),
    ('{"types": [{"name": "u", "key_prefix": "u:", "fields": {"age": {"type": "number"}}}]}', ".json",
     "types[0].fields.age.type: 'number' is not one of text, keyword, numeric, date, stored"),
    ('{"types": [{"name": "u", "key_regex": "([", "fields": {}}]}', ".json", "invalid regular expression"),
    ('{"types": [{"name": "u", "fields": {}}]}', ".json", "needs \"key_prefix\" or \"key_regex\""),
    ('{"types": [{"name": "a", "key_prefix": "a", "fields": {"x": "text"}}, '
     '{"name": "b", "key_prefix": "b", "fields": {"x": "numeric"}}]}', ".json", "one type per field name"),
    ('{"types": [{"name": "a", "key_prefix": "a", "fields": {"x": {"type": "text", "pointer": "x"}}}]}', ".json",
     "is not a JSON pointer"),
    ('{"typez": []}', ".json", "unknown member(s) ['typez']"),
])
def test_invalid_mapping_fails_at_start(tmp_path: Path, text: str, suffix: str, message: str) -> None:
    f = tmp_path / f"mapping{suffix}"
    f.write_text(text)
    proc = dcpgw("index", "--topic", "t", "--index-dir", str(tmp_path / "ix"), "--mapping", str(f),
                 "--bootstrap", "127.0.0.1:9", env=CLEAN_ENV)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: mapping {f}") and message in lines[0], proc.stderr
    assert not (tmp_path / "ix").exists()


def test_missing_mapping_file_fails_at_start(tmp_path: Path) -> None:
    proc = dcpgw("index", "--topic", "t", "--mapping", str(tmp_path / "nope.json"), env=CLEAN_ENV)
    assert proc.returncode == 2 and "cannot read it" in proc.stderr


def test_valid_toml_mapping_loads(tmp_path: Path) -> None:
    f = tmp_path / "m.toml"
    f.write_text('[[types]]\nname = "user"\nkey_prefix = "user::"\n[types.fields]\nname = "text"\n'
                 'age = { pointer = "/profile/age", type = "numeric", stored = false }\n')
    m = DocumentMapping.load(f)
    assert m.types[0].fields[1].tokens == ("profile", "age") and not m.types[0].fields[1].stored
    ex = m.extract("user::1", {"name": "A", "profile": {"age": 3}})
    assert ex.fields == {"name": ["A"], "age": [3.0]} and ex.stored == {"name": "A"}


def _run_index(h: Harness, d: Path) -> dict[str, Any]:
    proc = dcpgw("index", "--topic", h.topic, "--index-dir", str(d), "--http-port", "0", "--until-caught-up",
                 "--bootstrap", h.broker.bootstrap_servers, env=CLEAN_ENV, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_kill9_failover_and_restart_end_equal_to_the_source(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=8, rollback_mitigation=False)
    for r in range(10):
        write(h.bucket, 300, start=300 * r)
        h.bucket.set(f"bin{r}", bytes(range(256)))
    h.bucket.flush_all()
    h.settle()
    d = tmp_path / "ix"
    p = dcpgw_background("index", "--topic", h.topic, "--index-dir", str(d), "--http-port", "0",
                         "--bootstrap", h.broker.bootstrap_servers, "--commit-docs", "500")
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        assert "search API on http://" in line, line
        url = line.split(" on ")[1].split(" ")[0]
        deadline = time.monotonic() + 60
        while True:  # kill -9 once something is committed (the rest may be mid-commit)
            try:
                if call(f"{url}/status")["generation"] > 0:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "the indexer never committed"
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    # writes indexed from memory, then lost in a hard failover (the engine restarts from disk: rollback)
    write(h.bucket, 200, start=10_000)
    h.publish_unpersisted()
    out = _run_index(h, d)
    assert out["docs"] > 0
    h.crash_engine()
    write(h.bucket, 50, start=20_000)
    h.bucket.flush_all()
    h.settle()
    out = _run_index(h, d)
    assert out["rollbacks"] > 0
    expected = expected_index(h.bucket.state_snapshot(), DocumentMapping.dynamic_default())
    assert out["docs"] == len(expected)
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
        assert index_contents(ix) == expected


def test_port_in_use_fails_before_the_index_is_opened(tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = dcpgw("index", "--topic", "t", "--index-dir", str(tmp_path / "ix"), "--http-port", str(port),
                     "--bootstrap", "127.0.0.1:9", env=CLEAN_ENV)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "ix").exists()
