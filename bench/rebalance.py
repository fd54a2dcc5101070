"""Rebalance benchmark: ``python -m bench.rebalance [--docs N] [--vbuckets V] [--batch B]``.

The in-process cluster (3 nodes, 1 replica, V vbuckets, N documents loaded) rebalances a fourth node in while
a writer keeps going: every loop round writes a batch of B documents through the map (TMPFAIL / NOT_MY_VBUCKET
are counted, not retried) and calls ``Cluster.pump()`` (replication + one rebalance step + flush). The same loop
without a rebalance, on a same-sized fresh cluster, is the baseline.

Figures:
* ``rebalance.writes_per_s``   acknowledged writes per second while the rebalance runs (baseline: same loop, no
  rebalance)
* ``rebalance.ms_per_vbucket`` wall time of the rebalance per vbucket moved, writes included (baseline: the same
  rebalance with no writer, pumping only)
* ``rebalance.refused_pct``    front-end writes answered TMPFAIL / NOT_MY_VBUCKET during the rebalance (the
  takeovers' short write stop), percent (baseline: the loop without rebalance)
* ``rebalance.delta_recovery_ms`` time to bring back a crashed, hard-failed-over node (holding copies of about
  2/3 of the N documents, 1% of which changed meanwhile) by a delta recovery, from the node restarted (warmed
  up, its vbuckets dead, as ns_server offers recovery for a node that is back) until replication settles: stream
  requests, rollbacks, the difference streamed (docs/cluster.md "Delta recovery"); baseline: a full recovery of
  the same node in the same run (crashed and failed over again, 1% changed again, wiped and streamed from zero).
  Target: 0.2 x the baseline (the issue's "<= 0.2x full recovery")
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.report import figure
from engine import NotMyVBucket, TemporaryFailure
from engine.cluster.local import Cluster


def _load(c: Cluster, docs: int) -> None:
    for i in range(docs):
        c.write(f"doc{i}", b'{"v": 0}')
    c.settle()


def _round(c: Cluster, batch: int, i: int) -> tuple[int, int]:
    ok = refused = 0
    for j in range(batch):
        try:
            c.write(f"doc{(i * batch + j) % 10_000}", b'{"v": 1}')
            ok += 1
        except (TemporaryFailure, NotMyVBucket):
            refused += 1
    c.pump()
    return ok, refused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--vbuckets", type=int, default=64)
    ap.add_argument("--batch", type=int, default=50)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        # Rebalance n3 in under writes.
        c = Cluster.create(base / "reb", nodes=3, replicas=1, num_vbuckets=a.vbuckets, seed=None)
        _load(c, a.docs)
        reb = c.start_rebalance(add=["n3"])
        ok = refused = rounds = 0
        t0 = time.perf_counter()
        while not reb.done:
            o, r = _round(c, a.batch, rounds)
            ok, refused, rounds = ok + o, refused + r, rounds + 1
        reb_s = time.perf_counter() - t0
        assert reb.status == "done", reb.error
        moved = reb.moved
        c.close()
        # Baseline 1: the same loop, as many rounds, no rebalance.
        c = Cluster.create(base / "plain", nodes=3, replicas=1, num_vbuckets=a.vbuckets, seed=None)
        _load(c, a.docs)
        base_ok = base_refused = 0
        t0 = time.perf_counter()
        for i in range(rounds):
            o, r = _round(c, a.batch, i)
            base_ok, base_refused = base_ok + o, base_refused + r
        plain_s = time.perf_counter() - t0
        c.close()
        # Baseline 2: the same rebalance without a writer.
        c = Cluster.create(base / "idle", nodes=3, replicas=1, num_vbuckets=a.vbuckets, seed=None)
        _load(c, a.docs)
        t0 = time.perf_counter()
        idle = c.rebalance(add=["n3"])
        idle_s = time.perf_counter() - t0
        c.close()
        # Delta vs full recovery of the same node (docs/cluster.md "Delta recovery").
        c = Cluster.create(base / "recover", nodes=3, replicas=1, num_vbuckets=a.vbuckets, seed=None)
        _load(c, a.docs)
        took = {}
        for mode in ("delta", "full"):
            c.kill("n0")
            c.failover("n0")
            for i in range(0, a.docs, 100):  # 1% of the documents change while n0 is out
                c.write(f"doc{i}", f'{{"v": "{mode}"}}'.encode())
            c.settle()
            c.restart("n0")  # the node is back up (warmed up, every vbucket dead) before it is recovered
            t0 = time.perf_counter()
            rep = c.recover("n0", mode)
            c.settle()
            took[mode] = time.perf_counter() - t0
            assert rep.mode == mode and not rep.pending, rep
        c.close()
    plain = base_ok / plain_s
    figure("rebalance.writes_per_s", ok / reb_s, "writes/s", plain, round(0.5 * plain), "higher")
    figure("rebalance.ms_per_vbucket", 1000 * reb_s / max(moved, 1), "ms", 1000 * idle_s / max(idle.moved, 1),
           50.0, "lower")
    figure("rebalance.refused_pct", 100 * refused / max(ok + refused, 1), "%",
           100 * base_refused / max(base_ok + base_refused, 1), 10.0, "lower")
    figure("rebalance.delta_recovery_ms", 1000 * took["delta"], "ms", 1000 * took["full"],
           round(0.2 * 1000 * took["full"], 1), "lower")


if __name__ == "__main__":
    main()
