"""Sync-replication proof 3 (docs/durability.md) on node processes (slow): hypothesis schedules of sync writes of every level, paused
replication, stopped persistence, SIGKILL + restart and one SIGKILL + hard failover, on a ProcessCluster of 3
nodes with 2 replicas (real TCP, replication threads seqno-acking over DCP). Zero lost acknowledged durable
writes (PERSIST_TO_MAJORITY always; the in-memory levels when no node other than the failed-over one crashed
after the ack), and every acknowledged write readable through the map at the end."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.exceptions import EngineError, KeyNotFound
from engine.kv.durability import Durability, Level
from engine.network.process_cluster import ProcessCluster

pytestmark = pytest.mark.slow

NVB = 8
NODES = ["n0", "n1", "n2"]

op = st.one_of(
    st.tuples(st.just("sync"), st.integers(1, 3)),
    st.tuples(st.just("sync"), st.integers(1, 3)),
    st.tuples(st.just("sync"), st.integers(1, 3)),
    st.tuples(st.just("pause"), st.sampled_from(NODES)),
    st.tuples(st.just("resume")),
    st.tuples(st.just("stop_persistence"), st.sampled_from(NODES)),
    st.tuples(st.just("start_persistence")),
    st.tuples(st.just("crash"), st.sampled_from(NODES)),
    st.tuples(st.just("failover"), st.sampled_from(NODES)),
)

MAX_EXAMPLES = int(os.environ.get("DURABILITY_PROCESS_EXAMPLES", "6"))
STATS = {"runs": 0, "acked": 0, "checked": 0, "ambiguous": 0, "failovers": 0, "crashes": 0}


def _visible(pc: ProcessCluster, key: str, value: bytes, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pc.get(key).value == value:
                return True
        except (KeyNotFound, EngineError):
            pass
        time.sleep(0.02)
    return False


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(op, min_size=6, max_size=16))
def test_process_schedules_lose_no_acknowledged_durable_write(tmp_path_factory: Any, ops: list[tuple[Any, ...]]) -> None:
    base = Path(tmp_path_factory.mktemp("pdur"))
    acked: dict[str, tuple[bytes, int, int]] = {}
    crashes = 0
    failed: str | None = None
    n = 0
    with ProcessCluster.start(base, nodes=3, replicas=2, num_vbuckets=NVB, seed=5) as pc:
        for o in ops:
            kind = o[0]
            live = [x for x in NODES if x != failed]
            if kind == "sync":
                n += 1
                key, value = f"s{n}", f"v{n}".encode()
                try:
                    pc.write(key, value, durability=Durability(Level(o[1]), 1500))
                    acked[key] = (value, o[1], crashes)
                except EngineError:
                    STATS["ambiguous"] += 1  # ambiguous, impossible, node down...: not acknowledged
            elif kind == "pause" and o[1] in live:
                pc.resume_replication()
                pc.pause_replication([o[1]])  # one replica lags at a time
            elif kind == "resume":
                pc.resume_replication()
            elif kind == "stop_persistence" and o[1] in live:
                for x in live:
                    pc.start_persistence(x)
                pc.stop_persistence(o[1])  # one node at a time
            elif kind == "start_persistence":
                for x in live:
                    pc.start_persistence(x)
            elif kind == "crash" and o[1] in live:
                pc.kill(o[1])
                pc.restart(o[1])
                crashes += 1
                STATS["crashes"] += 1
            elif kind == "failover" and failed is None:
                pc.resume_replication()
                for x in live:
                    pc.start_persistence(x)
                pc.kill(o[1])  # SIGKILL, then hard failover (one failure at a time)
                pc.failover(o[1])
                failed = o[1]
                STATS["failovers"] += 1
        pc.resume_replication()
        for x in NODES:
            if x != failed:
                pc.start_persistence(x)
        for key, (value, level, at) in acked.items():
            STATS["acked"] += 1
            if level != Level.PERSIST_TO_MAJORITY and at != crashes:
                continue
            assert _visible(pc, key, value), f"lost acknowledged durable write {key} (level {level})"
            STATS["checked"] += 1
    STATS["runs"] += 1


def test_report_process_campaign_counts() -> None:
    print(f"\nprocess durability campaign: {STATS} at {time.strftime('%H:%M:%S')}")
