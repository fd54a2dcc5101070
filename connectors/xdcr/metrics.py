"""The replicator's counters, per-vbucket positions and their HTTP / Prometheus exposition (docs/xdcr.md
"Status and metrics").

``GET /status`` (JSON, the same document ``dcpgw xdcr status`` prints) and ``GET /metrics`` (Prometheus
text) on ``--http-port``, served by a daemon thread (the replication loop is never blocked by it).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["LATENCY_BUCKETS", "Metrics", "StatusServer", "VBucketStatus", "prometheus_text"]

#: batch latency histogram bounds, seconds
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


@dataclass
class VBucketStatus:
    source_vbuuid: int = 0
    applied_seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    target_vbuuid: int = 0
    target_seqno: int = 0
    #: highest source seqno seen for the vbucket (applied or still buffered)
    seen_seqno: int = 0
    #: when the vbucket was last fully applied (its lag was 0), epoch seconds
    caught_up_at: float = 0.0
    written: int = 0

    def lag_seqnos(self) -> int:
        return max(0, self.seen_seqno - self.applied_seqno)

    def lag_seconds(self, now: float) -> float:
        return 0.0 if self.lag_seqnos() == 0 or not self.caught_up_at else max(0.0, now - self.caught_up_at)


@dataclass
class Metrics:
    written: int = 0
    #: rejected by the target's or the optimistic pre-check's conflict resolution, per reason
    rejected: dict[str, int] = field(default_factory=dict)
    filtered: int = 0
    batches: int = 0
    restored: int = 0
    rollbacks: int = 0
    rollbacks_from_zero: int = 0
    dead_letters: int = 0
    corrupt_records: int = 0
    get_meta: int = 0
    retries: int = 0
    not_my_vbucket: int = 0
    #: vbuckets resumed from an older checkpoint or zero because the target lost their history (a failover on
    #: the target, docs/xdcr.md "Checkpoints")
    target_history_lost: int = 0
    latency_sum: float = 0.0
    latency_max: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    target_state: str = "starting"
    target_error: str = ""

    def reject(self, reason: str, n: int = 1) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + n

    def batch(self, seconds: float) -> None:
        self.batches += 1
        self.latency_sum += seconds
        self.latency_max = max(self.latency_max, seconds)
        for i, b in enumerate(LATENCY_BUCKETS):
            if seconds <= b:
                self.latency_buckets[i] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"written": self.written, "rejected": dict(sorted(self.rejected.items())),
                "filtered": self.filtered, "batches": self.batches, "restored": self.restored,
                "rollbacks": self.rollbacks, "rollbacks_from_zero": self.rollbacks_from_zero,
                "dead_letters": self.dead_letters, "corrupt_records": self.corrupt_records,
                "get_meta": self.get_meta, "retries": self.retries, "not_my_vbucket": self.not_my_vbucket,
                "target_history_lost": self.target_history_lost,
                "batch_latency": {"count": self.batches, "sum": round(self.latency_sum, 6),
                                  "max": round(self.latency_max, 6),
                                  "buckets": dict(zip(map(str, LATENCY_BUCKETS), self.latency_buckets,
                                                      strict=True))},
                "target": {"state": self.target_state, "error": self.target_error}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Metrics:
        m = cls()
        for k in ("written", "filtered", "batches", "restored", "rollbacks", "rollbacks_from_zero",
                  "dead_letters", "corrupt_records", "get_meta", "retries", "not_my_vbucket",
                  "target_history_lost"):
            setattr(m, k, int(d.get(k, 0)))
        m.rejected = {str(k): int(v) for k, v in d.get("rejected", {}).items()}
        lat = d.get("batch_latency", {})
        m.latency_sum = float(lat.get("sum", 0.0))
        m.latency_max = float(lat.get("max", 0.0))
        b = lat.get("buckets", {})
        m.latency_buckets = [int(b.get(str(x), 0)) for x in LATENCY_BUCKETS]
        return m


def prometheus_text(status: dict[str, Any]) -> str:
    """Prometheus exposition of a status document (see :meth:`XdcrReplicator.status`)."""
    lines: list[str] = []
    c = status["counters"]

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP dcpgw_xdcr_{name} {help_}")
        lines.append(f"# TYPE dcpgw_xdcr_{name} {kind}")
        for labels, v in samples:
            lines.append(f"dcpgw_xdcr_{name}{labels} {v}")

    metric("docs_written_total", "counter", "Documents written to the target.", [("", c["written"])])
    metric("docs_rejected_total", "counter", "Documents not written, by reason.",
           [(f'{{reason="{r}"}}', n) for r, n in c["rejected"].items()] or [('{reason="none"}', 0)])
    metric("docs_filtered_total", "counter", "Changes the filters skipped.", [("", c["filtered"])])
    metric("docs_restored_total", "counter", "Target documents restored after a source rollback.",
           [("", c["restored"])])
    metric("rollbacks_total", "counter", "Source rollbacks crossed.", [("", c["rollbacks"])])
    metric("dead_letters_total", "counter", "Records and writes sent to the dead letter.",
           [("", c["dead_letters"])])
    metric("target_history_lost_total", "counter",
           "Times the target was found to have lost writes already sent (a failover on the target): resent.",
           [("", c.get("target_history_lost", 0))])
    lat = c["batch_latency"]
    lines.append("# HELP dcpgw_xdcr_batch_latency_seconds Time to write one batch to the target.")
    lines.append("# TYPE dcpgw_xdcr_batch_latency_seconds histogram")
    for b, n in lat["buckets"].items():
        lines.append(f'dcpgw_xdcr_batch_latency_seconds_bucket{{le="{b}"}} {n}')
    lines.append(f'dcpgw_xdcr_batch_latency_seconds_bucket{{le="+Inf"}} {lat["count"]}')
    lines.append(f"dcpgw_xdcr_batch_latency_seconds_sum {lat['sum']}")
    lines.append(f"dcpgw_xdcr_batch_latency_seconds_count {lat['count']}")
    metric("target_up", "gauge", "1 when the target answers.", [("", 1 if c["target"]["state"] == "ok" else 0)])
    vbs = status["vbuckets"]
    metric("vbucket_lag_seqnos", "gauge", "Source seqnos seen but not yet applied to the target.",
           [(f'{{vbucket="{vb}"}}', v["lag_seqnos"]) for vb, v in vbs.items()])
    metric("vbucket_lag_seconds", "gauge", "Seconds since the vbucket was last fully applied (0: caught up).",
           [(f'{{vbucket="{vb}"}}', v["lag_seconds"]) for vb, v in vbs.items()])
    metric("vbucket_applied_seqno", "gauge", "Last source seqno applied to the target.",
           [(f'{{vbucket="{vb}"}}', v["applied_seqno"]) for vb, v in vbs.items()])
    return "\n".join(lines) + "\n"


class StatusServer:
    """``/status`` and ``/metrics`` on ``host:port`` (0: a free port, see :attr:`port`)."""

    def __init__(self, status: Callable[[], dict[str, Any]], host: str = "127.0.0.1", port: int = 0) -> None:
        get = status

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/status":
                    body, ctype, code = json.dumps(get()).encode(), "application/json", 200
                elif path == "/metrics":
                    body, ctype, code = prometheus_text(get()).encode(), "text/plain; version=0.0.4", 200
                else:
                    body = json.dumps({"error": "not_found", "message": f"no route {path}"}).encode()
                    ctype, code = "application/json", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="xdcr-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
