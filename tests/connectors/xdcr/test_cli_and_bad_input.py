"""``dcpgw xdcr`` and ``dcpgw xdcr status`` as subprocesses, and every bad input of the replicator: an
unreachable target, a target of another conflict-resolution mode, a corrupt record, a target refusing a
document for size, a filter change without a choice, a bad target URL and regex."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from connectors.xdcr.errors import ConflictModeMismatch, FilterChanged, TargetUnreachable, XdcrError
from connectors.xdcr.filters import Filters
from connectors.xdcr.metrics import StatusServer
from connectors.xdcr.replicator import DEAD_LETTER_FILE, XdcrReplicator, XdcrSettings, read_status
from engine import vbucket_of
from tests.connectors.xdcr.harness import diverging, source_docs, target_docs, target_node
from tests.gateway.processes import dcpgw
from tests.harness import Harness, write


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loaded(h: Harness, n: int = 120) -> None:
    write(h.bucket, n)
    h.bucket.flush_all()
    h.settle()


def test_cli_until_caught_up_then_status(harness: Harness, target: Any, tmp_path: Path) -> None:
    h = harness
    _loaded(h)
    state = tmp_path / "state"
    proc = dcpgw("xdcr", "--topic", h.topic, "--target", f"couchbase://127.0.0.1:{target.port}",
                 "--state-dir", str(state), "--bootstrap", h.broker.bootstrap_servers, "--until-caught-up",
                 timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    src = source_docs(h.bucket)
    assert out["written"] == len(src) and out["vbuckets"] == h.nvb
    assert not diverging(src, target_docs(target, {k: vbucket_of(k, h.nvb) for k in src}))
    st = dcpgw("xdcr", "status", "--state-dir", str(state))
    assert st.returncode == 0, st.stderr
    doc = json.loads(st.stdout)
    assert doc["counters"]["written"] == len(src) and doc["counters"]["target"]["state"] == "ok"
    assert set(doc["vbuckets"]) == {str(v) for v in range(h.nvb)}
    vb0 = doc["vbuckets"]["0"]
    assert vb0["applied_seqno"] > 0 and vb0["target_vbuuid"] != 0 and vb0["checkpoints"] >= 1


def test_cli_status_of_a_missing_state_dir(tmp_path: Path) -> None:
    proc = dcpgw("xdcr", "status", "--state-dir", str(tmp_path / "none"))
    assert proc.returncode == 2 and "no XDCR state" in proc.stderr


def test_cli_unreachable_target_is_a_clear_error_and_shown_in_status(harness: Harness, tmp_path: Path) -> None:
    h = harness
    state = tmp_path / "state"
    proc = dcpgw("xdcr", "--topic", h.topic, "--target", f"couchbase://127.0.0.1:{_free_port()}",
                 "--state-dir", str(state), "--bootstrap", h.broker.bootstrap_servers, "--until-caught-up",
                 "--give-up-after", "1", timeout=60)
    assert proc.returncode == 3, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: target couchbase://127.0.0.1:") and "cannot connect" in last
    st = read_status(state)
    assert st["counters"]["target"]["state"] == "unreachable" and st["counters"]["retries"] >= 2


def test_cli_bad_target_url_and_bad_regex(harness: Harness, tmp_path: Path) -> None:
    h = harness
    base = ["xdcr", "--topic", h.topic, "--state-dir", str(tmp_path / "s"), "--bootstrap",
            h.broker.bootstrap_servers]
    proc = dcpgw(*base, "--target", "http://x:1")
    assert proc.returncode == 2 and "couchbase://HOST:KVPORT" in proc.stderr
    proc = dcpgw(*base, "--target", "couchbase://127.0.0.1:1", "--filter-key", "(")
    assert proc.returncode == 2 and "not a valid regular expression" in proc.stderr


def test_target_of_another_conflict_mode_is_refused(harness: Harness, tmp_path: Path) -> None:
    node = target_node(tmp_path, "lww", mode="lww")
    try:
        with XdcrReplicator(harness.client, harness.topic, f"couchbase://127.0.0.1:{node.port}",
                            tmp_path / "state") as r, pytest.raises(ConflictModeMismatch, match="lww"):
            r.start()
    finally:
        node.kill()


def test_corrupt_record_goes_to_the_dead_letter_and_replication_goes_on(harness: Harness, target: Any,
                                                                       tmp_path: Path) -> None:
    h = harness
    _loaded(h, 40)
    p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
    p.produce(h.topic, value=b"\x00garbage", key=b"k", partition=0, headers=[("dcp.type", b"mutation")])
    p.flush(10)
    write(h.bucket, 40, start=1000)
    h.bucket.flush_all()
    h.settle()
    with XdcrReplicator(h.client, h.topic, f"couchbase://127.0.0.1:{target.port}", tmp_path / "state") as r:
        r.run(until_caught_up=True)
        assert r.metrics.corrupt_records == 1 and r.metrics.dead_letters == 1
    src = source_docs(h.bucket)
    assert not diverging(src, target_docs(target, {k: vbucket_of(k, h.nvb) for k in src}))
    entries = [json.loads(x) for x in (tmp_path / "state" / DEAD_LETTER_FILE).read_text().splitlines()]
    assert entries[0]["reason"] == "corrupt_record" and entries[0]["partition"] == 0


def test_target_refusing_a_document_for_size(harness: Harness, tmp_path: Path) -> None:
    h = harness
    node = target_node(tmp_path, "small", max_value_size=1000)
    try:
        h.bucket.set("big", b'{"x": "' + b"y" * 5000 + b'"}')
        _loaded(h, 20)
        with XdcrReplicator(h.client, h.topic, f"couchbase://127.0.0.1:{node.port}", tmp_path / "state") as r:
            r.run(until_caught_up=True)
            assert r.metrics.rejected.get("too_big") == 1
            assert r.metrics.written == len(source_docs(h.bucket)) - 1
        entries = [json.loads(x) for x in (tmp_path / "state" / DEAD_LETTER_FILE).read_text().splitlines()]
        assert [e["key"] for e in entries if e["reason"] == "too_big"] == ["big"]
    finally:
        node.kill()


def test_filter_change_needs_an_explicit_choice(harness: Harness, target: Any, tmp_path: Path) -> None:
    h = harness
    _loaded(h, 60)
    url = f"couchbase://127.0.0.1:{target.port}"
    state = tmp_path / "state"
    with XdcrReplicator(h.client, h.topic, url, state,
                        settings=XdcrSettings(filters=Filters(key_regex="^k1"))) as r:
        r.run(until_caught_up=True)
        first = r.metrics.written
        assert 0 < first < len(source_docs(h.bucket)) and r.metrics.filtered > 0
    with XdcrReplicator(h.client, h.topic, url, state) as r, pytest.raises(FilterChanged, match="--restream"):
        r.start()
    with XdcrReplicator(h.client, h.topic, url, state, settings=XdcrSettings(restream=False)) as r:
        r.run(until_caught_up=True)
        assert r.metrics.written == first  # nothing new: the positions were kept
    with XdcrReplicator(h.client, h.topic, url, state,
                        settings=XdcrSettings(filters=Filters(key_regex="^k2"), restream=True)) as r:
        r.run(until_caught_up=True)
        assert r.metrics.written > first  # everything again under the new filter
    keys = {k: vbucket_of(k, h.nvb) for k in source_docs(h.bucket)}
    tgt = target_docs(target, keys)
    assert any(k.startswith(b"k2") for k in tgt) and not any(k.startswith(b"k3") for k in tgt)


def test_status_and_prometheus_over_http(harness: Harness, target: Any, tmp_path: Path) -> None:
    h = harness
    _loaded(h, 30)
    with XdcrReplicator(h.client, h.topic, f"couchbase://127.0.0.1:{target.port}", tmp_path / "state") as r:
        r.run(until_caught_up=True)
        srv = StatusServer(r.status)
        try:
            base = f"http://127.0.0.1:{srv.port}"
            st = json.loads(urllib.request.urlopen(base + "/status", timeout=10).read())
            assert st["counters"]["written"] == r.metrics.written and "lag_seconds" in st["vbuckets"]["0"]
            text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
            assert f"dcpgw_xdcr_docs_written_total {r.metrics.written}" in text
            assert 'dcpgw_xdcr_vbucket_lag_seqnos{vbucket="0"} 0' in text
            assert "dcpgw_xdcr_batch_latency_seconds_count" in text
            assert "dcpgw_xdcr_target_history_lost_total 0" in text
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + "/nope", timeout=10)
            assert e.value.code == 404 and json.loads(e.value.read())["error"] == "not_found"
        finally:
            srv.close()


def test_bad_target_spec_is_refused(tmp_path: Path) -> None:
    with pytest.raises(XdcrError, match="couchbase://"):
        XdcrReplicator("127.0.0.1:1", "t", "couchbase:///nohost", tmp_path)


def test_unreachable_target_in_process_gives_up_after_the_bound(harness: Harness, tmp_path: Path) -> None:
    with XdcrReplicator(harness.client, harness.topic, f"couchbase://127.0.0.1:{_free_port()}", tmp_path / "s",
                        settings=XdcrSettings(give_up_after=0.5)) as r, pytest.raises(TargetUnreachable):
        r.start()
    assert r.metrics.target_state == "unreachable"


@pytest.mark.slow
def test_kill_9_of_the_replicator_process_then_catch_up(harness: Harness, target: Any, tmp_path: Path) -> None:
    """``dcpgw xdcr`` SIGKILLed while it replicates (several times, at different points), then run to the end:
    the target equals the source (documents and metadata), a lost branch included."""
    import signal
    import subprocess
    import time

    from tests.gateway.processes import CLI, ROOT

    h = harness
    state = tmp_path / "state"
    args = ["xdcr", "--topic", h.topic, "--target", f"couchbase://127.0.0.1:{target.port}", "--state-dir",
            str(state), "--bootstrap", h.broker.bootstrap_servers, "--batch-docs", "50"]
    for round_ in range(3):
        write(h.bucket, 400, start=round_ * 300)
        if round_ == 1:
            h.publish_unpersisted()
        else:
            h.bucket.flush_all()
            h.settle()
        p = subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.0 + round_)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        if round_ == 1:
            h.crash_engine()
    h.bucket.flush_all()
    h.settle()
    proc = dcpgw(*args, "--until-caught-up", timeout=180)
    assert proc.returncode == 0, proc.stderr
    src = source_docs(h.bucket)
    every = {f"k{i}".encode() for i in range(1300)} | set(src)  # the lost branch's keys too
    assert not diverging(src, target_docs(target, {k: vbucket_of(k, h.nvb) for k in every}))
    assert json.loads(proc.stdout.strip().splitlines()[-1])["rollbacks"] + read_status(state)["counters"][
        "rollbacks"] > 0


def test_cli_http_port_serves_metrics_and_sigterm_stops_cleanly(harness: Harness, target: Any,
                                                                tmp_path: Path) -> None:
    import re
    import signal
    import subprocess
    import time

    from tests.gateway.processes import CLI, ROOT

    h = harness
    _loaded(h, 50)
    p = subprocess.Popen([*CLI, "xdcr", "--topic", h.topic, "--target", f"couchbase://127.0.0.1:{target.port}",
                          "--state-dir", str(tmp_path / "s"), "--bootstrap", h.broker.bootstrap_servers,
                          "--http-port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/status", line)
        assert m, line
        base = f"http://127.0.0.1:{m.group(1)}"
        deadline = time.monotonic() + 60
        while True:
            st = json.loads(urllib.request.urlopen(base + "/status", timeout=10).read())
            if st["counters"]["written"] == len(source_docs(h.bucket)):
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        assert "dcpgw_xdcr_target_up 1" in text
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["written"] == st["counters"]["written"]
    finally:
        if p.poll() is None:
            p.kill()
