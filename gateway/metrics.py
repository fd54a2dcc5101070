"""Prometheus metrics of a gateway process (prometheus-client), on a registry of its own per service."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

if TYPE_CHECKING:
    from gateway.publisher import Publisher


class GatewayMetrics:
    """Counters are fed from the publisher's own counts at scrape time (no work on the hot path)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.records = Counter("dcpgw_records_published", "Records produced to Kafka", registry=r)
        self.acked = Counter("dcpgw_records_acknowledged", "Records acknowledged by Kafka", registry=r)
        self.bytes = Counter("dcpgw_bytes_published", "Key + value bytes produced to Kafka", registry=r)
        self.rollbacks = Counter("dcpgw_rollbacks", "ROLLBACK answers turned into rollback records", registry=r)
        self.errors = Counter("dcpgw_errors", "Records Kafka refused permanently", registry=r)
        self.http_errors = Counter("dcpgw_http_errors", "HTTP requests answered 4xx/5xx", ["status"], registry=r)
        self.filtered = Counter("dcpgw_items_filtered", "Items dropped by the key filters", registry=r)
        self.oversize = Counter("dcpgw_oversize_records", "Oversize control records published in place of records "
                                "Kafka refused as too large (oversize_policy=skip)", registry=r)
        self.merged = Counter("dcpgw_snapshots_merged", "Snapshot markers rollback mitigation merged away: "
                              "consecutive small memory snapshots released together, published as one", registry=r)
        self.failed_vbuckets = Gauge("dcpgw_failed_vbuckets", "vbuckets whose stream was stopped because Kafka "
                                     "refused a record as too large (oversize_policy=fail)", registry=r)
        self.events_per_s = Gauge("dcpgw_events_per_second", "Records acknowledged per second (since the "
                                  "previous scrape)", registry=r)
        self.lag = Gauge("dcpgw_lag_items", "Sum over vbuckets of how far the partition is from the engine "
                         "(docs/gateway.md \"Lag\")",
                         registry=r)
        self.max_lag = Gauge("dcpgw_max_vbucket_lag_items", "Largest per-vbucket lag", registry=r)
        self.inflight = Gauge("dcpgw_inflight_records", "Records produced, not yet acknowledged", registry=r)
        self.ckpt_mem = Gauge("dcpgw_engine_checkpoint_memory_bytes", "Engine checkpoint memory", registry=r)
        self.items = Gauge("dcpgw_engine_items", "Live documents in the engine", registry=r)
        self.oldest_unacked = Gauge("dcpgw_oldest_unacked_record_age_seconds", "Age of the oldest record not yet "
                                    "acknowledged by Kafka (0: none)", registry=r)
        self.stalled = Gauge("dcpgw_stalled_vbuckets", "Vbuckets with records pending and no progress for "
                             "health_vbucket_stall_s", registry=r)
        self.unacked_bytes = Gauge("dcpgw_unacked_write_bytes", "Bytes of accepted writes not yet acknowledged "
                                   "by Kafka (writes answer 503 above max_unacked_bytes)", registry=r)
        self.truncations = Counter("dcpgw_topic_truncations", "Times the topic was found to have lost records "
                                   "Kafka had acknowledged (every vbucket republished from seqno 0)", registry=r)
        self.with_meta = Gauge("dcpgw_xdcr_target_writes", "Writes with meta (XDCR target) by result: accepted, "
                               "rejected_behind, rejected_identical (sum over the live engine buckets)", ["result"],
                               registry=r)
        self.cr_mode = Gauge("dcpgw_conflict_resolution_mode", "The bucket's conflict-resolution mode (label; "
                             "always 1)", ["mode"], registry=r)
        #: cluster mode: delta recoveries' rollback repair (docs/cluster.md "Rollback repair"), set at scrape time
        self.repaired = Gauge("dcpgw_rollback_repaired_documents", "Document versions a recovering node wrote back "
                              "to the actives before rolling back (rollback repair)", registry=r)
        self.superseded = Gauge("dcpgw_rollback_superseded_documents", "Document versions a recovering node "
                                "dropped because the active had changed the key since the rollback point",
                                registry=r)
        self.flush_failures = Gauge("dcpgw_engine_flush_failures", "Engine flushes (SQLite transactions) that "
                                    "failed since the engine's start, e.g. on a full disk", registry=r)
        self.flush_failing = Gauge("dcpgw_engine_flush_failing", "Engine buckets whose last flush failed (their "
                                   "writes are acknowledged in memory, not persisted, until one commits)",
                                   registry=r)
        self.writer_starts = Gauge("dcpgw_engine_storage_writer_starts", "Storage writer processes the engine "
                                   "started for its background flushes (more than one per bucket: one ended and "
                                   "was replaced)", registry=r)
        self._seen = {"records": 0, "acked": 0, "bytes": 0, "rollbacks": 0, "errors": 0, "filtered": 0,
                      "oversize": 0, "merged": 0}
        self._last = (time.monotonic(), 0)

    def new_publisher(self) -> None:
        """The service replaced its publisher (whose counts start at 0 again): count from there."""
        self._seen = dict.fromkeys(self._seen, 0)
        self._last = (time.monotonic(), 0)

    def collect_conflicts(self, mode: str, counts: dict[str, int]) -> None:
        """The XDCR target's writes with meta by result (docs/xdcr.md "Target side") and the bucket's mode."""
        self.cr_mode.labels(mode=mode).set(1)
        for result, n in counts.items():
            self.with_meta.labels(result=result).set(n)

    def collect_health(self, oldest_age: float, stalled: int, unacked_bytes: int) -> None:
        self.oldest_unacked.set(oldest_age)
        self.stalled.set(stalled)
        self.unacked_bytes.set(unacked_bytes)

    def collect_storage(self, failures: int, failing: int, writer_starts: int) -> None:
        """The engine buckets' flush failures (docs/reliability.md "Full disk on a node") and their storage
        writer processes (docs/engine.md "Background flush")."""
        self.flush_failures.set(failures)
        self.flush_failing.set(failing)
        self.writer_starts.set(writer_starts)

    def collect_recovery(self, repaired: int, superseded: int) -> None:
        self.repaired.set(repaired)
        self.superseded.set(superseded)

    def collect(self, pub: Publisher) -> None:
        for name, counter, value in (
            ("records", self.records, pub.records_sent),
            ("acked", self.acked, pub.records_acked),
            ("bytes", self.bytes, pub.bytes_sent),
            ("rollbacks", self.rollbacks, pub.rollbacks),
            ("errors", self.errors, pub.errors),
            ("filtered", self.filtered, pub.items_filtered),
            ("oversize", self.oversize, pub.oversize_records),
            ("merged", self.merged, pub.snapshots_merged),
        ):
            delta = value - self._seen[name]
            if delta > 0:
                counter.inc(delta)
                self._seen[name] = value
        now = time.monotonic()
        t0, a0 = self._last
        if now > t0:
            self.events_per_s.set((pub.records_acked - a0) / (now - t0))
        self._last = (now, pub.records_acked)
        total, worst = pub.lag()
        self.lag.set(total)
        self.max_lag.set(worst)
        self.inflight.set(pub.inflight)
        self.failed_vbuckets.set(len(pub.failed_vbuckets))
        self.ckpt_mem.set(pub.source.checkpoint_memory())
        self.items.set(pub.source.items())

    def render(self, pub: Publisher) -> bytes:
        self.collect(pub)
        return generate_latest(self.registry)
