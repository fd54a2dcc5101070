"""Rebalance of a cluster of node processes (engine/rebalance.py ProcessRebalance, seed 003): takeover streams
over TCP (markers with ACK, DCP_SET_VBUCKET_STATE and their acks as DCP responses), DCP_ADD_STREAM(TAKEOVER) on
the destination, ``stats dcp-vbtakeover`` on the source; a node rebalanced in and another out while writes
continue; a DCP client over TCP following the map never rolls back."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import NotMyVBucket, TemporaryFailure, VBucketState
from engine.exceptions import InvalidArgument
from engine.process_cluster import ProcessCluster
from engine.rebalance import RebalanceProgress
from tests.engine.process_model import ProcessClusterClient, actives_state, assert_replicas_equal_actives

NVB = 8
CFG: dict[str, Any] = {"checkpoint_max_items": 3, "backfill_chunk_items": 2}


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., ProcessCluster]]:
    made: list[ProcessCluster] = []

    def make(**kw: Any) -> ProcessCluster:
        kw.setdefault("num_vbuckets", NVB)
        c = ProcessCluster.start(tmp_path / f"c{len(made)}", **{**CFG, **kw})
        made.append(c)
        return c

    yield make
    for c in made:
        c.close(clean=False)


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
