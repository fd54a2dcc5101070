"""Crash behaviour with a real subprocess killed by SIGKILL (issue: engine item 8)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Bucket, BucketConfig, FailoverEntry, Item, KeyNotFound, Op, SnapshotFlags, SnapshotMarker
from tests.engine.dcp_model import SnapshotConsumer

ROOT = Path(__file__).resolve().parents[3]


def _run_child(data_dir: Path, n_persisted: int, n_unpersisted: int) -> list[dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.kv.crash_child", str(data_dir), str(n_persisted), str(n_unpersisted)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    lines: list[dict] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "READY":
            break
        lines.append(json.loads(line))
    else:
        proc.wait()
        raise AssertionError(f"child exited early with {proc.returncode}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return lines


def _feed(consumer: SnapshotConsumer, lines: list[dict]) -> dict[int, dict]:
    failover: dict[int, dict] = {}
    for d in lines:
        if d["t"] == "marker":
            consumer.handle(SnapshotMarker(d["vb"], d["s"], d["e"], SnapshotFlags(d["f"])))
        elif d["t"] == "item":
            v = None if d["v"] is None else bytes.fromhex(d["v"])
            consumer.handle(Item(bytes.fromhex(d["k"]), v, d["vb"], d["seq"], d["rev"], d["cas"], op=Op(d["op"])))
        else:
            failover[d["vb"]] = d
    return failover


@pytest.mark.parametrize("use_client_log", [True, False])
def test_sigkill_loses_only_unpersisted_and_client_rolls_back(tmp_path: Path, use_client_log: bool) -> None:
    data_dir = tmp_path / "data"
    lines = _run_child(data_dir, 200, 60)
    consumer = SnapshotConsumer(list(range(4)), use_client_log=use_client_log)
    for st in consumer.vbs.values():
        st.open = True
    info = _feed(consumer, lines)
    for st in consumer.vbs.values():
        st.open = False  # the connection died with the engine
    # The consumer learnt the pre-crash failover logs (as on a stream-request OK).
    for vb, d in info.items():
        consumer.vbs[vb].position.on_failover_log([FailoverEntry(u, s) for u, s in d["log"]])

    b = Bucket(BucketConfig(data_dir=data_dir, num_vbuckets=4, seed=None))
    try:
        assert not b.was_clean
        # persisted data intact, unpersisted gone
        for i in range(200):
            if i % 7 == 0:
                with pytest.raises(KeyNotFound):
                    b.get(f"doc{i}")
            else:
                assert b.get(f"doc{i}").value == f"persisted-{i}".encode()
        for i in range(60):
            with pytest.raises(KeyNotFound):
                b.get(f"new{i}")
        for vb in range(4):
            persisted = info[vb]["persisted"]
            log = b.failover_log(vb)
            # a new failover entry at the persisted seqno, on top of the old log
            assert log[0].seqno == persisted
            assert [(e.vbuuid, e.seqno) for e in log[1:]] == [tuple(x) for x in info[vb]["log"]]
            assert b.vbucket(vb).high_seqno == persisted
        # the client received unpersisted items: ROLLBACK to a boundary <= persisted, then converge
        p = b.dcp_producer("crash-client")
        consumer.open_streams(p)
        for vb in range(4):
            st = consumer.vbs[vb]
            assert st.rollbacks, f"vb {vb}: expected a rollback"
            assert all(r <= info[vb]["persisted"] for r in st.rollbacks)
            if use_client_log:
                assert st.rollbacks[0] == info[vb]["persisted"]  # common ancestor: exactly the branch point
        consumer.drain(p)
        assert consumer.state() == b.state_snapshot()
        # and continues normally afterwards
        b.set("after-crash", b"1")
        consumer.drain(p)
        assert consumer.state() == b.state_snapshot()
    finally:
        b.close()
    b2 = Bucket(BucketConfig(data_dir=data_dir, num_vbuckets=4, seed=None))
    assert b2.was_clean
    b2.close()
