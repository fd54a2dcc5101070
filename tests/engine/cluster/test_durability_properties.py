"""Hypothesis campaign (sync-replication proof 3; docs/durability.md): random schedules of sync writes (all levels, short and default
timeouts), plain writes, partial pumps (some connections, a few messages, with or without flushing), single-node
flushes, clock ticks (timeouts), crashes and restarts, and one hard failover, on the deterministic in-process
cluster with a ManualClock. A hard failover happens only while every other node is up (one failure at a
time: no durability level survives losing a majority of a chain).

Invariants after the schedule (every node of the map restarted, replication settled):

* zero lost acknowledged durable writes: every sync write whose handle reported committed is visible on its
  vbucket's active with its value -- or, when the vbucket's chain can no longer reach a majority (1 replica
  after a failover), held there as a prepare awaiting re-commit. Guaranteed for PERSIST_TO_MAJORITY always, and
  for MAJORITY / MAJORITY_AND_PERSIST_TO_ACTIVE when no node crashed after the write was submitted, other than
  the one hard failed over (in-memory durability does not survive losing the memory of a majority that acked:
  kv_engine's guarantee is the same; a replica's seqno-ack counts even when the replica crashes before the
  client's ack, so the crash that matters is one after the replica acked, i.e. possibly before the client's ack);
* with a chain that can reach a majority, no prepare is left in flight on any active;
* replicas equal their actives (documents and prepares); a DCP client without sync writes converges to the
  actives' visible state (it never saw a prepare: a timed-out or in-flight write is all or nothing).
"""

from __future__ import annotations

import os
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.cluster.sync_write_schedules import Harness, op

MAX_EXAMPLES = int(os.environ.get("DURABILITY_PROP_EXAMPLES", "120"))
STATS = {"runs": 0, "failovers": 0, "acked": 0, "checked": 0, "ambiguous": 0, "awaiting_recommit": 0}


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=20, max_size=90), nodes=st.integers(3, 4), replicas=st.integers(1, 2))
def test_sync_write_schedules_lose_no_acknowledged_durable_write(tmp_path_factory, ops, nodes, replicas) -> None:
    h = Harness(tmp_path_factory.mktemp("dur"), nodes, replicas)
    h.run(ops)
    STATS["runs"] += 1
    STATS["failovers"] += h.failovers
    for k in ("acked", "checked", "ambiguous", "awaiting_recommit"):
        STATS[k] += h.stats[k]


def test_report_campaign_counts() -> None:
    # Not an invariant: the campaign's size, visible with -s.
    print(f"\ndurability campaign: {STATS} at {time.strftime('%H:%M:%S')}")
