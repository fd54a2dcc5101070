"""Rebalance (engine/cluster/rebalance.py; docs/rebalance.md): the planner, named connections with pipelined add-streams
answered out of order, the stream request / rollback loop, takeover moves with the state check and revert, and
whole rebalances in and out of the in-process cluster under writes."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from engine import NotMyVBucket, TemporaryFailure, VBucketState
from engine.cluster.local import Cluster
from engine.cluster.rebalance import (
    MigratorConnection,
    MovePhase,
    Rebalance,
    RebalanceProgress,
    VBucketMove,
    plan_chains,
)
from engine.cluster.vbucket_map import VBucketMap
from engine.exceptions import InvalidArgument
from tests.engine.cluster_model import ClusterClient, actives_state, assert_replicas_equal_actives

#: options of every make_cluster() cluster here (tests/engine/conftest.py)
CLUSTER_DEFAULTS = {"seed": 5}


class Writer:
    """Writes keys through the map, retrying TMPFAIL / NOT_MY_VBUCKET later; remembers what was acknowledged."""

    def __init__(self, cluster: Cluster, prefix: str = "w") -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.n = 0
        self.acked: dict[bytes, bytes] = {}
        self.refused = 0

    def write(self, count: int) -> None:
        for _ in range(count):
            key = f"{self.prefix}{self.n % 97}"
            value = f"v{self.n}"
            try:
                self.cluster.write(key, value)
            except (TemporaryFailure, NotMyVBucket):
                self.refused += 1
                continue
            self.n += 1
            self.acked[key.encode()] = value.encode()


def _counts(chains: list[list[str | None]], slot: int | None) -> Counter[str]:
    c: Counter[str] = Counter()
    for chain in chains:
        for i, n in enumerate(chain):
            if n is not None and ((slot is None and i > 0) or i == slot):
                c[n] += 1
    return c


# ---------------------------------------------------------------------- planner
@pytest.mark.parametrize(("nodes", "new", "replicas"), [
    (["n0", "n1", "n2"], ["n0", "n1", "n2", "n3"], 1),
    (["n0", "n1", "n2"], ["n1", "n2", "n3"], 1),
    (["n0", "n1", "n2", "n3"], ["n0", "n1"], 1),
    (["n0", "n1", "n2", "n3"], ["n0", "n1", "n2", "n3", "n4"], 2),
])
def test_plan_is_balanced_valid_and_keeps_copies(nodes, new, replicas) -> None:
    cur = VBucketMap.generate(nodes, replicas, 64)
    chains = plan_chains(cur, new)
    m = cur.with_chains(chains, new)  # validates: no node twice, known nodes, widths
    actives = _counts(chains, 0)
    assert set(actives) <= set(new) and max(actives.values()) - min(actives[n] for n in new) <= 1
    reps = _counts(chains, None)
    assert max(reps.values()) - min(reps[n] for n in new) <= 1
    # Minimal movement: an active on a node that stays is kept unless its node holds too many.
    kept = sum(1 for vb in range(64) if cur.chains[vb][0] == m.chains[vb][0])
    old_actives = _counts([list(ch) for ch in cur.chains], 0)
    assert kept >= sum(min(old_actives[n], 64 // len(new)) for n in nodes if n in new)
    assert all(m.chains[vb][0] is not None for vb in range(64))


def test_plan_refuses_impossible_shapes() -> None:
    cur = VBucketMap.generate(["n0", "n1", "n2"], 1, 8)
    with pytest.raises(InvalidArgument):
        plan_chains(cur, ["n0"])
    with pytest.raises(InvalidArgument):
        plan_chains(cur, [])


# ---------------------------------------------------------------------- named connections
def _keys_on(cluster: Cluster, vb: int, n: int, prefix: str = "k") -> list[str]:
    out = []
    for i in itertools.count():
        k = f"{prefix}{i}"
        if cluster.vbucket_of(k) == vb:
            out.append(k)
            if len(out) == n:
                return out
    raise AssertionError


def test_add_streams_are_answered_out_of_order_matched_by_opaque(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=0, num_vbuckets=4)
    a = c.node("n0").require_bucket()
    b = c.node("n1").require_bucket()
    vb_rb, vb_ok = [vb for vb in range(4) if c.vbucket_map().active(vb) == "n0"][:2]
    for k in _keys_on(c, vb_rb, 5) + _keys_on(c, vb_ok, 5):
        c.write(k, "x")
    # The destination's copy of vb_rb holds a diverged history: its request is answered ROLLBACK first.
    b.set_vbucket_state(vb_rb, VBucketState.ACTIVE)
    for k in _keys_on(c, vb_rb, 8, "z"):
        b.set(k, "diverged", vbucket=vb_rb)
    for vb in (vb_rb, vb_ok):
        b.set_vbucket_state(vb, VBucketState.REPLICA)
    conn = MigratorConnection("rebalance:n0->n1", a, b, itertools.count(100))
    first = conn.add_stream(vb_rb)
    second = conn.add_stream(vb_ok)
    assert conn.pending() == [first, second]
    conn.process()
    done = conn.completions()
    assert [r.opaque for r in done] == [second]  # answered before the one submitted first
    assert done[0].ok and done[0].vbucket == vb_ok
    conn.process()
    late = conn.completions()
    assert [r.opaque for r in late] == [first] and late[0].ok and late[0].rollbacks == 1
    assert b.failover_log(vb_rb) == a.failover_log(vb_rb)
    conn.step()
    assert b.vbucket(vb_rb).high_seqno == a.vbucket(vb_rb).high_seqno
    assert b.vbucket(vb_rb).ht.get(_keys_on(c, vb_rb, 1)[0].encode()).value == b"x"
    assert b.vbucket(vb_rb).ht.get(_keys_on(c, vb_rb, 1, "z")[0].encode()) is None  # the diverged branch is gone
    # An add-stream for a vbucket the source does not hold actively is answered with an error.
    other = next(vb for vb in range(4) if c.vbucket_map().active(vb) == "n1")
    o = conn.add_stream(other)
    conn.process()
    bad = conn.answer(o)
    assert bad is not None and not bad.ok and isinstance(bad.error, NotMyVBucket)
    # Close stream answers at once; a reused name closes the old connection (docs/rebalance.md "The mover").
    conn.close_stream(vb_ok)
    assert conn.stream_state(vb_ok) == (False, None)
    again = MigratorConnection("rebalance:n0->n1", a, b, itertools.count(200))
    assert conn.consumer.closed and conn.producer.closed
    assert not again.consumer.closed
    with pytest.raises(TemporaryFailure):
        conn.add_stream(vb_ok)


# ---------------------------------------------------------------------- whole rebalances
def _pump_until_done(c: Cluster, reb: Rebalance, writer: Writer | None = None, client: ClusterClient | None = None,
                     max_rounds: int = 20_000) -> list[RebalanceProgress]:
    seen = []
    for _ in range(max_rounds):
        if reb.done:
            break
        if writer is not None:
            writer.write(3)
        c.pump()
        seen.append(reb.progress())
        if client is not None:
            client.poll()
    assert reb.status == "done", reb.error
    return seen


def _assert_converged(c: Cluster, writer: Writer, client: ClusterClient | None = None) -> None:
    c.settle()
    state = actives_state(c)
    for k, v in writer.acked.items():
        assert state[k][0] == v, k
    assert_replicas_equal_actives(c)
    if client is not None:
        client.poll()
        assert client.state() == state
        for vb, st in client.consumer.vbs.items():
            assert st.rollbacks == [], (vb, st.rollbacks)


def test_rebalance_in_and_out_under_writes_no_failover_entry(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=16)
    writer = Writer(c)
    client = ClusterClient(c)
    writer.write(300)
    c.settle()
    client.poll()
    logs = {vb: c.active_bucket(vb).failover_log(vb) for vb in range(16)}
    rev = c.vbucket_map().revision
    reb = c.start_rebalance(add=["n3"])
    assert c.vbucket_map().nodes == ["n0", "n1", "n2", "n3"]
    seen = _pump_until_done(c, reb, writer, client)
    assert seen[-1].moved == seen[-1].total == reb.total > 0
    assert any(p.moving for p in seen) and any(p.items_left >= 0 for p in seen)
    vbmap = c.vbucket_map()
    assert vbmap.revision >= rev + reb.total
    assert Counter(vbmap.active(vb) for vb in range(16))["n3"] == 4
    assert writer.refused > 0  # front-end writes answered TMPFAIL during takeovers
    _assert_converged(c, writer, client)
    # No new failover entry anywhere (kv_engine: takeover -> no entry).
    for vb in range(16):
        assert c.active_bucket(vb).failover_log(vb) == logs[vb]
    # Out: n0 leaves.
    reb = c.start_rebalance(remove=["n0"])
    _pump_until_done(c, reb, writer, client)
    assert "n0" not in c.vbucket_map().nodes and "n0" not in c.nodes and c.ejected == ["n0"]
    assert all("n0" not in ch for ch in c.vbucket_map().chains)
    _assert_converged(c, writer, client)
    for vb in range(16):
        assert c.active_bucket(vb).failover_log(vb) == logs[vb]
    # Every copy a node holds is the map's: the rest are dead.
    for name, node in c.nodes.items():
        b = node.require_bucket()
        for vb in range(16):
            chain = c.vbucket_map().chains[vb]
            want = (VBucketState.ACTIVE if chain[0] == name else
                    VBucketState.REPLICA if name in chain else VBucketState.DEAD)
            assert b.vbucket(vb).state is want, (name, vb)


def test_rebalance_blocking_call_with_progress_callback(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=1, num_vbuckets=8)
    writer = Writer(c)
    writer.write(100)
    calls: list[RebalanceProgress] = []
    result = c.rebalance(add=["n2"], remove=["n0"], progress=calls.append)
    assert result.status == "done" and result.moved == result.total
    assert calls and calls[-1].status == "done"
    assert sorted(c.vbucket_map().nodes) == ["n1", "n2"]
    _assert_converged(c, writer)


def test_takeover_state_mismatch_is_reverted_and_retried(make_cluster) -> None:
    """docs/rebalance.md "The mover": after the takeover the mover checks both sides; on a mismatch both go back to their original
    states and the takeover runs again."""
    c = make_cluster(nodes=2, replicas=0, num_vbuckets=4)
    writer = Writer(c)
    writer.write(60)
    reb = c.start_rebalance(add=["n2"])
    sabotaged = False
    for _ in range(10_000):
        if reb.done:
            break
        for m in reb.running:
            if m.phase is MovePhase.TAKEOVER and not sabotaged:
                # Something else changes the new node's copy: the takeover's active message is refused.
                dst = c.node(m.target).require_bucket()
                if dst.vbucket(m.vbucket).state is VBucketState.REPLICA:
                    dst.set_vbucket_state(m.vbucket, VBucketState.DEAD)
                    sabotaged = True
        c.pump()
        writer.write(2)
    assert sabotaged and reb.status == "done", reb.error
    assert reb.reverts >= 1
    _assert_converged(c, writer)


def test_rebalance_refuses_bad_requests(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=1, num_vbuckets=4)
    with pytest.raises(InvalidArgument):
        c.start_rebalance(remove=["nX"])
    with pytest.raises(InvalidArgument):
        c.start_rebalance(remove=["n0", "n1"])
    with pytest.raises(InvalidArgument):
        c.start_rebalance(remove=["n0"])  # one node cannot hold a replica
    with pytest.raises(InvalidArgument):
        c.start_rebalance(add=["n1"])
    with pytest.raises(InvalidArgument):
        c.start_rebalance(add=["n2"], remove=["n2"])
    with pytest.raises(InvalidArgument):
        c.start_rebalance(add=["bad name!"])
    c.start_rebalance(add=["n2"])
    with pytest.raises(InvalidArgument):
        c.start_rebalance(add=["n3"])


def test_node_down_stops_the_rebalance_and_reverts_moves(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=8)
    writer = Writer(c)
    writer.write(100)
    reb = c.start_rebalance(add=["n3"])
    for _ in range(3):
        c.pump()
    c.kill("n3")
    c.pump()
    assert reb.status == "failed" and "n3" in (reb.error or "")
    assert c.rebalance_running is None
    # Everything in flight is back in its original state: the map's copies serve, writes go on.
    for vb in range(8):
        assert c.active_bucket(vb).vbucket(vb).state is VBucketState.ACTIVE
    writer.write(50)
    c.settle()
    for k, v in writer.acked.items():
        assert c.get(k.decode()).value == v


def test_failover_during_rebalance_aborts_it(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=8)
    writer = Writer(c)
    writer.write(100)
    c.settle()
    reb = c.start_rebalance(add=["n3"])
    for _ in range(4):
        c.pump()
        writer.write(5)
    c.settle()
    c.failover("n0", graceful=True)
    assert reb.status == "failed"
    writer.write(50)
    _assert_converged(c, writer)
    # A new rebalance after the failover refills the empty slots and finishes.
    c.rebalance()
    assert all(None not in ch for ch in c.vbucket_map().chains)
    _assert_converged(c, writer)


def test_swap_active_and_replica_keeps_old_active_as_replica(make_cluster) -> None:
    """A move whose new chain keeps the old active as a replica: after the takeover the old (dead) copy
    becomes a replica of the new active."""
    c = make_cluster(nodes=2, replicas=1, num_vbuckets=4)
    writer = Writer(c)
    writer.write(80)
    c.settle()
    vbmap = c.vbucket_map()
    swapped = [[ch[1], ch[0]] if vb == 0 else list(ch) for vb, ch in enumerate(vbmap.chains)]
    reb = Rebalance(c, [], [])
    reb.queue = [VBucketMove(0, list(vbmap.chains[0]), swapped[0])]
    reb.total = 1
    c._rebalance = reb
    _pump_until_done(c, reb, writer)
    assert c.vbucket_map().chains[0] == swapped[0]
    _assert_converged(c, writer)


def test_blocking_rebalance_raises_when_it_stops(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=8)
    Writer(c).write(50)

    def crash_new_node(p: RebalanceProgress) -> None:
        if p.status == "running" and c.nodes["n3"].up:
            c.kill("n3")

    with pytest.raises(TemporaryFailure, match="n3"):
        c.rebalance(add=["n3"], progress=crash_new_node)
    assert c.rebalance_running is None
    assert "n3" in c.vbucket_map().nodes  # in the map's node list, holding nothing
    assert not c.vbucket_map().vbuckets_of("n3")


@pytest.mark.parametrize("name", ["", "a b", "n/1", "x" * 65, 7, "n0"])
def test_add_node_refuses_a_bad_or_taken_name(make_cluster, name) -> None:
    c = make_cluster(nodes=3, replicas=1)
    before = (c.vbucket_map(), sorted(c.nodes))
    with pytest.raises(InvalidArgument):
        c.add_node(name)
    assert (c.vbucket_map(), sorted(c.nodes)) == before  # nothing started, the map unchanged
