"""The delta-recovery scenario of the hypothesis campaigns (test_delta_recovery_properties.py, the gateway's
tests/gateway/test_cluster_recovery.py): random writes, replication paused for one node, hard failover of it,
writes on the new actives (some to the same keys), delta recovery with rollback repair on or off; then the
oracle of docs/cluster.md "Rollback repair".

The oracle: a write acknowledged by the failed node's active copy is *at risk* when its seqno is above the
promoted copy's branch point (the failover entry's seqno) and it was persisted before the node crashed (a crash
loses the rest, whatever the recovery). At risk and the latest version of its key on the node: with repair on it
survives (the active's final version of the key is the node's) unless the new active wrote that key after the
failover (superseded); with repair off it is lost (the recovery writes nothing to any active)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from engine import KeyNotFound, NotMyVBucket, TemporaryFailure
from engine.cluster.local import Cluster
from engine.cluster.recovery import RecoveryReport
from engine.kv.item import Op
from engine.kv.storage import item_from_row

KEYS = [f"k{i}" for i in range(24)]

_BUILDERS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "write": st.tuples(st.just("write"), st.sampled_from(KEYS), st.binary(min_size=1, max_size=6)),
    "delete": st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    # replication of the others (never from the paused node), a few messages per connection
    "pump": st.tuples(st.just("pump"), st.integers(1, 8)),
    "flush": st.tuples(st.just("flush")),
    "publish": st.tuples(st.just("publish")),
}
#: relative frequencies of the operations
_WEIGHTS = {"write": 8, "delete": 2, "pump": 2, "flush": 1, "publish": 1}
_op = st.sampled_from([k for k, w in _WEIGHTS.items() for _ in range(w)]).flatmap(lambda k: _BUILDERS[k])

schedule = st.fixed_dictionaries({
    "before": st.lists(st.tuples(st.sampled_from(KEYS), st.binary(min_size=1, max_size=6)), max_size=30),
    "paused": st.lists(_op, min_size=1, max_size=40),
    "victim": st.integers(0, 3),
    # the failed node crashes before the failover (after flushing all / some of its items) or stays up
    "crash": st.sampled_from(["no", "flushed", "unflushed"]),
    "after": st.lists(_op, max_size=25),
    "repair": st.booleans(),
})


@dataclass
class Outcome:
    at_risk: int = 0
    repaired: int = 0
    superseded: int = 0
    lost: int = 0
    report: RecoveryReport | None = None
    counts: dict[str, int] = field(default_factory=dict)


def _vb_item(c: Cluster, node: str, key: str) -> Any:
    vb = c.vbucket_of(key)
    b = c.nodes[node].require_bucket()
    return b.vbucket(vb).ht.get(key.encode())


def run_recovery_schedule(
    c: Cluster, sched: dict[str, Any], *, publish: Callable[[], object] | None = None,
) -> Outcome:
    """Run ``sched`` on ``c`` (every node up, settled) and check the oracle; returns the counts."""
    for k, v in sched["before"]:
        c.write(k, v)
    c.settle()
    names = sorted(c.vbucket_map().nodes)
    victim = names[sched["victim"] % len(names)]

    def others() -> list[tuple[str, str]]:
        return [k for k in c.connections() if victim not in k]

    def step(o: tuple[Any, ...]) -> None:
        kind = o[0]
        if kind == "write":
            with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                c.write(o[1], o[2])
        elif kind == "delete":
            with contextlib.suppress(NotMyVBucket, TemporaryFailure, KeyNotFound):
                c.delete(o[1])
        elif kind == "pump":
            c.pump(only=others(), max_messages=o[1])
        elif kind == "flush":
            for n in c.nodes.values():
                if n.up:
                    n.require_bucket().flush_all()
        elif kind == "publish" and publish is not None:
            publish()

    # replication from the victim is paused (the others' replication runs, and so does its persistence)
    for o in sched["paused"]:
        step(o)
    mine = c.vbucket_map().vbuckets_of(victim, slot=0)
    vbucket = c.nodes[victim].require_bucket()
    # the victim's latest version of every key of its actives, and how far it persisted
    latest = {k: _vb_item(c, victim, k) for k in KEYS if c.vbucket_of(k) in mine}
    persisted = {vb: vbucket.vbucket(vb).persisted_seqno for vb in mine}
    crash = sched["crash"]
    if crash == "flushed":
        vbucket.flush_all()
        persisted = {vb: vbucket.vbucket(vb).persisted_seqno for vb in mine}
    if crash != "no":
        # what survives the crash: the persisted current versions
        latest = dict.fromkeys(latest)
        for vb in mine:
            for row in vbucket.storage.current(vb):
                it = item_from_row(row)
                if it.op < Op.PREPARE:
                    latest[it.key.decode()] = it
        c.kill(victim)
    else:
        persisted = {vb: vbucket.vbucket(vb).high_seqno for vb in mine}
    report = c.failover(victim)
    branch = {vb: e.seqno for vb, e in report.entries.items() if e is not None}
    at_risk = {k: it for k, it in latest.items()
               if it is not None and branch[c.vbucket_of(k)] < it.seqno <= persisted[c.vbucket_of(k)]}
    # writes on the new actives, some to the same keys
    rewritten: set[str] = set()
    for o in sched["after"]:
        vb_before = {k: (c.active_bucket(c.vbucket_of(k)).vbucket(c.vbucket_of(k)).ht.get(k.encode()))
                     for k in (o[1],)} if o[0] in ("write", "delete") else {}
        step(o)
        for k, before in vb_before.items():
            after = c.active_bucket(c.vbucket_of(k)).vbucket(c.vbucket_of(k)).ht.get(k.encode())
            if after is not before:
                rewritten.add(k)
    c.settle()
    highs = {vb: c.active_bucket(vb).vbucket(vb).high_seqno for vb in range(c.num_vbuckets)}
    c.rollback_repair = sched["repair"]
    rec = c.recover(victim, "delta")
    assert rec.mode == "delta" and not rec.pending, rec
    if not sched["repair"]:
        # exactly today's behaviour: the recovery writes nothing to any active
        assert {vb: c.active_bucket(vb).vbucket(vb).high_seqno for vb in range(c.num_vbuckets)} == highs
        assert rec.counts.repaired == rec.counts.superseded == 0
    c.settle()
    out = Outcome(at_risk=len(at_risk), report=rec)
    for k, it in at_risk.items():
        now = c.active_bucket(c.vbucket_of(k)).vbucket(c.vbucket_of(k)).ht.get(k.encode())
        if it.op == Op.MUTATION:
            same = now is not None and now.op == Op.MUTATION and now.value == it.value and now.flags == it.flags
        else:  # a deletion survives as the key's absence
            same = now is None or now.op != Op.MUTATION
        if k in rewritten:
            out.superseded += 1
            continue
        if sched["repair"]:
            assert same, (k, it, now, rec.to_json())
            out.repaired += 1
        else:
            out.lost += 1
    if sched["repair"]:
        assert (rec.counts.repaired, rec.counts.superseded) == (out.repaired, out.superseded), rec.to_json()
    else:
        assert rec.counts.discarded == out.lost + out.superseded, rec.to_json()
    return out


__all__ = ["KEYS", "Outcome", "run_recovery_schedule", "schedule"]
