"""Rebalance of a cluster of node processes (engine/network/process_rebalance.py ProcessRebalance, docs/rebalance.md "Node processes"): takeover streams
over TCP (markers with ACK, DCP_SET_VBUCKET_STATE and their acks as DCP responses), DCP_ADD_STREAM(TAKEOVER) on
the destination, ``stats dcp-vbtakeover`` on the source; a node rebalanced in and another out while writes
continue; a DCP client over TCP following the map never rolls back."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import NotMyVBucket, TemporaryFailure, VBucketState
from engine.cluster.rebalance import RebalanceProgress
from engine.exceptions import InvalidArgument
from engine.network.process_cluster import ProcessCluster
from tests.engine.network.process_campaign import _OPS as _PC_OPS
from tests.engine.network.process_campaign import Campaign
from tests.engine.process_model import ProcessClusterClient, actives_state, assert_replicas_equal_actives

NVB = 8
CFG: dict[str, Any] = {"checkpoint_max_items": 3, "backfill_chunk_items": 2}


#: make_cluster() (tests/engine/conftest.py) starts node processes with these options
CLUSTER = ProcessCluster
CLUSTER_DEFAULTS: dict[str, Any] = {**CFG, "num_vbuckets": NVB}


class Writer:
    def __init__(self, cluster: ProcessCluster) -> None:
        self.cluster = cluster
        self.i = 0
        self.acked: dict[bytes, bytes] = {}
        self.refused = 0

    def write(self, n: int) -> None:
        for _ in range(n):
            self.i += 1
            key = f"k{self.i % 64}"
            value = f"v{self.i}"
            try:
                self.cluster.write(key, value)
            except (TemporaryFailure, NotMyVBucket):
                self.refused += 1
                continue
            self.acked[key.encode()] = value.encode()


def test_process_rebalance_in_and_out_under_writes(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1)
    w = Writer(c)
    w.write(150)
    c.settle()
    client = ProcessClusterClient(c, "follower")
    client.poll()
    logs = {vb: c.client(c.vbucket_map().active(vb) or "").failover_log(vb) for vb in range(NVB)}
    seen: list[RebalanceProgress] = []

    def on_step(p: RebalanceProgress) -> None:
        seen.append(p)
        w.write(2)  # writes continue throughout
        if len(seen) % 5 == 0:
            client.poll_once()

    done = c.rebalance(add=["n3"], progress=on_step)
    assert done.status == "done" and done.moved == done.total > 0
    assert c.vbucket_map().vbuckets_of("n3", slot=0)
    done = c.rebalance(remove=["n0"], progress=on_step)
    assert done.status == "done" and "n0" not in c.vbucket_map().nodes and c.ejected == ["n0"]
    assert any(p.moving for p in seen)
    w.write(50)
    c.settle()
    assert_replicas_equal_actives(c)
    state = actives_state(c)
    for k, v in w.acked.items():
        assert state[k][0] == v, k
    # No failover entry (takeover), and the following client never rolled back.
    for vb in range(NVB):
        assert c.client(c.vbucket_map().active(vb) or "").failover_log(vb) == logs[vb]
    client.converge(state)
    assert client.rollbacks() == 0
    client.close()
    # Every takeover went through the DCP protocol: the source's takeover stream ended OK after the
    # destination acked the active message (the manager never set a destination active itself).
    assert done.reverts == 0


def test_process_takeover_stat_and_bad_add_stream(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=1)
    vb = c.vbucket_map().vbuckets_of("n0", slot=0)[0]
    c.write(next(f"k{i}" for i in range(1000) if c.vbucket_of(f"k{i}") == vb), "x")
    c.settle()
    deadline = time.monotonic() + 10
    while (st := c.client("n0").takeover_stats(vb, "replication:n0->n1"))["status"] == "does_not_exist":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert st["status"] == "in-memory" and st["estimate"] == "0" and st["vb_state"] == "active"
    assert c.client("n0").takeover_stats(vb, "nope")["status"] == "does_not_exist"
    with pytest.raises(InvalidArgument):
        c.client("n0").stats("dcp-vbtakeover x")
    with pytest.raises(NotMyVBucket):  # n1 has no link from n9
        c.client("n1").add_stream_takeover("n9", vb)
    with pytest.raises(InvalidArgument):
        c.start_rebalance(remove=["n0"])  # one node cannot hold a replica
    assert c.client("n0").vbucket_state(vb) is VBucketState.ACTIVE


# ---------------------------------------------------------------------------------------------- campaign
_REB_OPS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    **_PC_OPS,
    "rebalance_in": st.tuples(st.just("rebalance_in"), st.integers(0, 3)),
    "rebalance_out": st.tuples(st.just("rebalance_out"), st.integers(0, 4)),
    "rebalance_step": st.tuples(st.just("rebalance_step"), st.integers(1, 20)),
    "rebalance_finish": st.tuples(st.just("rebalance_finish")),
}
_REB_WEIGHTS = {"write": 8, "burst": 3, "delete": 2, "pause": 1, "resume": 2, "persistence": 1, "client": 3,
                "wait": 1, "kill": 1, "restart": 2, "hard_failover": 1, "graceful_failover": 1, "lagging_crash": 2,
                "rebalance_in": 3, "rebalance_out": 3, "rebalance_step": 6, "rebalance_finish": 2}
reb_op = st.sampled_from([k for k, w in _REB_WEIGHTS.items() for _ in range(w)]).flatmap(lambda k: _REB_OPS[k])


class RebalanceCampaign(Campaign):
    """test_process_cluster's campaign (SIGKILLs, lagging crashes, hard and graceful failovers, paused
    replication, stopped persistence, two DCP clients) plus rebalances in and out of node processes, stepped
    between the other operations. Every write acknowledged as replicated and persisted before a rebalance
    step must be in its vbucket's history after it."""

    def __init__(self, base: Path, nodes: int) -> None:
        super().__init__(base, nodes)
        self.fresh = 0
        self.started: list[Any] = []

    def _checked(self, fn: Callable[[], Any]) -> None:
        c = self.c
        safe = self._acknowledged()
        fn()
        for t in safe:
            with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                r = c.observe_seqno(t.vbucket, t.vbuuid)
                kept = (not r.failed_over) or (r.last_seqno is not None and t.seqno <= r.last_seqno)
                if not kept or r.current_seqno < t.seqno:
                    self.lost.append((t, r))
                self.checked += 1

    def _start(self, add: list[str], remove: list[str]) -> None:
        with contextlib.suppress(InvalidArgument, TemporaryFailure):
            self.started.append(self.c.start_rebalance(add=add, remove=remove))

    def _run_rebalance(self, steps: int) -> None:
        for _ in range(steps):
            if self.c.rebalance_running is None:
                return
            self.c._wait_progress()  # steps the rebalance

    def step(self, o: tuple[Any, ...]) -> None:
        c = self.c
        kind = o[0]
        vbmap = c.vbucket_map()
        if kind == "rebalance_in":
            back = sorted(set(c.ejected + c.failed) - set(vbmap.nodes))
            if back and o[1] % 2:
                name = back[o[1] % len(back)]
            else:
                self.fresh += 1
                name = f"x{self.fresh}"
            self._start([name], [])
        elif kind == "rebalance_out":
            self._start([], [vbmap.nodes[o[1] % len(vbmap.nodes)]])
        elif kind == "rebalance_step":
            self._checked(lambda: self._run_rebalance(o[1]))
        elif kind == "rebalance_finish":
            if c.rebalance_running is not None and not c.paused and not self.no_persist:
                self._checked(lambda: self._run_rebalance(3000))
        else:
            super().step(o)

    def finish(self) -> None:
        c = self.c
        for name in c.vbucket_map().nodes:
            if not c.node(name).up:
                c.restart(name)  # a node down stopped the rebalance already
            c.start_persistence(name)
        self.no_persist.clear()
        c.resume_replication()
        if c.rebalance_running is not None:
            self._checked(lambda: self._run_rebalance(6000))
        assert c.rebalance_running is None, "the rebalance did not finish"
        super().finish()

    @property
    def finished(self) -> int:
        return sum(1 for r in self.started if r.status == "done")


REB_EXAMPLES = int(os.environ.get("PROCESS_REBALANCE_EXAMPLES", "8"))
REB_STATS = {"runs": 0, "rebalances": 0, "finished": 0, "moved": 0, "kills": 0, "failovers": 0,
             "acked_checked": 0, "client_rollbacks": 0, "lost_acked_writes": 0, "divergent_consumers": 0}


@pytest.mark.slow
@settings(max_examples=REB_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(reb_op, min_size=15, max_size=40), nodes=st.integers(3, 4))
def test_process_rebalance_campaign(tmp_path_factory, ops, nodes) -> None:
    h = RebalanceCampaign(tmp_path_factory.mktemp("prb"), nodes)
    try:
        h.run(ops)
    finally:
        h.close()
    REB_STATS["runs"] += 1
    REB_STATS["rebalances"] += len(h.started)
    REB_STATS["finished"] += h.finished
    REB_STATS["moved"] += sum(r.moved for r in h.started)
    REB_STATS["kills"] += h.kills
    REB_STATS["failovers"] += h.failovers
    REB_STATS["acked_checked"] += h.checked
    REB_STATS["client_rollbacks"] += sum(cl.rollbacks() for cl in h.clients)
    REB_STATS["lost_acked_writes"] += len(h.lost)
    REB_STATS["divergent_consumers"] += len(h.divergent)
    assert not h.divergent, h.divergent
    assert not h.lost, h.lost


@pytest.mark.slow
def test_report_process_rebalance_campaign_counts() -> None:
    print(f"\nprocess rebalance campaign: {REB_STATS}")
