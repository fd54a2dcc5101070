"""Property tests (hypothesis) over random cluster schedules: writes, deletes, pumps of some connections only,
flushes, node crash + restart, hard and graceful failover, DCP clients following the map.

Invariants:
(a) every DCP client converges to the actives' state (after whatever rollbacks it was told to do);
(b) every write that observe said was replicated to all replicas and persisted right before a failover is
    still in the new active's history after it;
(c) after a full pump no replica differs from its active (items, seqnos, rev seqnos, CAS, failover log).
"""

from __future__ import annotations

import os
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.cluster.schedules import Harness, op

#: raise for a longer campaign: CLUSTER_PROP_EXAMPLES=5000 pytest tests/engine/cluster/test_cluster_properties.py -s
MAX_EXAMPLES = int(os.environ.get("CLUSTER_PROP_EXAMPLES", "150"))
STATS = {"runs": 0, "failovers": 0, "checked": 0, "rollbacks": 0, "replica_rollbacks": 0}


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=20, max_size=100), nodes=st.integers(3, 4), replicas=st.integers(1, 2))
def test_cluster_schedules_keep_invariants(tmp_path_factory, ops, nodes, replicas) -> None:
    h = Harness(tmp_path_factory.mktemp("cluster"), nodes, replicas)
    h.run(ops)
    STATS["runs"] += 1
    STATS["failovers"] += h.failovers
    STATS["checked"] += h.checked
    STATS["rollbacks"] += h.client_rollbacks
    STATS["replica_rollbacks"] += h.replica_rollbacks


def test_report_campaign_counts() -> None:
    # Not an invariant: makes the campaign's size visible with -s (runs, failovers, writes checked by (b)).
    print(f"\ncluster campaign: {STATS} at {time.strftime('%H:%M:%S')}")
