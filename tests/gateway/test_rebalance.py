"""The gateway through a rebalance (issue 6 proof 1, in process): a fourth node rebalanced in and another out
while a writer continues and the publisher pumps. The gateway only follows the map (STATE_CHANGED stream ends,
map revisions): no rollback record, no data record twice, the topic replica and the Replicator equal the
actives, every acknowledged write present."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from engine import NotMyVBucket, TemporaryFailure
from engine.exceptions import KeyNotFound
from gateway.records import RecordType
from tests.gateway.test_cluster import NVB, ClusterHarness, cluster_harness  # noqa: F401 (fixture)


class AckedWriter:
    """Writes and deletes through the map; TMPFAIL (a takeover in progress) / NOT_MY_VBUCKET are not
    acknowledged and not retried. ``expected`` is what every acknowledged operation leaves."""

    def __init__(self, h: ClusterHarness) -> None:
        self.h = h
        self.i = 0
        self.expected: dict[bytes, bytes | None] = {}
        self.refused = 0

    def write(self, n: int) -> None:
        c = self.h.cluster
        for _ in range(n):
            self.i += 1
            key = f"k{self.i % 120}"
            try:
                if self.i % 7 == 0:
                    c.delete(key)
                    self.expected[key.encode()] = None
                else:
                    value = f'{{"n": {self.i}}}'.encode()
                    c.write(key, value)
                    self.expected[key.encode()] = value
            except (TemporaryFailure, NotMyVBucket):
                self.refused += 1
            except KeyNotFound:
                self.expected[key.encode()] = None


def _run_rebalance(h: ClusterHarness, w: AckedWriter, **kw: Any) -> None:
    c = h.cluster
    reb = c.start_rebalance(**kw)
    for _ in range(20_000):
        if reb.done:
            break
        w.write(4)
        c.pump(rounds=1, max_messages=32)
        for _ in range(2):
            h.pub.pump()
    assert reb.status == "done", reb.error
    assert reb.moved == reb.total > 0


@pytest.mark.parametrize("mitigation", [False, True])
def test_rebalance_in_and_out_under_writes_no_rollback_no_duplicate(cluster_harness, mitigation: bool) -> None:  # noqa: F811
    h: ClusterHarness = cluster_harness(rollback_mitigation=mitigation)
    c = h.cluster
    w = AckedWriter(h)
    w.write(200)
    h.settle()
    logs = {vb: c.active_bucket(vb).failover_log(vb) for vb in range(NVB)}
    _run_rebalance(h, w, add=["n3"])
    assert "n3" in c.vbucket_map().nodes and c.vbucket_map().vbuckets_of("n3", slot=0)
    _run_rebalance(h, w, remove=["n1"])
    assert "n1" not in c.vbucket_map().nodes
    assert w.refused > 0  # takeovers answered TMPFAIL for a moment
    w.write(50)
    h.settle()
    # No failover entry anywhere: the gateway's position stays on the same history.
    assert {vb: c.active_bucket(vb).failover_log(vb) for vb in range(NVB)} == logs
    recs = h.check()  # check_partition on every partition; TopicReplica == actives
    assert not [r for _p, _o, r in recs if r.type is RecordType.ROLLBACK]
    assert h.pub.rollbacks == 0
    data = Counter((r.vbucket, r.vbuuid, r.seqno) for _p, _o, r in recs if r.is_data)
    assert not [k for k, n in data.items() if n > 1], "a data record was published twice"
    moved = {r.vbucket for _p, _o, r in recs if r.type is RecordType.STREAM_END}
    assert moved  # STATE_CHANGED ended the streams of moved actives
    assert h.pub.following() == {vb: c.vbucket_map().active(vb) for vb in range(NVB)}
    actives = h.actives()
    for key, value in w.expected.items():
        if value is None:
            assert key not in actives
        else:
            assert actives[key][0] == value
    with h.replicate() as rep:
        assert not rep.rollbacks
        assert rep.docs() == actives
