"""The replicator's counters, per-vbucket positions and their HTTP / Prometheus exposition (docs/xdcr.md
"Status and metrics").

``GET /status`` (JSON, the same document ``dcpgw xdcr status`` prints) and ``GET /metrics`` (Prometheus
text) on ``--http-port``, served by a daemon thread (the replication loop is never blocked by it).
"""

from __future__ import annotations

import json
import threading
from collections import deque
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
    written: int = 0
    #: checkpoints kept for the vbucket (``checkpoints.py``)
    checkpoints: int = 0
    #: snapshots consumed (their marker read from the topic) and not yet applied, oldest first: (epoch seconds
    #: when the marker was consumed, the snapshot's end seqno)
    consumed: deque[tuple[float, int]] = field(default_factory=deque)

    def lag_seqnos(self) -> int:
        return max(0, self.seen_seqno - self.applied_seqno)

    def consumed_snapshot(self, at: float, snap_end: int) -> None:
        """A snapshot marker of the vbucket was consumed at ``at``."""
        self.consumed.append((at, snap_end))

    def applied_up_to(self, seqno: int) -> None:
        """Everything up to ``seqno`` is applied: the snapshots consumed up to it are no longer pending."""
        c = self.consumed
        while c and c[0][1] <= seqno:
            c.popleft()

    def lag_seconds(self, now: float) -> float:
        """The age of the oldest change consumed but not yet applied (its snapshot's marker consumed then); 0
        when caught up -- also right after a new change arrived at a vbucket that was idle."""
        if self.lag_seqnos() == 0:
            return 0.0
        try:
            oldest = self.consumed[0][0]  # (read from the HTTP thread while the replication thread runs)
        except IndexError:
            return 0.0
        return max(0.0, now - oldest)


@dataclass
class Metrics:
    written: int = 0
    #: not written, per reason: the target's conflict resolution (``rejected_behind`` / ``rejected_identical``,
    #: as the target counts them), its other refusals (``too_big``, ``target_<status>``), ``oversize_in_topic``
    rejected: dict[str, int] = field(default_factory=dict)
    #: never sent: the GET_META pre-check found the target's version winning (``behind``) or identical
    #: (``identical``); the target does not see (nor count) these
    skipped: dict[str, int] = field(default_factory=dict)
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

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def batch(self, seconds: float) -> None:
        self.batches += 1
        self.latency_sum += seconds
        self.latency_max = max(self.latency_max, seconds)
        for i, b in enumerate(LATENCY_BUCKETS):
            if seconds <= b:
                self.latency_buckets[i] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"written": self.written, "rejected": dict(sorted(self.rejected.items())),
                "skipped": dict(sorted(self.skipped.items())),
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
        m.skipped = {str(k): int(v) for k, v in d.get("skipped", {}).items()}
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
    metric("docs_rejected_total", "counter", "Documents sent and not written (the target refused them), by reason.",
           [(f'{{reason="{r}"}}', n) for r, n in c["rejected"].items()])
    metric("docs_skipped_total", "counter",
           "Documents never sent: the GET_META pre-check found the target's version winning or identical.",
           [(f'{{reason="{r}"}}', n) for r, n in c.get("skipped", {}).items()])
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
    metric("vbucket_lag_seconds", "gauge", "Age of the oldest change consumed but not yet applied (0: caught up).",
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
                    self._answer(200, json.dumps(get()).encode(), "application/json")
                elif path == "/metrics":
                    self._answer(200, prometheus_text(get()).encode(), "text/plain; version=0.0.4")
                else:
                    self._error(404, "not_found", f"no route {path}")

            def do_HEAD(self) -> None:
                self._refuse()

            def _refuse(self) -> None:
                """Any method but GET: 405 on the two routes (``Allow: GET``), 404 elsewhere; JSON either way."""
                self.close_connection = True  # a request body is left unread
                path = self.path.split("?")[0]
                if path in ("/status", "/metrics"):
                    self._error(405, "method_not_allowed", f"{self.command} {path}: only GET is served")
                else:
                    self._error(404, "not_found", f"no route {path}")

            def _error(self, code: int, error: str, message: str) -> None:
                self._answer(code, json.dumps({"error": error, "message": message}).encode(), "application/json")

            def _answer(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if code == 405:
                    self.send_header("Allow", "GET")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                # what http.server answers itself (501 for an unknown method, 400 for a malformed request): JSON
                # too; an unknown method on a route is a 405
                if code == 501:
                    self._refuse()
                    return
                self.close_connection = True
                self._error(code, "bad_request" if code == 400 else f"http_{code}", message or "")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="xdcr-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
