"""Delta and full recovery of a failed-over node, rollback repair, and the bad inputs of ``Cluster.recover``
(docs/cluster.md "Delta recovery", "Rollback repair")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine import InvalidArgument, KeyNotFound
from engine.cluster.local import Cluster
from tests.engine.cluster_model import ClusterClient, actives_state, assert_replicas_equal_actives

NVB = 8


def _keys_of(c: Cluster, node: str, n: int = 60) -> list[str]:
    mine = set(c.vbucket_map().vbuckets_of(node, slot=0))
    return [f"d{i}" for i in range(n) if c.vbucket_of(f"d{i}") in mine]


def _diverged(tmp_path: Path, *, kill: bool = True) -> tuple[Cluster, list[str]]:
    """n0's actives wrote items it never replicated, then n0 was hard-failed-over (killed first)."""
    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB, seed=3)
    for i in range(60):
        c.write(f"d{i}", f"v{i}")
    c.settle()
    keys = _keys_of(c, "n0")
    for k in keys:
        c.write(k, f"unreplicated-{k}")
    c.pump(only=[p for p in c.connections() if p[0] != "n0"])
    c.nodes["n0"].require_bucket().flush_all()
    if kill:
        c.kill("n0")
    c.failover("n0")
    return c, keys


def test_delta_recovery_with_repair_keeps_unreplicated_writes_the_new_active_did_not_touch(tmp_path) -> None:
    c, keys = _diverged(tmp_path)
    client = ClusterClient(c, "client")
    client.poll()
    touched, deleted = keys[:2], keys[2]
    for k in touched:
        c.write(k, f"new-{k}")
    c.delete(deleted)
    highs = {vb: c.active_bucket(vb).vbucket_info(vb).high_seqno for vb in range(NVB)}
    rep = c.recover("n0", "delta")
    assert rep.mode == rep.requested_mode == "delta" and not rep.message and not rep.pending
    assert sorted(rep.replicas) == sorted(vb for vb in range(NVB) if "n0" in c.vbucket_map().chains[vb])
    assert rep.counts.repaired == len(keys) - 3 and rep.counts.superseded == 3 and rep.rollbacks >= 1
    assert "n0" in c.vbucket_map().nodes and "n0" not in c.failed
    c.settle()
    for k in keys:
        if k in touched:
            assert c.get(k).value == f"new-{k}".encode()
        elif k == deleted:
            with pytest.raises(KeyNotFound):
                c.get(k)
        else:
            got = c.get(k)
            assert got.value == f"unreplicated-{k}".encode()  # repaired: a new seqno on the active
            assert got.seqno > highs[c.vbucket_of(k)]
    assert_replicas_equal_actives(c)
    client.poll()
    assert client.state() == actives_state(c)
    assert c.recovery_counts.repaired == rep.counts.repaired
    # the map is whole again; a rebalance (the user's) restores the balance of actives
    c.rebalance()
    assert c.vbucket_map().vbuckets_of("n0", slot=0)
    assert_replicas_equal_actives(c)
    c.close()


def test_repair_keeps_the_revision_and_repairs_deletions(tmp_path) -> None:
    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB, seed=3)
    keys = _keys_of(c, "n0")
    a, b = keys[0], keys[1]
    c.write(a, "1")
    c.write(b, "1")
    c.settle()
    c.write(a, "2")
    c.write(a, "3")  # rev 3 on n0 only
    c.delete(b)  # a deletion on n0 only
    rev = c.nodes["n0"].require_bucket().get(a).rev_seqno
    c.failover("n0")  # n0 stays up: its vbuckets become dead, data kept
    assert c.get(b).value == b"1"
    rep = c.recover("n0")
    c.settle()
    assert rep.counts.repaired == 2
    got = c.get(a)
    assert got.value == b"3" and got.rev_seqno == rev
    with pytest.raises(KeyNotFound):
        c.get(b)
    assert_replicas_equal_actives(c)
    c.close()


def test_delta_recovery_without_repair_is_todays_rollback(tmp_path) -> None:
    c, keys = _diverged(tmp_path)
    c.rollback_repair = False
    before = {k: c.get(k).value for k in keys}
    highs = {vb: c.active_bucket(vb).vbucket_info(vb).high_seqno for vb in range(NVB)}
    rep = c.recover("n0")
    assert rep.counts.repaired == 0 and rep.counts.discarded == len(keys) and not rep.rollback_repair
    assert {vb: c.active_bucket(vb).vbucket_info(vb).high_seqno for vb in range(NVB)} == highs
    c.settle()
    assert {k: c.get(k).value for k in keys} == before  # the unreplicated writes are gone
    assert_replicas_equal_actives(c)
    c.close()


def test_delta_recovery_streams_only_the_difference_full_recovery_everything(tmp_path) -> None:
    sent = {}
    for mode in ("delta", "full"):
        c = Cluster.create(tmp_path / mode, nodes=3, replicas=1, num_vbuckets=NVB, seed=3)
        for i in range(600):
            c.write(f"d{i}", f"v{i}")
        c.settle()
        c.failover("n0")
        for i in range(0, 600, 100):  # 1% changed
            c.write(f"d{i}", "changed")
        rep = c.recover("n0", mode)
        assert rep.mode == mode and rep.counts.repaired == 0
        c.settle()
        assert_replicas_equal_actives(c)
        sent[mode] = sum(conn.streams[vb].items for (_src, dst), conn in c._conns.items() if dst == "n0"
                         for vb in conn.streams)
        c.close()
    assert sent["delta"] <= 6 < 100 < sent["full"], sent


def test_a_vbucket_that_lost_every_other_copy_comes_back_active_with_its_data(tmp_path) -> None:
    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB, seed=3)
    for i in range(60):
        c.write(f"d{i}", f"v{i}")
    c.settle()
    held = {vb for vb in range(NVB) if "n1" in c.vbucket_map().chains[vb]}
    c.kill("n1")
    c.kill("n2")
    lost = set(c.failover("n1").lost) | set(c.failover("n2").lost)
    assert lost & held
    rep = c.recover("n1", "delta")
    assert set(rep.actives) == lost & held
    for i in range(60):
        if c.vbucket_of(f"d{i}") in set(rep.actives):
            assert c.get(f"d{i}").value == f"v{i}".encode()
    c.close()


def test_recover_a_node_never_failed_over_is_refused(tmp_path) -> None:
    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB)
    with pytest.raises(InvalidArgument, match="never failed over"):
        c.recover("n1")
    c.close()


def test_recover_an_unknown_node_is_refused(tmp_path) -> None:
    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB)
    for bad in ("n9", "", None, 7):
        with pytest.raises(InvalidArgument):
            c.recover(bad)  # type: ignore[arg-type]
    c.failover("n1")
    with pytest.raises(InvalidArgument, match="mode"):
        c.recover("n1", "partial")
    c.close()


def test_recover_a_node_removed_by_a_rebalance_is_refused(tmp_path) -> None:
    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB)
    c.rebalance(remove=["n2"])
    with pytest.raises(InvalidArgument, match="removed by a rebalance"):
        c.recover("n2")
    c.close()


@pytest.mark.parametrize("up", [False, True])
def test_recover_a_node_whose_data_directory_is_gone_falls_back_to_full(tmp_path, up: bool) -> None:
    c, _keys = _diverged(tmp_path, kill=not up)
    shutil.rmtree(tmp_path / "n0")
    rep = c.recover("n0", "delta")
    assert rep.requested_mode == "delta" and rep.mode == "full"
    assert "data directory" in rep.message and "full recovery" in rep.message
    assert rep.counts.repaired == 0 and rep.rollbacks == 0
    c.settle()
    assert_replicas_equal_actives(c)
    items = c.nodes["n0"].require_bucket().stats()["items"]
    assert isinstance(items, int) and items > 0
    c.close()


def test_prepares_are_never_repaired(tmp_path) -> None:
    from engine.kv.durability import Durability, Level

    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB, seed=3)
    keys = _keys_of(c, "n0")
    c.write(keys[0], "base")
    c.settle()
    c.write(keys[1], "plain")  # unreplicated plain write: repaired
    c.submit(keys[2], b"durable", durability=Durability(Level.MAJORITY))  # a prepare nobody acknowledged
    c.nodes["n0"].require_bucket().flush_all()
    c.kill("n0")
    c.failover("n0")
    rep = c.recover("n0")
    assert rep.counts.prepares == 1 and rep.counts.repaired == 1
    c.settle()
    assert c.get(keys[1]).value == b"plain"
    with pytest.raises(KeyNotFound):
        c.get(keys[2])  # the prepare's outcome is the durability rules': never committed
    assert_replicas_equal_actives(c)
    c.close()
