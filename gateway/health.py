"""Write backpressure and readiness of a gateway process (docs/reliability.md "Stalled broker and health").

:class:`UnackedWrites` counts the bytes of writes the HTTP API accepted whose record Kafka has not acknowledged
yet; above ``max_unacked_bytes`` the API answers writes 503 with ``Retry-After``. :class:`Readiness` turns the
publisher's and the engine's state into the reasons ``GET /health/ready`` answers 503 with.

Everything here runs on the event loop's thread and costs O(vbuckets) at most per call.
"""

from __future__ import annotations

import sqlite3
import time
from collections import deque
from typing import TYPE_CHECKING, Final

from confluent_kafka import KafkaError

from engine.exceptions import StorageError

if TYPE_CHECKING:
    from gateway.publisher import Publisher

#: what one accepted write is charged on top of its key and value bytes: the engine's per-item overhead
#: (engine.kv.item.ITEM_OVERHEAD is of the same order) and this module's own bookkeeping of the write
WRITE_OVERHEAD_BYTES: Final = 128


class UnackedWrites:
    """Bytes of accepted writes not yet acknowledged by Kafka, per vbucket.

    A write of vbucket ``vb`` answered with seqno ``s`` is *unacknowledged* while the publisher's acknowledged
    seqno of ``vb`` is below ``s`` (and the vbucket still has anything to publish). The count covers every place
    such a write lives in memory: the engine's checkpoints (not yet streamed), the DCP flow-control window and
    librdkafka's queue (streamed, not yet delivered). Writes that arrive while a vbucket's stream is behind
    are merged into one entry (released when the newest of them is acknowledged), so the bookkeeping stays
    small during a stall and the count is never below the truth.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        #: vbucket -> [[newest seqno, bytes]] in seqno order
        self._entries: dict[int, deque[list[int]]] = {}

    def over_limit(self) -> bool:
        return self.total >= self.limit

    def add(self, vb: int, seqno: int, nbytes: int, streamed_seqno: int) -> None:
        """Count a write the engine accepted; ``streamed_seqno``: the vbucket's seqno DCP has handed out."""
        nbytes += WRITE_OVERHEAD_BYTES
        self.total += nbytes
        q = self._entries.get(vb)
        if q is None:
            self._entries[vb] = deque([[seqno, nbytes]])
            return
        last = q[-1] if q else None
        if last is not None and last[0] > streamed_seqno and seqno >= last[0]:
            # the previous write is not streamed yet either: one entry for both
            last[0] = seqno
            last[1] += nbytes
        else:
            q.append([seqno, nbytes])

    def release(self, pub: Publisher) -> None:
        """Drop the writes the publisher has acknowledged (or that have nothing left to publish: a vbucket
        caught up, e.g. after a rollback removed them)."""
        if not self._entries:
            return
        acked = pub.acked
        src = pub.source
        done: list[int] = []
        for vb, q in self._entries.items():
            if vb not in pub.assigned:  # handed to another gateway process of the group (docs/scale-out.md)
                self.total -= sum(e[1] for e in q)
                q.clear()
                done.append(vb)
                continue
            a = acked[vb].seqno
            while q and q[0][0] <= a:
                self.total -= q.popleft()[1]
            if q and src.seqnos(vb)[0] <= a:
                self.total -= sum(e[1] for e in q)
                q.clear()
            if not q:
                done.append(vb)
        for vb in done:
            del self._entries[vb]
        if not self._entries:
            self.total = 0


class Readiness:
    """Why the process is not ready, from the publisher's state and what the service reports to it."""

    def __init__(self, delivery_stall_s: float, vbucket_stall_s: float) -> None:
        self.delivery_stall_s = delivery_stall_s
        self.vbucket_stall_s = vbucket_stall_s
        #: librdkafka's last "all brokers down" report (cleared by the next successful delivery / probe)
        self.broker_error: str | None = None
        #: the last failure of the pump or the flusher, as a reason (``storage_failed: ...`` for the engine's
        #: storage), cleared by the next successful round
        self.pump_error: str | None = None
        #: ``topic_truncated: ...`` from the moment the topic is found to have lost acknowledged records until
        #: every vbucket was republished (docs/reliability.md "Fault campaign")
        self.topic_truncated: str | None = None
        #: per vbucket: (acknowledged seqno seen last, monotonic time it last moved or started to lag)
        self._progress: dict[int, tuple[int, float]] = {}
        self.stalled: list[int] = []
        self._acked_at_error = -1

    # -------------------------------------------------------------- inputs
    def on_kafka_error(self, err: KafkaError) -> None:
        """librdkafka's error callback (runs inside ``poll`` on the loop thread)."""
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.broker_error = str(err)
            self._acked_at_error = -1  # set by the next observe()

    def on_pump_error(self, e: BaseException) -> None:
        kind = "storage_failed" if isinstance(e, StorageError | OSError | sqlite3.Error) else "pump_failed"
        self.pump_error = f"{kind}: {type(e).__name__}: {e}"

    def broker_reachable(self) -> None:
        """A probe (metadata request) answered: the broker is reachable again."""
        self.broker_error = None

    def observe(self, pub: Publisher, now: float | None = None) -> None:
        """Update the stalled-vbucket list: vbuckets with records pending (engine high seqno above the
        acknowledged seqno) whose acknowledged seqno has not moved for ``vbucket_stall_s``."""
        now = time.monotonic() if now is None else now
        src = pub.source
        acked = pub.acked
        progress = self._progress
        stalled: list[int] = []
        for vb in range(src.num_vbuckets):
            if vb not in pub.assigned and vb not in pub.observed:  # published by a process not observed
                progress.pop(vb, None)
                continue
            a = acked[vb].seqno
            if src.seqnos(vb)[0] <= a:
                progress.pop(vb, None)
                continue
            seen = progress.get(vb)
            if seen is None or seen[0] != a:
                progress[vb] = (a, now)
            elif now - seen[1] >= self.vbucket_stall_s:
                stalled.append(vb)
        self.stalled = stalled
        if self.broker_error is not None:
            # a record delivered after the report: the broker is back
            if self._acked_at_error < 0:
                self._acked_at_error = pub.records_acked
            elif pub.records_acked > self._acked_at_error:
                self.broker_error = None

    # -------------------------------------------------------------- the view
    def reasons(self, pub: Publisher | None, engine_up: bool, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        out: list[str] = []
        if pub is None:
            return ["starting: the publisher is not running yet"]
        if pub.error is not None:
            out.append(f"publish_failed: {pub.error}")
        if self.topic_truncated is not None:
            out.append(self.topic_truncated)
        if not engine_up:
            out.append("engine_down: no engine bucket is open")
        if self.pump_error is not None:
            out.append(self.pump_error)
        if self.broker_error is not None:
            out.append(f"broker_unreachable: {self.broker_error}")
        age = pub.oldest_unacked_age(now)
        if age >= self.delivery_stall_s:
            out.append(f"delivery_stalled: the oldest unacknowledged record was produced {age:.1f} s ago "
                       f"(threshold {self.delivery_stall_s:g} s)")
        if self.stalled:
            shown = ", ".join(str(vb) for vb in self.stalled[:10])
            more = f" and {len(self.stalled) - 10} more" if len(self.stalled) > 10 else ""
            out.append(f"vbuckets_stalled: {len(self.stalled)} vbucket(s) made no progress with records "
                       f"pending for {self.vbucket_stall_s:g} s ({shown}{more})")
        failed = getattr(pub, "failed_vbuckets", None)
        if failed:
            for vb, why in sorted(failed.items())[:10]:
                out.append(f"vbucket_failed: vbucket {vb}: {why}")
        return out
