"""A damaged vbucket map is rebuilt from the nodes' persisted vbucket states (engine/cluster/map_recovery.py): after
writes, a rebalance and a hard failover (so the actives are not the initial layout) the map file is emptied /
overwritten with garbage / removed and the cluster reopened: same actives, every document reads back (issue 16
item 8). The hypothesis property: over random failover / rebalance histories the rebuilt map equals the saved
one in everything the copies determine (actives, replica sets, nodes, replica count)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cluster.local import MAP_FILE, Cluster
from engine.cluster.map_recovery import CopyState, read_node_states, rebuild_map, salvage_revision
from engine.cluster.vbucket_map import VBucketMap
from engine.exceptions import InvalidArgument, KeyNotFound, NotMyVBucket

NVB = 16


def _crash(c: Cluster) -> None:
    """Every live node stops without a clean shutdown (the gateway killed -9)."""
    for node in c.nodes.values():
        if node.up:
            assert node.bucket is not None
            node.bucket.close(clean=False)
        node.bucket = None


def _determined(m: VBucketMap) -> tuple[object, ...]:
    """What the nodes' copies determine of a map: actives, replica sets, node set, replica count."""
    return (tuple(ch[0] for ch in m.chains), tuple(frozenset(n for n in ch[1:] if n) for ch in m.chains),
            frozenset(m.nodes), m.num_replicas)


def _history(base: Path) -> tuple[VBucketMap, dict[str, bytes]]:
    c = Cluster.create(base, nodes=3, replicas=1, num_vbuckets=NVB, seed=7)
    docs = {f"doc{i}": f"v{i}".encode() for i in range(200)}
    for k, v in docs.items():
        c.write(k, v)
    c.settle()
    c.rebalance(add=["n3"])  # actives move
    c.kill("n1")
    c.failover("n1")  # hard: replicas promoted (new failover entries); n1's stale states stay on its disk
    for i in range(200, 260):
        docs[f"doc{i}"] = f"w{i}".encode()
        c.write(f"doc{i}", docs[f"doc{i}"])
    c.settle()
    saved = c.vbucket_map()
    _crash(c)
    assert VBucketMap.from_json((base / MAP_FILE).read_bytes()) == saved
    return saved, docs


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "missing"])
def test_damaged_map_is_rebuilt_with_the_same_actives(tmp_path: Path, damage: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    base = tmp_path / "cluster"
    saved, docs = _history(base)
    assert saved.active(0) != VBucketMap.generate(["n0", "n1", "n2"], 1, NVB).active(0) or any(
        saved.active(vb) != VBucketMap.generate(["n0", "n1", "n2"], 1, NVB).active(vb) for vb in range(NVB))
    mp = base / MAP_FILE
    raw = mp.read_bytes()
    if damage == "empty":
        mp.write_bytes(b"")
    elif damage == "garbage":
        mp.write_bytes(b"\x00\xff not a map {{{")
    elif damage == "truncated":
        mp.write_bytes(raw[: len(raw) // 2])
    else:
        mp.unlink()
    with caplog.at_level(logging.WARNING, logger="engine.cluster"):
        c = Cluster.open(base, replicas=1)
    try:
        got = c.vbucket_map()
        assert _determined(got) == _determined(saved)
        assert "rebuilt from the nodes' vbucket states" in caplog.text and "n1" in caplog.text
        assert "n1" not in c.nodes  # failed over earlier: stays out
        if damage == "truncated":
            assert got.revision == saved.revision + 1  # salvaged from the surviving start of the file
        for k, v in docs.items():
            assert c.get(k).value == v
        c.write("after", b"x")
        c.settle()
        assert VBucketMap.from_json(mp.read_bytes()) == c.vbucket_map()  # saved (atomically)
    finally:
        c.close()
    c = Cluster.open(base)  # the saved map is read as is now
    try:
        assert c.get("after").value == b"x"
        assert c.vbucket_map() == got
    finally:
        c.close()


def test_no_map_and_no_nodes_is_still_an_error(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / MAP_FILE).write_bytes(b"")
    with pytest.raises(InvalidArgument, match="no cluster under"):
        Cluster.open(tmp_path / "c")


def _copy(state: str, log: list[tuple[int, int]], high: int, complete: int | None = None) -> CopyState:
    return CopyState(state, tuple(log), high, high if complete is None else complete)


def test_two_actives_the_promoted_one_wins_and_the_stale_node_stays_out() -> None:
    # n0 was active with history [(10, 0)]; it went down, n1 was promoted (entry (20, 5) on top of n0's).
    states = {
        "n0": {0: _copy("active", [(10, 0)], 7), 1: _copy("replica", [(30, 0)], 3)},
        "n1": {0: _copy("active", [(20, 5), (10, 0)], 5), 1: _copy("active", [(30, 0)], 3)},
        "n2": {0: _copy("dead", [(10, 0)], 0), 1: _copy("replica", [(30, 0)], 3)},
    }
    r = rebuild_map(states, 2, replicas=1)
    assert r.vbmap.chains == [["n1", None], ["n1", "n2"]]
    assert r.failed_over == ["n0"] and r.conflicts == {0: ["n1", "n0"]}
    assert r.vbmap.nodes == ["n1", "n2"]


def test_no_active_promotes_the_replica_with_the_highest_complete_snapshot() -> None:
    states = {
        "n0": {0: _copy("replica", [(1, 0)], 9, complete=4)},
        "n1": {0: _copy("replica", [(1, 0)], 6)},
        "n2": {0: _copy("replica", [(1, 0)], 6)},
    }
    r = rebuild_map(states, 1)
    assert r.vbmap.chains == [["n1", "n0", "n2"]] and r.promoted == {0: "n1"}


def test_node_names_sort_naturally_and_revision_is_salvaged() -> None:
    states = {n: {0: _copy("active" if n == "n10" else "replica", [(1, 0)], 1)} for n in ("n10", "n2", "n1")}
    r = rebuild_map(states, 1, revision=salvage_revision(b'{"revision":41,"nodes":["n') + 1)
    assert r.vbmap.nodes == ["n1", "n2", "n10"] and r.vbmap.chains == [["n10", "n1", "n2"]]
    assert r.vbmap.revision == 42
    assert salvage_revision(b"") == 0


# ---------------------------------------------------------------------- property: random histories
_OPS = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(1, 30)),
    st.tuples(st.just("hard_failover"), st.integers(0, 9)),
    st.tuples(st.just("graceful_failover"), st.integers(0, 9)),
    st.tuples(st.just("rebalance_in"), st.integers(0, 9)),
    st.tuples(st.just("rebalance_out"), st.integers(0, 9)),
    st.tuples(st.just("crash_restart"), st.integers(0, 9)),
), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS, replicas=st.integers(1, 2), crash=st.booleans())
def test_rebuilt_map_equals_the_saved_one_where_determined(tmp_path_factory: pytest.TempPathFactory,
                                                           ops: list[tuple[str, int]], replicas: int,
                                                           crash: bool) -> None:
    base = tmp_path_factory.mktemp("hist") / "cluster"
    c = Cluster.create(base, nodes=replicas + 2, replicas=replicas, num_vbuckets=8, seed=1)
    written = 0
    fresh = 100
    try:
        for op, arg in ops:
            vbmap = c.vbucket_map()
            members = list(vbmap.nodes)
            pick = members[arg % len(members)]
            with contextlib.suppress(InvalidArgument):
                if op == "write":
                    for _ in range(arg):
                        # NotMyVBucket: a second hard failover can take the last copy of a vbucket whose replica
                        # slot the first one emptied (no rebalance in between): it has no active copy then
                        with contextlib.suppress(KeyNotFound, NotMyVBucket):
                            c.write(f"k{written}", b"v")
                        written += 1
                elif op == "hard_failover" and len(members) > replicas + 1:
                    c.kill(pick)
                    c.failover(pick)
                elif op == "graceful_failover" and len(members) > replicas + 1:
                    c.failover(pick, graceful=True)
                elif op == "rebalance_in" and len(members) < 6:
                    c.rebalance(add=[f"n{fresh}"])
                    fresh += 1
                elif op == "rebalance_out" and len(members) > replicas + 1:
                    c.rebalance(remove=[pick])
                elif op == "crash_restart":
                    c.kill(pick)
                    c.restart(pick)
            c.settle()
        saved = c.vbucket_map()
    finally:
        if crash:
            _crash(c)
        else:
            c.close()
    states = read_node_states(base, "default")
    rebuilt = rebuild_map(states, 8, replicas=replicas).vbmap
    assert _determined(rebuilt) == _determined(saved)
