"""The in-process cluster (engine/cluster/local.py): routing, replication, hard and graceful failover, observe,
partition-state CAS. Real SQLite storage on every node."""

from __future__ import annotations

import pytest

from engine import KeyNotFound, NotMyVBucket, Status, TemporaryFailure, VBucketState
from engine.cluster.local import MAP_FILE, Cluster
from engine.cluster.vbucket_map import VBucketMap
from engine.exceptions import InvalidArgument, StateCasMismatch
from tests.engine.cluster_model import ClusterClient, actives_state, assert_replicas_equal_actives


def _keys_on(cluster: Cluster, vb: int, n: int, prefix: str = "k") -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if cluster.vbucket_of(k) == vb:
            out.append(k)
        i += 1
    return out


def test_routing_and_not_my_vbucket(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=8)
    vbmap = c.vbucket_map()
    assert (c.base_dir / MAP_FILE).exists()
    assert VBucketMap.from_json((c.base_dir / MAP_FILE).read_text()) == vbmap
    res = c.write("doc", b"v1")
    vb = c.vbucket_of("doc")
    assert res.vbucket == vb and c.get("doc").value == b"v1"
    active = vbmap.active(vb)
    replica = vbmap.replicas(vb)[0]
    other = next(n for n in vbmap.nodes if n not in (active, replica))
    for name in (replica, other):
        b = c.node(name).bucket
        assert b is not None
        with pytest.raises(NotMyVBucket) as ei:
            b.set("doc", b"x")
        assert ei.value.status is Status.NOT_MY_VBUCKET and ei.value.retriable
        with pytest.raises(NotMyVBucket):
            b.get("doc")
    ab = c.node(active).bucket
    assert ab is not None
    assert ab.vbucket(vb).state is VBucketState.ACTIVE
    assert c.node(replica).bucket.vbucket(vb).state is VBucketState.REPLICA
    assert c.node(other).bucket.vbucket(vb).state is VBucketState.DEAD
    with pytest.raises(NotMyVBucket):
        c.active_bucket(99)
    c.delete("doc")
    with pytest.raises(KeyNotFound):
        c.get("doc")
    with pytest.raises(InvalidArgument):
        c.node("nope")


@pytest.mark.parametrize("replicas", [0, 1, 2, 3])
def test_replica_counts(make_cluster, replicas: int) -> None:
    c = make_cluster(nodes=4, replicas=replicas, num_vbuckets=8)
    for i in range(120):
        c.write(f"k{i}", f"v{i}".encode())
        if i % 10 == 0:
            c.delete(f"k{i // 2}")
    c.settle()
    assert_replicas_equal_actives(c)
    vbmap = c.vbucket_map()
    pairs = {(ch[0], r) for ch in vbmap.chains for r in ch[1:]}
    assert set(c.connections()) == pairs and len(pairs) <= 4 * 3
    for vb in range(8):
        held = [n for n in c.nodes if c.node(n).bucket.vbucket(vb).state is not VBucketState.DEAD]
        assert len(held) == replicas + 1
    client = ClusterClient(c)
    client.poll()
    assert client.state() == actives_state(c)


def test_hard_failover_when_replicas_lack_newest_items(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=8)
    vbmap = c.vbucket_map()
    mine = vbmap.vbuckets_of("n0", slot=0)
    old_tokens = {}
    for vb in range(8):
        for k in _keys_on(c, vb, 3, "a"):
            old_tokens[k] = c.write(k, b"old").token
    c.settle()
    assert all(c.is_replicated(t, persisted=True) for t in old_tokens.values())
    new_tokens = {}
    for vb in mine:
        for k in _keys_on(c, vb, 2, "b"):
            new_tokens[k] = c.write(k, b"new").token
    c.node("n0").bucket.flush_all()  # persisted on the old active only
    client = ClusterClient(c)
    client.poll()
    assert all(k.encode() in client.state() for k in new_tokens)  # the client saw the doomed items
    for t in new_tokens.values():
        r = c.observe_seqno(t.vbucket, t.vbuuid)
        assert not r.failed_over and r.persisted_seqno >= t.seqno
        assert all(s < t.seqno for s in r.replicated_seqnos.values())
        assert not c.is_replicated(t)
    complete = {vb: c.node(vbmap.replicas(vb)[0]).bucket.vbucket(vb).snapshot_complete for vb in mine}
    old_uuid = {vb: c.node("n0").bucket.vbucket(vb).failover.latest.vbuuid for vb in mine}

    c.kill("n0")
    with pytest.raises(TemporaryFailure):
        c.write(_keys_on(c, mine[0], 1, "x")[0], b"down")
    report = c.failover("n0")
    assert not report.graceful and report.revision == vbmap.revision + 1 and not report.lost
    assert sorted(report.promoted) == mine
    newmap = c.vbucket_map()
    assert "n0" not in newmap.nodes
    for vb in mine:
        entry = report.entries[vb]
        assert entry is not None and entry.seqno == complete[vb]
        promoted = c.node(report.promoted[vb]).bucket.vbucket(vb)
        assert promoted.state is VBucketState.ACTIVE
        assert promoted.failover.latest == entry and entry.vbuuid != old_uuid[vb]
        assert newmap.active(vb) == report.promoted[vb]
    # observe: the lost writes are reported failed over above the branch point; the old ones survived
    for t in new_tokens.values():
        r = c.observe_seqno(t.vbucket, t.vbuuid)
        assert r.failed_over and r.old_vbuuid == t.vbuuid and r.last_seqno is not None
        assert r.last_seqno < t.seqno
        assert not c.is_replicated(t, replicas=0)
    for t in old_tokens.values():
        r = c.observe_seqno(t.vbucket, t.vbuuid)
        assert (not r.failed_over) or t.seqno <= r.last_seqno
    # the client that read the lost items gets ROLLBACK from the new active and converges to it
    client.poll()
    for vb in mine:
        assert client.consumer.vbs[vb].rollbacks, f"vb {vb}: expected a rollback"
        assert all(r <= complete[vb] for r in client.consumer.vbs[vb].rollbacks)
    state = actives_state(c)
    assert client.state() == state
    assert not any(k.encode() in state for k in new_tokens)
    assert all(state[k.encode()][0] == b"old" for k in old_tokens)
    # the cluster keeps working on the new map
    for i in range(40):
        c.write(f"after{i}", b"1")
    c.settle()
    client.poll()
    assert client.state() == actives_state(c)
    assert_replicas_equal_actives(c)


def test_hard_failover_promotes_most_up_to_date_and_others_roll_back(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=2, num_vbuckets=1)
    assert c.vbucket_map().chains == [["n0", "n1", "n2"]]
    keys = [f"k{i}" for i in range(8)]
    for k in keys[:4]:
        c.write(k, b"1")
    c.settle()
    for k in keys[4:]:
        c.write(k, b"2")
    c.pump(only=[("n0", "n1")])  # n1 gets the whole second snapshot (5..8)
    c.pump(only=[("n0", "n2")], max_messages=3)  # n2: marker + 2 items of it (partial)
    n1 = c.node("n1").bucket.vbucket(0)
    n2 = c.node("n2").bucket.vbucket(0)
    assert (n1.high_seqno, n1.snapshot_complete) == (8, 8)
    assert (n2.high_seqno, n2.snapshot_complete) == (6, 4)
    # n1, the most up to date, is down: n2 is promoted, rolls back its partial snapshot, entry at 4
    c.kill("n1")
    c.kill("n0")
    report = c.failover("n0")
    assert report.promoted == {0: "n2"}
    entry = report.entries[0]
    assert entry is not None and entry.seqno == 4
    assert n2.high_seqno == 4 and n2.state is VBucketState.ACTIVE
    # n1 comes back ahead of the new active on the abandoned branch: it rolls back to 4 and re-streams
    c.restart("n1")
    c.write("k9", b"3")
    c.settle()
    r1 = c.node("n1").bucket
    assert r1 is not None and r1.stats()["replica_rollbacks"] >= 1
    assert_replicas_equal_actives(c)
    assert c.get("k0").value == b"1"
    with pytest.raises(KeyNotFound):
        c.get("k5")


def test_hard_failover_without_replica_loses_the_vbucket(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=0, num_vbuckets=4)
    mine = c.vbucket_map().vbuckets_of("n1", slot=0)
    report = c.failover("n1")  # the node is up: ejected, its vbuckets become dead
    assert report.lost == mine and not report.promoted
    key = _keys_on(c, mine[0], 1)[0]
    with pytest.raises(NotMyVBucket):
        c.write(key, b"v")
    assert c.node("n1").bucket.vbucket(mine[0]).state is VBucketState.DEAD
    with pytest.raises(InvalidArgument):
        c.failover("n1")


def test_graceful_failover_under_writes_loses_nothing(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=8)
    client = ClusterClient(c)
    expected: dict[str, bytes] = {}
    for i in range(200):
        k = f"k{i % 50}"
        v = f"v{i}".encode()
        c.write(k, v)
        expected[k] = v
        if i % 17 == 0:
            c.pump(max_messages=5, flush=i % 2 == 0)
        if i % 23 == 0:
            client.poll()
    seen = {vb: st.position.seqno for vb, st in client.consumer.vbs.items()}
    mine = c.vbucket_map().vbuckets_of("n1", slot=0)
    uuids = {vb: c.node("n1").bucket.vbucket(vb).failover.latest.vbuuid for vb in mine}
    highs = {vb: c.node("n1").bucket.vbucket(vb).high_seqno for vb in mine}
    report = c.failover("n1", graceful=True)
    assert report.graceful and not report.lost and sorted(report.promoted) == mine
    for vb in mine:
        assert report.entries[vb] is None  # takeover: no failover entry, same history
        new = c.active_bucket(vb).vbucket(vb)
        assert new.failover.latest.vbuuid == uuids[vb] and new.high_seqno == highs[vb]
    assert c.node("n1").bucket.vbucket(mine[0]).state is VBucketState.DEAD
    for k, v in expected.items():
        assert c.get(k).value == v
    for i in range(60):
        k = f"k{i}"
        c.write(k, b"late")
        expected[k] = b"late"
    c.settle()
    client.poll()
    assert all(not st.rollbacks for st in client.consumer.vbs.values())
    assert all(client.consumer.vbs[vb].position.seqno >= seen[vb] for vb in seen)
    assert client.state() == actives_state(c) == {
        k.encode(): (v, c.vbucket_of(k)) for k, v in expected.items()}
    assert_replicas_equal_actives(c)


def test_graceful_failover_refuses_down_node(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=4)
    c.kill("n2")
    with pytest.raises(InvalidArgument):
        c.failover("n2", graceful=True)


def test_stale_state_cas_rejected(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=1, num_vbuckets=2)
    b = c.node("n0").bucket
    assert b is not None
    cas = b.state_cas(0)
    new = b.set_vbucket_state(0, b.vbucket(0).state, cas=cas)  # a no-op change keeps the CAS
    assert new == cas
    new = b.set_vbucket_state(1, VBucketState.DEAD, cas=b.state_cas(1))
    assert new == b.state_cas(1)
    stale = cas
    b.set_vbucket_state(0, VBucketState.DEAD, cas=cas)
    with pytest.raises(StateCasMismatch) as ei:
        b.set_vbucket_state(0, VBucketState.ACTIVE, cas=stale)  # a delayed, reordered command
    err = ei.value
    assert err.status is Status.KEY_EEXISTS and err.retriable and err.current_cas == b.state_cas(0)
    assert b.vbucket(0).state is VBucketState.DEAD
    with pytest.raises(StateCasMismatch):
        b.promote(0, cas=stale)
    # a restart draws new CASes: the manager's remembered ones are stale, it learns and retries (seed step 6)
    c2 = make_cluster(nodes=3, replicas=1, num_vbuckets=4)
    c2.kill("n1")
    c2.restart("n1")
    before = c2.stale_cas_retries
    c2.failover("n1", graceful=True)
    assert c2.stale_cas_retries > before


def test_active_crash_makes_ahead_replicas_roll_back(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=1, num_vbuckets=4)
    for i in range(20):
        c.write(f"k{i}", b"1")
    c.settle()
    for i in range(20, 40):
        c.write(f"k{i}", b"2")
    c.pump(flush=False)  # replicas receive the items; the active never persists them
    c.node("n1").bucket.flush_all()
    c.node("n0").bucket.flush_all()
    for i in range(40, 50):
        c.write(f"k{i}", b"3")
    c.pump(flush=False)
    c.kill("n0")
    c.restart("n0")  # unclean warmup: its actives get a failover entry at the persisted seqno
    c.settle()
    rb = c.node("n1").bucket
    assert rb is not None and rb.stats()["replica_rollbacks"] >= 1
    assert_replicas_equal_actives(c)
    client = ClusterClient(c)
    client.poll()
    assert client.state() == actives_state(c)


def test_observe_before_and_after_replication(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=2, num_vbuckets=4)
    t = c.write("doc", b"v").token
    r = c.observe_seqno(t.vbucket, t.vbuuid)
    assert r.vbuuid == t.vbuuid and r.current_seqno == t.seqno and r.persisted_seqno < t.seqno
    assert not r.failed_over and r.old_vbuuid is None and r.last_seqno is None
    assert set(r.replicated_seqnos) == set(c.vbucket_map().replicas(t.vbucket))
    assert not c.is_replicated(t, replicas=1)
    c.pump(flush=False)
    assert c.is_replicated(t) and not c.is_replicated(t, persisted=True)
    c.pump()
    assert c.is_replicated(t, replicas=2, persisted=True)
    r = c.observe_seqno(t.vbucket, t.vbuuid)
    assert all(s >= t.seqno for s in r.replica_persisted_seqnos.values())
    # an unknown vbuuid: failed over, nothing of that branch kept
    r = c.observe_seqno(t.vbucket, 12345)
    assert r.failed_over and r.last_seqno == 0
    active = c.vbucket_map().active(t.vbucket)
    assert active is not None
    c.failover(active)
    r = c.observe_seqno(t.vbucket, t.vbuuid)
    assert r.failed_over and r.last_seqno is not None and r.last_seqno >= t.seqno
    assert c.is_replicated(t, replicas=1)  # survived on the new branch, still on the remaining replica
    assert c.get("doc").value == b"v"


def test_gateway_facing_api(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=1, num_vbuckets=4)
    c.write("doc", b"v")
    vb = c.vbucket_of("doc")
    active = c.vbucket_map().active(vb)
    assert active is not None
    b = c.node(active).bucket
    assert b is not None
    p = b.dcp_producer("gateway")
    p.stream_request(vb, 0)
    msgs = p.step()
    assert any(getattr(m, "key", None) == b"doc" for m in msgs)
    # the active changes state (failover of its node): the stream ends with STATE_CHANGED
    c.failover(active)
    from engine import StreamEnd, StreamEndReason

    ends = [m for m in p.step() if isinstance(m, StreamEnd)]
    assert ends and ends[0].reason is StreamEndReason.STATE_CHANGED


def test_reopen_whole_cluster_from_its_map(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, num_vbuckets=4)
    for i in range(30):
        c.write(f"k{i}", b"v")
    c.settle()
    c.failover("n2", graceful=True)
    revision = c.vbucket_map().revision
    c.close()
    again = Cluster.open(c.base_dir)
    try:
        assert again.vbucket_map().revision == revision and set(again.nodes) == {"n0", "n1"}
        assert all(again.get(f"k{i}").value == b"v" for i in range(30))
        again.write("more", b"1")
        again.settle()
        assert_replicas_equal_actives(again)
    finally:
        again.close()
    with pytest.raises(InvalidArgument):
        Cluster.open(c.base_dir / "nothing")
