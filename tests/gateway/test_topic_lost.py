"""The broker loses the topic's log under a running gateway (docs/reliability.md "Fault campaign", topic
truncated): the embedded Tansu broker keeps nothing across a restart, so restarting it is "Kafka lost its
log". The gateway must say so (/health/ready ``topic_truncated``, the metric, a log line) and republish every
vbucket from seqno 0 behind a rollback record to 0, so that a rollback-aware consumer (``dcpgw replicate``,
the client library) that kept running converges to the engine -- deletions included."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.broker import EmbeddedTansuBroker
from gateway.invariants import check_partition
from schemas.records import DecodedRecord, RecordType
from tests.credentials import auth_headers
from tests.gateway.kafka_util import TopicReplica, read_topic
from tests.gateway.processes import GatewayProc
from tests.gateway.test_stall import bulk_body, call, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def broker() -> Iterator[EmbeddedTansuBroker]:
    b = EmbeddedTansuBroker().start()
    try:
        yield b
    finally:
        b.stop()


def _restart(broker: EmbeddedTansuBroker) -> EmbeddedTansuBroker:
    port = broker.port
    broker.stop()
    for _ in range(50):
        try:
            return EmbeddedTansuBroker(port=port).start()
        except Exception:
            time.sleep(0.1)
    return EmbeddedTansuBroker(port=port).start()


def _replica(db: Path) -> dict[str, dict[str, object]]:
    try:
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return {k: json.loads(v) for k, v in c.execute("SELECT key, value FROM docs")}
        finally:
            c.close()
    except sqlite3.Error:
        return {}


def _engine(gw: GatewayProc, keys: list[str]) -> dict[str, dict[str, object]]:
    out = {}
    for k in keys:
        status, _h, body, _t = call(gw.url + f"/docs/{k}")
        if status == 200:
            out[k] = body
    return out


def _scenario(broker: EmbeddedTansuBroker, tmp_path: Path, *, replicate: bool, converge_s: float) -> None:
    data = tmp_path / "data"
    data.mkdir()
    gw = GatewayProc(broker, data, "lost")
    gw.start()
    restarted: EmbeddedTansuBroker | None = None
    db = tmp_path / "replica.sqlite"
    rep = None
    if replicate:
        rep = subprocess.Popen([sys.executable, "-m", "gateway.cli", "replicate", "--topic", "dcp.lost",
                                "--bootstrap", broker.bootstrap_servers, "--db", str(db)],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "rep.log", "wb"))  # noqa: SIM115
    stopped = None
    try:
        keys = [f"doc{i}" for i in range(200)]
        assert call(gw.url + "/docs/_bulk", "POST", bulk_body(0, 150, "before"))[0] == 200
        for i in range(0, 40):
            assert call(gw.url + f"/docs/doc{i}", "DELETE")[0] == 200
        gw.wait_caught_up()
        if replicate:
            wait_for(lambda: _replica(db) == _engine(gw, keys), 60, "the replica equal to the engine")

        broker = restarted = _restart(broker)  # Tansu keeps nothing: the topic's log is gone
        # writes after the loss: their delivery reports reveal it
        assert call(gw.url + "/docs/_bulk", "POST", bulk_body(150, 200, "after"))[0] == 200
        for i in range(40, 60):
            assert call(gw.url + f"/docs/doc{i}", "DELETE")[0] == 200
        seen: list[str] = []

        def truncation_reported() -> bool:
            _s, _h, body, _t = call(gw.url + "/health/ready")
            seen.extend(r for r in body.get("reasons", []) if r.startswith("topic_truncated"))
            return "dcpgw_topic_truncations_total 1.0" in urllib_text(gw.url + "/metrics")

        wait_for(truncation_reported, 40, "the truncation counted in /metrics")
        wait_for(lambda: call(gw.url + "/health/ready")[0] == 200, 60, "/health/ready 200 after the republish")
        gw.wait_caught_up()
        engine = _engine(gw, keys)
        assert len(engine) == 140 and "doc10" not in engine and engine["doc199"]["tag"] == "after"
        assert "lost records Kafka had acknowledged" in (tmp_path / "gw.log").read_text()
        # the topic as it is now, read from its start by a rollback-aware replica: equal to the engine; every
        # vbucket starts with a rollback record to 0 and the invariants hold from it on
        recs = read_topic(broker.bootstrap_servers, "dcp.lost")
        replica = TopicReplica()
        replica.apply_all(recs)
        assert {k.decode(): json.loads(v) for k, (v, _vb) in replica.state().items()} == engine
        by_vb: dict[int, list[tuple[int, DecodedRecord]]] = {}
        for _p, off, r in recs:
            by_vb.setdefault(r.vbucket, []).append((off, r))
        for _vb, rs in by_vb.items():
            starts = [i for i, (_o, r) in enumerate(rs) if r.type is RecordType.ROLLBACK and r.snap_end == 0]
            assert starts, f"vbucket {_vb}: no rollback record to 0"
            check_partition(rs[starts[-1]:])
        if replicate:
            # the consumer that kept running converges to the engine (deleted documents gone)
            wait_for(lambda: _replica(db) == engine, converge_s, "the running replica equal to the engine")
    finally:
        if rep is not None:
            rep.kill()
            rep.wait()
        assert gw.proc is not None
        gw.proc.terminate()
        stopped = gw.proc.wait(60)
        if restarted is not None:
            restarted.stop()
    assert stopped == 0, (tmp_path / "gw.log").read_text()[-3000:]


def test_running_gateway_republishes_after_the_broker_lost_the_topic(
        broker: EmbeddedTansuBroker, tmp_path: Path) -> None:
    _scenario(broker, tmp_path, replicate=False, converge_s=0)


def test_running_replicator_converges_after_the_broker_lost_the_topic(
        broker: EmbeddedTansuBroker, tmp_path: Path) -> None:
    _scenario(broker, tmp_path, replicate=True, converge_s=20)


def urllib_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=10) as r:
        body: bytes = r.read()
        return body.decode()


def test_start_finds_the_checkpoints_beyond_the_partition_end(broker: EmbeddedTansuBroker, tmp_path: Path) -> None:
    """The data topic lost its log while the gateway was down (here: deleted, the checkpoint topic kept): the
    next start sees checkpointed offsets at or beyond the partitions' ends and republishes from seqno 0."""
    from confluent_kafka.admin import AdminClient

    data = tmp_path / "data"
    data.mkdir()
    gw = GatewayProc(broker, data, "gone")
    gw.start()
    keys = [f"doc{i}" for i in range(100)]
    try:
        assert call(gw.url + "/docs/_bulk", "POST", bulk_body(0, 100, "before"))[0] == 200
        for i in range(0, 30):
            assert call(gw.url + f"/docs/doc{i}", "DELETE")[0] == 200
        gw.wait_caught_up()
        time.sleep(0.5)  # a checkpoint interval (0.2 s) after the last acknowledgement
    finally:
        gw.stop()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for f in admin.delete_topics(["dcp.gone"], operation_timeout=10).values():
        f.result()
    wait_for(lambda: "dcp.gone" not in admin.list_topics(timeout=5).topics, 10, "the topic deleted")
    gw.start()
    try:
        gw.wait_caught_up()
        assert "dcpgw_topic_truncations_total 1.0" in urllib_text(gw.url + "/metrics")
        wait_for(lambda: call(gw.url + "/health/ready")[0] == 200, 30, "/health/ready 200 after the republish")
        engine = _engine(gw, keys)
        assert len(engine) == 70
    finally:
        gw.stop()
    recs = read_topic(broker.bootstrap_servers, "dcp.gone")
    firsts: dict[int, DecodedRecord] = {}
    for _p, _o, r in recs:
        firsts.setdefault(r.vbucket, r)
    assert firsts and all(r.type is RecordType.ROLLBACK and r.snap_end == 0 for r in firsts.values())
    replica = TopicReplica()
    replica.apply_all(recs)
    assert {k.decode(): json.loads(v) for k, (v, _vb) in replica.state().items()} == engine
