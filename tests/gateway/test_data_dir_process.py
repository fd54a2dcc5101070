"""One `dcpgw up` per data directory, with real processes (issue 16 item 4; docs/reliability.md "Data directory").

Two `dcpgw up` on one directory used to both accept writes (same vbucket, seqno 1, two vbuuids); on stop the second
deleted the first's state file and after a restart an acknowledged value of the first was gone. Now the second
exits non-zero within 10 s naming the holder's pid, the first keeps working and keeps every acknowledged write;
kill -9 of the holder frees the directory. A cluster start on a single bucket's directory (and the reverse)
refuses instead of ignoring that data; a cluster whose map file was emptied comes up from its nodes' states."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from engine.cluster.local import MAP_FILE
from gateway.broker import Broker
from tests.credentials import auth_headers
from tests.gateway.processes import NVB, GatewayProc, dcpgw, docs, request

pytestmark = pytest.mark.slow


def _up(gw: GatewayProc, *args: str, timeout: float = 10.0) -> tuple[int, str, float]:
    """Run another `dcpgw up` with ``gw``'s environment; it must exit by itself within ``timeout``."""
    t0 = time.monotonic()
    p = dcpgw("up", "--no-progress", *args, env=gw.env, timeout=timeout + 20)
    return p.returncode, p.stderr, time.monotonic() - t0


def _get(gw: GatewayProc, key: str) -> bytes:
    return request(f"{gw.url}/docs/{key}")


def test_second_up_on_one_data_dir_refuses_and_the_first_keeps_its_writes(kafka_broker: Broker,
                                                                          tmp_path: Path) -> None:
    bucket = f"l{uuid.uuid4().hex[:8]}"
    data = tmp_path / "data"
    first = GatewayProc(kafka_broker, data, bucket)
    first.start()
    assert first.proc is not None
    try:
        first.bulk(docs(0, 200))
        state_before = (data / "dcpgw-state.json").read_text()
        code, err, took = _up(first)
        assert code != 0
        assert took < 10, took  # refused, not waited for
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1, err  # one line, no traceback
        assert f"process {first.proc.pid}" in lines[0] and "in use" in lines[0]
        # the first is untouched and keeps working: same state file, more writes acknowledged
        assert (data / "dcpgw-state.json").read_text() == state_before
        first.bulk(docs(200, 400))
        first.bulk([{"key": "doc7", "value": {"n": 7, "v": "last"}}])
        first.wait_caught_up()
    finally:
        first.stop()
    again = GatewayProc(kafka_broker, data, bucket)
    again.start()
    try:
        for i in range(400):
            want = {"n": i, "v": "last"} if i == 7 else {"n": i, "v": 0 if i < 200 else 200}
            assert json.loads(_get(again, f"doc{i}")) == want
        # kill -9 of the holder releases the lock: a new start succeeds
        again.kill9()
        again.start()
        assert json.loads(_get(again, "doc7")) == {"n": 7, "v": "last"}
        # the state file is removed on stop only by the process it names (the mechanism by which the second
        # gateway deleted the first's)
        other = json.loads((data / "dcpgw-state.json").read_text()) | {"pid": 1}
        (data / "dcpgw-state.json").write_text(json.dumps(other))
    finally:
        again.stop()
    assert json.loads((data / "dcpgw-state.json").read_text())["pid"] == 1


def test_cluster_up_on_single_bucket_data_and_the_reverse_refuse(kafka_broker: Broker, tmp_path: Path) -> None:
    bucket = f"m{uuid.uuid4().hex[:8]}"
    single = GatewayProc(kafka_broker, tmp_path / "single", bucket)
    single.start()
    single.bulk(docs(0, 50))
    single.stop()
    code, err, _ = _up(single, "--nodes", "3")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and "single-bucket data" in lines[0], err
    assert not (tmp_path / "single" / MAP_FILE).exists() and not (tmp_path / "single" / "n0").exists()

    from engine.cluster.local import Cluster

    Cluster.create(tmp_path / "cluster", nodes=3, replicas=1, num_vbuckets=NVB, name=bucket).close()
    clustered = GatewayProc(kafka_broker, tmp_path / "cluster", bucket)
    code, err, _ = _up(clustered)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and "holds a cluster" in lines[0], err
    assert not list((tmp_path / "cluster").glob("*.sqlite3"))


def test_cluster_gateway_rebuilds_an_emptied_map(kafka_broker: Broker, tmp_path: Path) -> None:
    """`dcpgw up --nodes 3` killed -9 after a failover; the map file is emptied (what an in-place rewrite left
    behind); the next start comes up with the same actives and every document."""
    bucket = f"r{uuid.uuid4().hex[:8]}"
    data = tmp_path / "data"
    gw = GatewayProc(kafka_broker, data, bucket, DCPGW_CLUSTER_NODES="3", DCPGW_CLUSTER_REPLICAS="1")
    gw.start()
    try:
        gw.bulk(docs(0, 300))
        req = urllib.request.Request(f"{gw.url}/cluster/failover", data=json.dumps({"node": "n1"}).encode(),
                                     method="POST", headers={"Content-Type": "application/json",
                                                             **auth_headers()})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        gw.bulk(docs(300, 400))
        gw.wait_caught_up()  # published = persisted on the nodes (rollback mitigation)
        saved = gw.get("/cluster/map")
        gw.kill9()
        (data / MAP_FILE).write_bytes(b"")
        gw.start()
        got = gw.get("/cluster/map")
        assert [c[0] for c in got["chains"]] == [c[0] for c in saved["chains"]]
        assert "n1" not in got["nodes"]
        for i in range(400):
            assert json.loads(_get(gw, f"doc{i}")) == {"n": i, "v": 0 if i < 300 else 300}
    finally:
        gw.stop()
