"""The XDCR replicator: a gateway topic into a target cluster, with meta (docs/xdcr.md).

:class:`XdcrReplicator` reads the topic with the rollback-aware client (``connectors.client``, as
``connectors.replicate`` does) and writes every change to the target with its source metadata (CAS, revision
seqno, flags, expiry, deletion) through SET/ADD/DEL_WITH_META, so the target runs conflict resolution.

* **Batches** of ``batch_docs`` documents / ``batch_bytes`` (goxdcr's ``workerBatchSize`` 500 and
  ``docBatchSizeKb`` 2048), one pipeline per target node, sent before the consumer commits the positions they
  cover (the state store's commit calls :meth:`XdcrReplicator._before_commit`): a crash re-sends, never skips.
* **Optimistic replication** (goxdcr ``optimisticReplicationThreshold``, 256 bytes): a document up to the
  threshold is sent straight away; a larger one only after GET_META showed the target would not reject it.
* **Source rollbacks -- beyond Couchbase.** The replicator keeps the source's history as applied, an
  append-only changelog per vbucket in seqno order (``connectors.client.changelog``, one row per snapshot), which
  plays the client's mutation log. A rollback instruction restores each key the lost branch changed to its
  version at the rollback point (looked up in the changelog then, never on the hot path), written with
  ``SKIP_CONFLICT_RESOLUTION`` (a key that did not exist gets a dominated tombstone: CAS 1, rev seqno 1), so
  the target converges to exactly the source. Couchbase's XDCR leaves the lost branch's writes on the target.
* **Checkpoints** per vbucket (``connectors.xdcr.checkpoints``), validated against the target's failover log
  on start.
* **Dead letter** (``dead-letter.jsonl`` in the state directory): corrupt records (also copied to the
  client's ``{topic}.dlq``), documents the target refused for size or another permanent status, documents
  Kafka refused as too large; replication goes on.
* **Target down / wrong credentials**: a clear one-line error, retried with exponential backoff, shown in the
  status (``counters.target.state``); ``give_up_after`` ends the attempt.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Self

from connectors.client.changelog import Changelog, pack_entry
from connectors.client.consumer import ChangeStreamConsumer, ClientEvent, RollbackInstruction
from connectors.client.mutation_log import DEFAULT_MAX_ENTRIES, LogTooShort, Prior
from connectors.client.replay import ConsumerPosition, Oversize, Snapshot
from connectors.client.state import SqliteStateStore
from connectors.exceptions import DecodeError
from connectors.xdcr.batch import Outcome, account
from connectors.xdcr.checkpoints import CheckpointStore
from connectors.xdcr.connection import Credentials
from connectors.xdcr.document import ConflictMode, DocVersion
from connectors.xdcr.errors import (
    ConflictModeMismatch,
    TargetAuthError,
    TargetHistoryLost,
    TargetUnreachable,
    XdcrError,
)
from connectors.xdcr.filters import Filters, settle_filter_change
from connectors.xdcr.mcbp import SKIP_CONFLICT_RESOLUTION_FLAG
from connectors.xdcr.metrics import Metrics, VBucketStatus
from connectors.xdcr.target import TargetCluster, TargetSpec, WriteOp, WriteResult
from connectors.xdcr.writer_process import Skipped, WriterProcess, transport
from schemas.records import RecordType
from schemas.topics import partition_for

__all__ = ["STATE_FILE", "XdcrReplicator", "XdcrSettings", "read_status", "status_document"]

log = logging.getLogger(__name__)

STATE_FILE = "xdcr.sqlite"
#: batches queued for the writer thread before the replication thread waits
INFLIGHT_BATCHES = 4
#: while the writer thread is still writing, the consumer's commits are deferred (its transaction goes on) for
#: at most this long since the last commit: the replication thread waits for the target once per interval, not
#: at every commit, and keeps decoding meanwhile (docs/xdcr.md "How a change travels"); a stream gone idle
#: (nothing within the client's poll timeout) commits at once
COMMIT_DEFER_SECONDS = 1.0
DEAD_LETTER_FILE = "dead-letter.jsonl"

#: part of the state file (tables of the consumer, changelog and checkpoints besides)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS xdcr_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)
"""


@dataclass(frozen=True)
class XdcrSettings:
    batch_docs: int = 500
    batch_bytes: int = 2 << 20
    optimistic_threshold: int = 256
    checkpoint_interval: float = 5.0
    checkpoints_per_vbucket: int = 5
    conflict_resolution: ConflictMode = ConflictMode.SEQNO
    filters: Filters = field(default_factory=Filters)
    #: the filters changed since the state directory was written: True restream from zero, False keep the
    #: positions (the new filters apply from there), None refuse to start
    restream: bool | None = None
    #: stop retrying an unreachable / refusing target after this many seconds (None: never)
    give_up_after: float | None = None
    retry_max_delay: float = 30.0
    mutation_log_max: int = DEFAULT_MAX_ENTRIES
    group_commit: int = 64
    dead_letter_topic: str | None = "{topic}.dlq"
    #: encode the writes and parse the target's answers in a process of its own (connectors.xdcr.writer_process)
    writer_process: bool = True


class _HookedStore(SqliteStateStore):
    """The client's SQLite store; every commit first runs the replicator's hook (send the pending batch,
    record target positions and checkpoints in the same transaction) -- unless ``defer`` leaves it to a later
    commit (the transaction goes on)."""

    hook: Callable[[], None] | None = None
    defer: Callable[[], bool] | None = None

    def flush(self) -> None:
        if self.hook is not None and not self._in_event:
            if self.defer is not None and self.defer():
                return
            self.hook()
        super().flush()


class _Consumer(ChangeStreamConsumer):
    """The client; ``on_idle`` is called whenever nothing arrived within its poll timeout (between events:
    a deferred commit is made then); ``on_marker(vbucket, snap_end)`` whenever it consumed a snapshot marker
    (``lag_seconds``: when the changes after it were consumed). Control records go through ``_handle``, data
    records do not: one call per snapshot, none per change."""

    on_idle: Callable[[], None] | None = None
    on_marker: Callable[[int, int], None] | None = None

    def _handle(self, m: Any) -> None:
        super()._handle(m)
        cb = self.on_marker
        if cb is not None:
            # (offset, vbucket, type, seqno, vbuuid, snap_end) of the record just handled
            t = self._tail.get(m.partition())
            if t is not None and t[0] == m.offset() and t[2] is RecordType.SNAPSHOT:
                cb(t[1], t[5])

    def _next_event(self, timeout: float) -> ClientEvent | None:
        ev = super()._next_event(timeout)
        if ev is None and self.on_idle is not None:
            self.on_idle()
        return ev


def _tombstone(key: bytes) -> DocVersion:
    """The version written for a key the source does not hold at a rollback point: a deletion every real
    version beats in both conflict-resolution modes (CAS 1, rev seqno 1)."""
    return DocVersion(key, 1, 1, 0, 0, True)


class XdcrReplicator:
    def __init__(self, kafka: str | Mapping[str, Any], topic: str, target: str, state_dir: str | Path, *,
                 user: str | None = None, password: str | None = None,
                 settings: XdcrSettings | None = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.settings = s = settings or XdcrSettings()
        self.topic = topic
        self._kafka = kafka
        self.clock = clock
        self._stop = threading.Event()
        self.sleep: Callable[[float], None] = sleep or self._wait
        self.state_dir = Path(state_dir)
        # bad input is refused before anything is created (no empty state directory left behind)
        spec = TargetSpec.parse(target)
        self.metrics = Metrics()
        self.vbs: dict[int, VBucketStatus] = {}
        self.target = TargetCluster(spec, Credentials(user, password), sleep=self.sleep)
        self._creds = Credentials(user, password)
        #: where the writer thread's requests go: the writer process, else ``target`` itself
        self._sink: TargetCluster | WriterProcess = self.target
        self._pending: dict[bytes, WriteOp] = {}
        self._pending_bytes = 0
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: deque[concurrent.futures.Future[Any]] = deque()
        self._inflight_ops: deque[list[WriteOp]] = deque()
        self._target_pos: dict[int, tuple[int, int]] = {}
        self._dirty: dict[int, ConsumerPosition] = {}
        self._last_ckpt: dict[int, float] = {}
        #: ``target`` is used by the writer thread (no writer process) and for the history checks of the
        #: replication thread (_holds): one at a time
        self._target_lock = threading.Lock()
        #: ``target``'s map refreshes already reported to _account (the writer thread's)
        self._map_seen = 0
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._dead = (self.state_dir / DEAD_LETTER_FILE).open("a", encoding="utf-8")
        self._committed_at = time.monotonic()
        self._deferred = False
        self._force_commit = False
        self.consumer: _Consumer | None = None
        self.store = _HookedStore(self.state_dir / STATE_FILE, topic)
        try:
            self.conn = self.store.conn
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    self.conn.execute(stmt)
            self.changelog = Changelog(self.conn, s.mutation_log_max)
            self._migrate_mirror()
            self.checkpoints = CheckpointStore(self.conn, s.checkpoints_per_vbucket, clock)
            prev = self._meta("metrics")
            if prev:
                self.metrics = Metrics.from_dict(json.loads(prev))
                self.metrics.target_state = "starting"
                self.metrics.target_error = ""
            self._save_meta("target", target)
            self._save_meta("topic", topic)
            self.target_url = target
        except BaseException:
            self.store.close()
            raise

    def _wait(self, seconds: float) -> None:
        self._stop.wait(seconds)

    # -------------------------------------------------------------------------------------- start-up
    def start(self) -> None:
        """Connect to the target (with retries), refuse a different conflict-resolution mode, settle the
        filters, validate the positions against the target's history, then open the consumer."""
        s = self.settings
        self._with_retries(self.target.connect, "connect")
        self._map_seen = self.target.map_refreshes
        mode = self.target.conflict_mode()
        if mode is not None and mode is not s.conflict_resolution:
            raise ConflictModeMismatch(
                f"the target bucket resolves conflicts by {mode.value}, the source by {s.conflict_resolution.value}: "
                "XDCR needs the same conflict-resolution mode on both buckets (as Couchbase refuses it)")
        if mode is None:
            log.warning("xdcr: the target does not report its conflict-resolution mode; assuming %s",
                        s.conflict_resolution.value)
        if s.writer_process and self._sink is self.target:
            self._sink = WriterProcess(self.target_url, self._creds, timeout=self.target.timeout,
                                       mode=s.conflict_resolution, threshold=s.optimistic_threshold)
        self._settle_filters()
        self._validate_positions()
        self.consumer = _Consumer(
            self._kafka, self.topic, state_store=self.store, prior_lookup=_no_priors,
            mutation_log_max=s.mutation_log_max, group_commit=s.group_commit,
            dead_letter=None if s.dead_letter_topic is None else s.dead_letter_topic.format(topic=self.topic))
        # the changelog plays the client's mutation log: it answers the undo lists from the versions the
        # replicator appended (the client's per-change prior look-ups and copies are not needed)
        self.consumer.mutation_log = self.changelog
        self._save_meta("partitions", str(len(self.consumer.assignment)))
        self.store.hook = self._before_commit
        self.store.defer = self._defer_commit
        self.consumer.on_idle = self._commit_deferred
        self.consumer.on_marker = self._marker
        written = {int(vb): int(n) for vb, n in json.loads(self._meta("vbucket_written") or "{}").items()}
        _load_vbuckets(self.vbs, self.store.load_all(), self.checkpoints.target_positions(),
                       CheckpointStore.counts(self.conn), written)

    def _with_retries(self, fn: Callable[[], Any], what: str) -> Any:
        delay = 0.1
        t0 = time.monotonic()
        while True:
            try:
                out = fn()
                if self.metrics.target_state != "ok":
                    if self.metrics.target_state not in ("starting",):
                        log.warning("xdcr: the target answers again")
                    self.metrics.target_state, self.metrics.target_error = "ok", ""
                return out
            except (TargetUnreachable, TargetAuthError) as e:
                state = "auth_failed" if isinstance(e, TargetAuthError) else "unreachable"
                if (state, str(e)) != (self.metrics.target_state, self.metrics.target_error):
                    log.error("xdcr: target %s: %s (retrying with backoff)", state.replace("_", " "), e)
                self.metrics.target_state, self.metrics.target_error = state, str(e)
                self.metrics.retries += 1
                if what == "connect":  # (the writer thread leaves the state file to the next commit)
                    self._save_metrics()
                self.target.close()
                if self._stop.is_set():
                    raise
                if self.settings.give_up_after is not None and time.monotonic() - t0 >= self.settings.give_up_after:
                    raise
                self.sleep(delay)
                if self._stop.is_set():
                    raise
                delay = min(delay * 2, self.settings.retry_max_delay)
                if what != "connect":
                    with contextlib.suppress(TargetUnreachable, TargetAuthError):
                        self.target.connect()

    def _settle_filters(self) -> None:
        fp = self.settings.filters.fingerprint()
        prev = self._meta("filters")
        has_state = self.conn.execute("SELECT 1 FROM dcp_consumer_state LIMIT 1").fetchone() is not None
        s = self.settings
        if settle_filter_change(prev, s.filters, has_state, s.restream, str(self.state_dir)):
            log.warning("xdcr: filters changed: restreaming every vbucket from zero")
            self._begin()
            for (vb,) in self.conn.execute("SELECT vbucket FROM dcp_consumer_state").fetchall():
                self._reset_vbucket(int(vb), None)
            self.conn.execute("DELETE FROM dcp_consumer_offsets")
            self._commit()
        self._save_meta("filters", fp)

    def _validate_positions(self) -> None:
        """Resume each vbucket only where the target still holds the history it was written into
        (checkpoints.py)."""
        positions = self.checkpoints.target_positions()
        states = self.store.load_all()
        nparts = int(self._meta("partitions") or 0)
        self._begin()
        try:
            for vb, st in sorted(states.items()):
                tp = positions.get(vb)
                if tp is None or tp[0] == 0:
                    continue
                held = self._with_retries(partial(self.target.holds, vb, *tp), "history check")
                if held is None:
                    log.warning("xdcr: the target tells neither OBSERVE_SEQNO nor its failover log: positions "
                                "not validated")
                    break
                if held:
                    continue
                back: ConsumerPosition | None = None
                for ck in self.checkpoints.list(vb):
                    if ck.source.seqno <= st.seqno and self._with_retries(
                            partial(self.target.holds, vb, ck.target_vbuuid, ck.target_seqno), "history check"):
                        back = ck.source
                        # the position the target holds; a write from its new branch is then no news
                        self.checkpoints.set_target_position(vb, ck.target_vbuuid, ck.target_seqno)
                        break
                self.metrics.target_history_lost += 1
                log.warning("xdcr: the target lost the history of vbucket %d (target position %s no longer held): "
                            "resuming from %s", vb, tp,
                            f"the checkpoint at seqno {back.seqno}" if back else "zero")
                self._reset_vbucket(vb, back, nparts)
        finally:
            self._commit()

    def _reset_vbucket(self, vb: int, back: ConsumerPosition | None, nparts: int = 0) -> None:
        if back is not None:
            # the changelog goes back with the position: its entries above the checkpoint go (the replay appends
            # them again), so a later rollback's undo finds true prior versions; below its floor (compacted past
            # the checkpoint) the vbucket is rebuilt from zero instead
            try:
                self.changelog.rewind(vb, back.seqno)
            except LogTooShort:
                back = None
        if back is None:
            self.conn.execute("DELETE FROM dcp_consumer_state WHERE topic = ? AND vbucket = ?", (self.topic, vb))
            self.changelog.clear(vb)
            self.changelog.cleared.pop(vb, None)
            self.checkpoints.drop(vb)
            new_offset = 0
        else:
            self.conn.execute("INSERT OR REPLACE INTO dcp_consumer_state VALUES (?, ?, ?)",
                              (self.topic, vb, back.to_json().decode()))
            new_offset = back.offset + 1
        if nparts:
            p = partition_for(vb, nparts)
            self.conn.execute("UPDATE dcp_consumer_offsets SET offset = min(offset, ?) WHERE topic = ? AND "
                              "partition = ?", (new_offset, self.topic, p))

    # ---------------------------------------------------------------------------------- state helpers
    def _begin(self) -> None:
        if not self.conn.in_transaction:
            self.conn.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("COMMIT")

    def _meta(self, name: str) -> str | None:
        row = self.conn.execute("SELECT value FROM xdcr_meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else str(row[0])

    def _save_meta(self, name: str, value: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO xdcr_meta VALUES (?, ?)", (name, value))

    def _save_metrics(self) -> None:
        try:
            self._save_meta("metrics", json.dumps(self.metrics.to_dict()))
            self._save_meta("vbucket_written", json.dumps({str(vb): v.written for vb, v in list(self.vbs.items())
                                                           if v.written}))
        except sqlite3.Error as e:
            log.warning("xdcr: cannot save the counters: %s", e)

    # ------------------------------------------------------------------------------ the client's events
    def _migrate_mirror(self) -> None:
        """A state file of the earlier layout (the source mirror ``xdcr_docs``: every key's newest version):
        each vbucket's changelog starts from it, its floor at the vbucket's position (a rollback below it
        rebuilds the vbucket from zero)."""
        if self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'xdcr_docs'").fetchone() is None:
            return
        self._begin()
        try:
            states = self.store.load_all()
            by_vb: dict[int, list[tuple[int, bytes, bytes]]] = {}
            for k, vb, sq, v in self.conn.execute("SELECT key, vbucket, seqno, version FROM xdcr_docs"):
                by_vb.setdefault(int(vb), []).append((int(sq), bytes(k), bytes(v)))
            for vb, rows in by_vb.items():
                st = states.get(vb)
                self.changelog.adopt(vb, max([r[0] for r in rows] + [st.seqno if st else 0]), rows)
            self.conn.execute("DROP TABLE xdcr_docs")
            for t in ("dcp_mutation_log", "dcp_mutation_log_floor"):  # the prior versions it no longer needs
                if self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (t,)).fetchone() is not None:
                    self.conn.execute(f"DELETE FROM {t}")
        finally:
            self._commit()

    def on_snapshot(self, snap: Snapshot) -> None:
        f = self.settings.filters
        rx = f.key_regex is not None
        filters = f.skip_deletions or f.skip_expirations or f.skip_binary or rx
        entries: list[bytes] = []
        vb = snap.vbucket
        queue = self._queue
        expiration = RecordType.EXPIRATION
        mutation = RecordType.MUTATION
        for ch in snap.changes:
            key = ch.key
            if rx and not f.passes_key(key):
                self.metrics.filtered += 1
                continue
            t = ch.type
            deleted = t is not mutation
            v = DocVersion(key, ch.cas, ch.rev_seqno, ch.flags, ch.expiry, deleted, ch.datatype,
                           None if deleted else ch.value)
            entries.append(pack_entry(ch.seqno, key, v.pack()))
            if filters and not f.passes(ch):
                self.metrics.filtered += 1
                continue
            queue(WriteOp(vb, v, expiration=t is expiration))
        if entries:
            self.changelog.append(vb, snap.changes[0].seqno, snap.changes[-1].seqno, entries)
        self._applied(vb, snap.state)

    def _applied(self, vb: int, state: ConsumerPosition | None) -> None:
        if state is None:
            return
        st = self.vbs.setdefault(vb, VBucketStatus())
        st.source_vbuuid, st.applied_seqno = state.vbuuid, state.seqno
        st.snap_start, st.snap_end = state.snap_start, state.snap_end
        st.seen_seqno = max(st.seen_seqno, state.seqno)
        st.applied_up_to(state.seqno)
        self._dirty[vb] = state.copy()

    def _marker(self, vb: int, snap_end: int) -> None:
        """The client consumed a snapshot marker of ``vb`` (its changes follow): pending from now until applied."""
        st = self.vbs.setdefault(vb, VBucketStatus())
        if snap_end > st.applied_seqno:
            st.consumed_snapshot(self.clock(), snap_end)

    def on_rollback(self, rb: RollbackInstruction) -> None:
        vb = rb.vbucket
        f = self.settings.filters
        self.metrics.rollbacks += 1
        # what was consumed of the lost branch will never be applied (feeding stopped at the rollback record)
        self.vbs.setdefault(vb, VBucketStatus()).consumed.clear()
        restored = 0
        if rb.rebuild_from_zero:
            self.metrics.rollbacks_from_zero += 1
            # the client cleared the changelog before handing the instruction out; it kept the keys
            for k in self.changelog.cleared.pop(vb, []):
                self._queue(WriteOp(vb, _tombstone(k), SKIP_CONFLICT_RESOLUTION_FLAG))
                restored += 1
        else:
            for u in rb.undo:
                if not f.passes_key(u.key):
                    continue
                if u.prior_value is None:
                    self._queue(WriteOp(vb, _tombstone(u.key), SKIP_CONFLICT_RESOLUTION_FLAG))
                else:
                    self._queue(WriteOp(vb, DocVersion.unpack(u.key, u.prior_value), SKIP_CONFLICT_RESOLUTION_FLAG))
                restored += 1
        self.metrics.restored += restored
        # a checkpoint of the lost branch cannot be resumed from (the undo just removed its changelog entries):
        # were the target to lose these restores, an older checkpoint replays the branch and this rollback again
        self.checkpoints.drop_after(vb, 0 if rb.rebuild_from_zero else rb.to_seqno)
        self.vbs[vb].checkpoints = self.checkpoints.count(vb)
        log.info("xdcr: vbucket %d rolled back to seqno %d: %d target document(s) restored%s", vb, rb.to_seqno,
                 restored, " (rebuilt from zero)" if rb.rebuild_from_zero else "")
        st = rb.rollback.state
        if st is not None:
            self._applied(vb, st)
            self.vbs[vb].seen_seqno = st.seqno

    def on_oversize(self, o: Oversize) -> None:
        self.metrics.reject("oversize_in_topic")
        self._dead_letter({"reason": "oversize_in_topic", "vbucket": o.vbucket, "seqno": o.seqno,
                           "key": o.key.decode("utf-8", "replace"), "size": o.size, "detail": o.reason})

    def on_corrupt(self, e: DecodeError) -> None:
        self.metrics.corrupt_records += 1
        self._dead_letter({"reason": "corrupt_record", "partition": e.partition, "offset": e.offset,
                           "detail": str(e)})
        log.warning("xdcr: corrupt record at %s[%d]@%d sent to the dead letter: %s", e.topic, e.partition,
                    e.offset, e)

    def _dead_letter(self, entry: dict[str, Any]) -> None:
        self.metrics.dead_letters += 1
        entry["at"] = self.clock()
        self._dead.write(json.dumps(entry) + "\n")
        self._dead.flush()

    # ---------------------------------------------------------------------------------------- batches
    def _queue(self, op: WriteOp) -> None:
        key = op.version.key
        old = self._pending.pop(key, None)
        if old is not None:
            op.options |= old.options & SKIP_CONFLICT_RESOLUTION_FLAG
        self._pending[key] = op
        self._pending_bytes += op.size
        if len(self._pending) >= self.settings.batch_docs or self._pending_bytes >= self.settings.batch_bytes:
            self._send()

    def _send(self, wait: bool = False) -> None:
        """Hand the pending batch to the writer (the writer process, pipelined, or the writer thread); ``wait``:
        until every batch handed over completed. Batches are written in order (a key's versions reach the target
        in order); up to ``INFLIGHT_BATCHES`` are outstanding, overlapping the target's round trips with the
        client's decoding and the changelog. Completed batches are counted here; a batch's error is raised
        here."""
        ops = list(self._pending.values())
        self._pending.clear()
        self._pending_bytes = 0
        if ops:
            if isinstance(self._sink, WriterProcess):
                fut = self._sink.submit(ops)
            else:
                if self._writer is None:
                    self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xdcr-writer")
                fut = self._writer.submit(self._write_in_thread, ops)
            self._inflight.append(fut)
            self._inflight_ops.append(ops)
        while self._inflight and (wait or len(self._inflight) > INFLIGHT_BATCHES or self._inflight[0].done()):
            fut, ops = self._inflight.popleft(), self._inflight_ops.popleft()
            try:
                out = fut.result()
            except (TargetUnreachable, TargetAuthError, Skipped):
                if not isinstance(self._sink, WriterProcess):
                    raise
                # the writer process stopped at this batch: it and every later one are written again, in order
                out = self._with_retries(partial(self._write_now, self._sink, ops), "write")
            self._account(ops, out)

    def _write_now(self, sink: WriterProcess, ops: list[WriteOp]) -> Outcome:
        sink.reset()
        return sink.submit(ops).result()

    def _join_inflight(self) -> None:
        while self._inflight:
            self._inflight_ops.popleft()
            self._inflight.popleft().result()

    def _drop_inflight(self) -> None:
        """Wait for every batch handed over, whatever its answer (it is not counted), and let the writer process
        write again (a failed batch left it skipping the later ones)."""
        while self._inflight:
            self._inflight_ops.popleft()
            with contextlib.suppress(Exception):
                self._inflight.popleft().result()
        if isinstance(self._sink, WriterProcess):
            with contextlib.suppress(Exception):
                self._sink.reset()

    def _write_in_thread(self, ops: list[WriteOp]) -> Outcome:
        with self._target_lock:
            out: Outcome = self._with_retries(partial(self._transport, ops), "write")
            # every map refresh since the last batch: reconnections (_with_retries) included
            out.map_refreshes = self.target.map_refreshes - self._map_seen
            self._map_seen = self.target.map_refreshes
        return out

    def _transport(self, ops: list[WriteOp]) -> Outcome:
        s = self.settings
        return transport(self.target, ops, s.conflict_resolution, s.optimistic_threshold, self.sleep)

    def _account(self, ops: list[WriteOp], out: Outcome) -> None:
        """Count a written batch (``batch.account``, docs/xdcr.md "Answers"). The writer's connection re-read the
        target's map meanwhile (a failover or rebalance on the target): every known target position is checked
        first (:meth:`_check_target_history`)."""
        if out.map_refreshes:
            if isinstance(self._sink, WriterProcess):  # this process's map follows the writer process's
                with self._target_lock:
                    self._with_retries(self.target.refresh_map, "history check")
            self._check_target_history()
        account(ops, out, self.metrics, dead_letter=self._dead_letter, on_written=self._written)

    def _written(self, o: WriteOp, r: WriteResult) -> None:
        self.vbs.setdefault(o.vbucket, VBucketStatus()).written += 1
        if r.token is not None and r.vbucket == o.vbucket:  # (same vbucket counts on both sides)
            prev = self._target_pos.get(o.vbucket)
            known = prev or self._committed_target_pos(o.vbucket)
            if known is not None and known[0] != r.token[0] and self._holds(o.vbucket, *known) is False:
                # a failover on the target lost writes sent before: start again from the newest checkpoint
                # it still holds (run() restarts, start() validates)
                raise TargetHistoryLost(o.vbucket, known, r.token)
            if prev is None or prev[0] != r.token[0] or r.token[1] > prev[1]:
                self._target_pos[o.vbucket] = r.token

    def _check_target_history(self) -> None:
        """The target's map changed (a failover or rebalance on the target): does it still hold every target
        position written? (A vbucket the replicator does not write again would otherwise only be checked at the
        next start.)"""
        known = {vb: (v.target_vbuuid, v.target_seqno) for vb, v in list(self.vbs.items()) if v.target_vbuuid}
        known.update(self._target_pos)
        for vb, pos in sorted(known.items()):
            if self._holds(vb, *pos) is False:
                raise TargetHistoryLost(vb, pos)

    def _holds(self, vb: int, vbuuid: int, seqno: int) -> bool | None:
        """``target.holds`` from the replication thread (the writer thread, if any, waits)."""
        with self._target_lock:
            held: bool | None = self._with_retries(partial(self.target.holds, vb, vbuuid, seqno), "history check")
        return held

    def _committed_target_pos(self, vb: int) -> tuple[int, int] | None:
        v = self.vbs.get(vb)
        return None if v is None or not v.target_vbuuid else (v.target_vbuuid, v.target_seqno)

    def _defer_commit(self) -> bool:
        """Leave this commit to a later one? While the writer thread still writes (``COMMIT_DEFER_SECONDS``)."""
        if (not self._force_commit and self._inflight and not self._inflight[-1].done()
                and time.monotonic() - self._committed_at < COMMIT_DEFER_SECONDS):
            self._deferred = True
            return True
        return False

    def _commit_deferred(self) -> None:
        """Make a deferred commit now (the stream is idle, or the run ends)."""
        if self._deferred:
            self._force_commit = True
            try:
                self.store.flush()
            finally:
                self._force_commit = False

    def _before_commit(self) -> None:
        """Runs before every commit of the consumer's transaction: what the positions cover reaches the
        target first; target positions, checkpoints and counters commit with them."""
        self._send(wait=True)
        self._deferred = False
        self._committed_at = time.monotonic()
        now = self.clock()
        for vb, tp in self._target_pos.items():
            self.checkpoints.set_target_position(vb, *tp)
            st = self.vbs.setdefault(vb, VBucketStatus())
            st.target_vbuuid, st.target_seqno = tp
        for vb, pos in self._dirty.items():
            if now - self._last_ckpt.get(vb, 0.0) >= self.settings.checkpoint_interval:
                tp = self._target_pos.get(vb) or (self.vbs[vb].target_vbuuid, self.vbs[vb].target_seqno)
                self.checkpoints.add(pos, *tp)
                self._last_ckpt[vb] = now
                self.vbs[vb].checkpoints = self.checkpoints.count(vb)
        self._target_pos.clear()
        self._dirty.clear()
        self._save_metrics()

    # ------------------------------------------------------------------------------------------- running
    def run(self, until_caught_up: bool = False) -> None:
        while True:
            if self.consumer is None:
                self.start()
            assert self.consumer is not None
            try:
                self.consumer.run(self.on_snapshot, self.on_rollback, until_caught_up=until_caught_up,
                                  on_error=self.on_corrupt, on_oversize=self.on_oversize)
                self._commit_deferred()
                return
            except TargetHistoryLost as e:
                # goxdcr restarts its pipeline when the target's topology changes; here the uncommitted
                # transaction is dropped and start() resumes every vbucket from a position the target holds
                log.warning("xdcr: %s: restarting from the target's history", e)
                self._abandon_transaction()
                self.consumer.close()
                self.consumer = None
                self.vbs.clear()  # start() reloads what the state holds after the validation

    def _abandon_transaction(self) -> None:
        """Drop what is pending or in flight (the writer process reset) and roll the consumer's transaction
        back, deferred commit included: no position commits beyond what reached the target."""
        self.store.hook = None
        self._pending.clear()
        self._pending_bytes = 0
        self._drop_inflight()
        self.store.rollback()
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
        self.changelog.forget_cached()
        self._target_pos.clear()
        self._dirty.clear()
        self._deferred = self._force_commit = False
        self._committed_at = time.monotonic()

    def stop(self) -> None:
        """Signal- and thread-safe: run() returns after the current event; retries give up."""
        self._stop.set()
        if self.consumer is not None:
            self.consumer.stop()

    def status(self) -> dict[str, Any]:
        now = self.clock()
        if self.consumer is not None:
            # what the client buffered but not yet handed out (its replayers' open snapshot ranges); read from
            # the HTTP thread while the replication thread runs: a dictionary that changed size is read next time
            with contextlib.suppress(RuntimeError):
                for vb, s in list(self.consumer._vbs.items()):
                    rng = getattr(s.replayer, "_range", None)
                    if rng is not None:
                        st = self.vbs.setdefault(vb, VBucketStatus())
                        st.seen_seqno = max(st.seen_seqno, rng[1])
        return status_document(self.topic, self.target_url, self.settings.filters.fingerprint(),
                               self.metrics.to_dict(), dict(list(self.vbs.items())), now)

    def close(self) -> None:
        self.stop()
        if self.consumer is not None:
            if self._pending or self._inflight:
                # positions must not commit beyond what reached the target
                self._abandon_transaction()
            self.consumer.close()
        self.store.hook = None
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._join_inflight()
            self._writer.shutdown(wait=True)
        try:
            self._save_metrics()
            self.store.close()
        finally:
            self.target.close()
            if isinstance(self._sink, WriterProcess):
                self._sink.close()
            self._dead.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_priors(vbucket: int, keys: Sequence[bytes]) -> dict[bytes, Prior]:
    """The consumer's prior look-up: nothing to look up (the changelog answers the undo lists itself)."""
    return {}


def status_document(topic: str | None, target: str | None, filters: str | None, counters: dict[str, Any],
                    vbs: Mapping[int, VBucketStatus], now: float) -> dict[str, Any]:
    """The status document -- ``GET /status`` (live, :meth:`XdcrReplicator.status`) and ``dcpgw xdcr status``
    (as last committed, :func:`read_status`) both: topic, target URL, filters, counters, per-vbucket positions."""
    return {"topic": topic, "target": target, "filters": json.loads(filters or "{}"), "counters": counters,
            "vbuckets": {str(vb): _vb_dict(v, now) for vb, v in sorted(vbs.items())}}


def _load_vbuckets(vbs: dict[int, VBucketStatus], states: Mapping[int, ConsumerPosition],
                   target_positions: Mapping[int, tuple[int, int]], checkpoints: Mapping[int, int],
                   written: Mapping[int, int]) -> None:
    """``vbs`` from what the state file holds (positions, target positions, checkpoint counts, writes)."""
    for vb, st in states.items():
        vbs[vb] = VBucketStatus(st.vbuuid, st.seqno, st.snap_start, st.snap_end, seen_seqno=st.seqno)
    for vb, (u, q) in target_positions.items():
        v = vbs.setdefault(vb, VBucketStatus())
        v.target_vbuuid, v.target_seqno = u, q
    for vb, n in checkpoints.items():
        vbs.setdefault(vb, VBucketStatus()).checkpoints = n
    for vb, n in written.items():
        vbs.setdefault(vb, VBucketStatus()).written = n


def _vb_dict(v: VBucketStatus, now: float) -> dict[str, Any]:
    return {"source_vbuuid": v.source_vbuuid, "applied_seqno": v.applied_seqno, "snap_start": v.snap_start,
            "snap_end": v.snap_end, "target_vbuuid": v.target_vbuuid, "target_seqno": v.target_seqno,
            "lag_seqnos": v.lag_seqnos(), "lag_seconds": round(v.lag_seconds(now), 3), "written": v.written,
            "checkpoints": v.checkpoints}


def read_status(state_dir: str | Path) -> dict[str, Any]:
    """The persisted status of a state directory (``dcpgw xdcr status``): per-vbucket positions, target
    positions, checkpoints and counters, as the replicator last committed them."""
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        raise XdcrError(f"no XDCR state in {state_dir} (no {STATE_FILE})")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(conn.execute("SELECT name, value FROM xdcr_meta").fetchall())
            states: dict[int, ConsumerPosition] = {}
            topic = meta.get("topic")
            for t, vb, st in conn.execute("SELECT topic, vbucket, state FROM dcp_consumer_state"):
                topic = t
                states[int(vb)] = ConsumerPosition.from_dict(json.loads(st))
            vbs: dict[int, VBucketStatus] = {}
            written = {int(vb): int(n) for vb, n in json.loads(meta.get("vbucket_written", "{}")).items()}
            _load_vbuckets(vbs, states, CheckpointStore.read_target_positions(conn), CheckpointStore.counts(conn),
                           written)
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise XdcrError(f"cannot read the XDCR state in {state_dir}: {e}") from e
    counters = Metrics.from_dict(json.loads(meta["metrics"])) if "metrics" in meta else Metrics()
    d = counters.to_dict()
    if "metrics" in meta:
        d["target"] = json.loads(meta["metrics"]).get("target", d["target"])
    return status_document(topic, meta.get("target"), meta.get("filters"), d, vbs, time.time())

