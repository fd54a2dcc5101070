"""Writes with meta on a cluster of node processes (docs/xdcr.md "Target side"): the replicas receive the
source's metadata over DCP, and after a hard failover the promoted copy answers GET_META with it and keeps
rejecting older writes."""

from __future__ import annotations

from typing import Any

import pytest

from engine.kv.conflict_resolution import ConflictRejected, ItemMeta
from engine.network.process_cluster import ProcessCluster

CLUSTER = ProcessCluster
CLUSTER_DEFAULTS: dict[str, Any] = {"num_vbuckets": 8}
CAS = 0x1700_0000_0000_0000


def test_meta_survives_replication_and_hard_failover(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1, conflict_resolution="lww")
    keys = [f"m{i}" for i in range(24)]
    for i, k in enumerate(keys):
        vb = c.vbucket_of(k)
        client = c.active_client(vb)
        if i % 3 == 2:
            client.del_with_meta(k, ItemMeta(CAS + i, 5, expiry=1_700_000_000 + i), vbucket=vb)
        else:
            client.set_with_meta(k, f"v{i}".encode(), ItemMeta(CAS + i, 5, flags=i), vbucket=vb)
    assert c.client("n0").stats()["conflict_resolution"] == "lww"
    c.settle()
    victim = "n1"
    c.kill(victim)
    c.failover(victim)
    for i, k in enumerate(keys):
        vb = c.vbucket_of(k)
        m = c.active_client(vb).get_meta(k, vbucket=vb)
        assert (m.cas, m.rev_seqno, m.deleted) == (CAS + i, 5, i % 3 == 2), k
        if not m.deleted:
            assert m.flags == i
        with pytest.raises(ConflictRejected):
            c.active_client(vb).set_with_meta(k, b"older", ItemMeta(CAS + i - 1, 99), vbucket=vb)
