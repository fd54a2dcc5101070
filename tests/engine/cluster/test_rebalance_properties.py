"""Property tests (hypothesis) over random schedules mixing rebalances (engine/cluster/rebalance.py, docs/rebalance.md) with
writes, partial pumps, crashes, restarts, hard and graceful failovers on the in-process cluster.

Invariants (on top of test_cluster_properties.py's (a) clients converge, (b) writes observed replicated and
persisted survive a failover, (c) replicas equal actives after a full pump):

(d) every write that observe said was replicated to every replica slot and persisted, before a rebalance step,
    is still in its vbucket's history after that step (a takeover loses nothing);
(e) schedules of rebalances, writes and pumps alone (no crash, no failover) make no DCP client and no replica
    roll back, and add no failover entry: a rebalance step alone never causes a rollback.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import InvalidArgument, NotMyVBucket, TemporaryFailure
from tests.engine.cluster.schedules import _BUILDERS as CLUSTER_OPS
from tests.engine.cluster.schedules import KEYS, Harness

_OPS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    **CLUSTER_OPS,
    "rebalance_in": st.tuples(st.just("rebalance_in"), st.integers(0, 3)),
    "rebalance_out": st.tuples(st.just("rebalance_out"), st.integers(0, 4)),
    "rebalance_swap": st.tuples(st.just("rebalance_swap"), st.integers(0, 4)),
    "rebalance_step": st.tuples(st.just("rebalance_step"), st.integers(1, 4)),
    "rebalance_finish": st.tuples(st.just("rebalance_finish")),
    "write_burst": st.tuples(st.just("write_burst"), st.integers(2, 12)),
}
_MIXED = {"write": 8, "write_burst": 2, "delete": 2, "pump": 4, "pump_all": 2, "flush": 1, "client": 3,
          "crash": 1, "restart": 2, "hard_failover": 1, "graceful_failover": 1, "rebalance_in": 2,
          "rebalance_out": 2, "rebalance_swap": 1, "rebalance_step": 6, "rebalance_finish": 1}
_CLEAN = {"write": 8, "write_burst": 3, "delete": 2, "pump": 4, "pump_all": 2, "flush": 1, "client": 3,
          "rebalance_in": 2, "rebalance_out": 2, "rebalance_swap": 1, "rebalance_step": 6, "rebalance_finish": 1}


def _ops(weights: dict[str, int]) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.sampled_from([k for k, w in weights.items() for _ in range(w)]).flatmap(lambda k: _OPS[k])


class RebalanceHarness(Harness):
    def __init__(self, base: Path, nodes: int, replicas: int) -> None:
        super().__init__(base, nodes, replicas)
        self.rebalances = 0
        self.started: list[Any] = []
        self.lost_checks = 0
        self.fresh = 0
        self.burst = 0
        self.final_logs: dict[int, list[Any] | None] = {}

    def _checked_step(self, fn: Any) -> None:
        """(d): writes replicated and persisted everywhere before ``fn`` are in the history after it."""
        safe = self._replicated()
        fn()
        c = self.cluster
        for t in safe:
            with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                r = c.observe_seqno(t.vbucket, t.vbuuid)
                assert (not r.failed_over) or (r.last_seqno is not None and t.seqno <= r.last_seqno), (t, r)
                assert c.active_bucket(t.vbucket).vbucket(t.vbucket).high_seqno >= t.seqno
                self.lost_checks += 1

    def _start(self, add: list[str], remove: list[str]) -> None:
        c = self.cluster
        if c.rebalance_running is not None:
            return
        with contextlib.suppress(InvalidArgument, TemporaryFailure):
            self.started.append(c.start_rebalance(add=add, remove=remove))
            self.rebalances += 1

    def _new_name(self) -> str:
        self.fresh += 1
        return f"x{self.fresh}"

    def run(self, ops: list[tuple[Any, ...]]) -> None:
        c = self.cluster
        for o in ops:
            kind = o[0]
            vbmap = c.vbucket_map()
            if kind == "rebalance_in":
                # a new node, or one ejected / failed over earlier (its old copies roll back if they diverged)
                back = sorted(set(c.ejected + c.failed) - set(vbmap.nodes))
                self._start([back[o[1] % len(back)] if back and o[1] % 2 else self._new_name()], [])
            elif kind == "rebalance_out":
                self._start([], [vbmap.nodes[o[1] % len(vbmap.nodes)]])
            elif kind == "rebalance_swap":
                self._start([self._new_name()], [vbmap.nodes[o[1] % len(vbmap.nodes)]])
            elif kind == "rebalance_step":
                for _ in range(o[1]):
                    self._checked_step(lambda: c.pump())
            elif kind == "rebalance_finish":
                if c.rebalance_running is not None:
                    self._checked_step(self._finish)
            elif kind == "write_burst":
                for i in range(o[1]):
                    self.burst += 1
                    with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                        self.tokens.append(c.write(KEYS[(self.burst + i) % len(KEYS)], b"b%d" % self.burst).token)
            else:
                self._run_cluster_op(o)
        # Final: any rebalance still running finishes (after restarting the map's nodes it may start again).
        self._finish()
        self.final_logs = {vb: self._log(vb) for vb in range(c.num_vbuckets)}
        super().run([])  # restarts, settles, checks (a) and (c), closes

    def _log(self, vb: int) -> list[Any] | None:
        try:
            return self.cluster.active_bucket(vb).failover_log(vb)
        except (NotMyVBucket, TemporaryFailure):
            return None

    def _finish(self) -> None:
        c = self.cluster
        for _ in range(100_000):
            reb = c.rebalance_running
            if reb is None:
                break
            c.pump()
        else:
            raise AssertionError("rebalance never finished")

    @property
    def finished(self) -> int:
        return sum(1 for r in self.started if r.status == "done")

    @property
    def moved(self) -> int:
        return sum(r.moved for r in self.started)

    def _run_cluster_op(self, o: tuple[Any, ...]) -> None:
        """One operation of test_cluster_properties.Harness.run, without its final checks."""
        c = self.cluster
        kind = o[0]
        if kind in ("hard_failover", "graceful_failover"):
            name = self._name(o[1])
            graceful = kind == "graceful_failover"
            if name in c.nodes and self._can_fail_over(name, graceful):
                self.failover(name, graceful)
            return
        if kind in ("crash", "restart", "flush"):
            name = self._name(o[1])
            node = c.nodes[name]
            if kind == "crash" and node.up:
                c.kill(name)
            elif kind == "restart" and not node.up:
                c.restart(name)
            elif kind == "flush" and node.up:
                assert node.bucket is not None
                node.bucket.flush_all()
            return
        self.plain_step(o)  # writes, deletes, pumps and client polls as test_cluster_properties runs them


MAX_EXAMPLES = int(os.environ.get("REBALANCE_PROP_EXAMPLES", "60"))
STATS = {"runs": 0, "rebalances": 0, "finished": 0, "moved": 0, "failovers": 0, "checked": 0, "rollbacks": 0,
         "replica_rollbacks": 0, "clean_runs": 0, "clean_moved": 0}


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_ops(_MIXED), min_size=20, max_size=90), nodes=st.integers(3, 4), replicas=st.integers(1, 2))
def test_rebalance_failover_schedules_lose_no_acknowledged_write(tmp_path_factory, ops, nodes, replicas) -> None:
    h = RebalanceHarness(tmp_path_factory.mktemp("reb"), nodes, replicas)
    h.run(ops)
    STATS["runs"] += 1
    STATS["rebalances"] += h.rebalances
    STATS["finished"] += h.finished
    STATS["moved"] += h.moved
    STATS["failovers"] += h.failovers
    STATS["checked"] += h.checked + h.lost_checks
    STATS["rollbacks"] += h.client_rollbacks
    STATS["replica_rollbacks"] += h.replica_rollbacks


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_ops(_CLEAN), min_size=20, max_size=90), nodes=st.integers(3, 4), replicas=st.integers(1, 2))
def test_rebalance_alone_never_causes_a_rollback(tmp_path_factory, ops, nodes, replicas) -> None:
    h = RebalanceHarness(tmp_path_factory.mktemp("rebclean"), nodes, replicas)
    c = h.cluster
    logs = {vb: c.active_bucket(vb).failover_log(vb) for vb in range(c.num_vbuckets)}
    h.run(ops)
    assert h.client_rollbacks == 0  # (e)
    assert h.replica_rollbacks == 0
    assert h.final_logs == logs  # no failover entry (kv_engine: takeover -> no entry)
    STATS["clean_runs"] += 1
    STATS["clean_moved"] += h.moved


def test_report_campaign_counts() -> None:
    print(f"\nrebalance campaign: {STATS} at {time.strftime('%H:%M:%S')}")
