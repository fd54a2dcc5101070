"""The rollback-aware Kafka client of a dcp-gateway topic (docs/client.md).

:class:`ChangeStreamConsumer` reads the partitions of a gateway topic, demultiplexes them by ``dcp.vbucket``
and runs every vbucket's records through a :class:`~connectors.client.replay.VBucketReplayer`. The application
sees three kinds of events:

* :class:`~connectors.client.replay.Snapshot`: a complete snapshot of one vbucket (never a partial one,
  unless ``per_record=True``);
* :class:`RollbackInstruction`: return the vbucket to its state at ``to_seqno`` -- the exact ``undo`` list
  from the mutation log, or ``rebuild_from_zero`` (wipe the vbucket; the consumer replays it from the start
  of its partition);
* :class:`PartialChange` (``per_record=True`` only): one data record before its snapshot completed.

A change Kafka refused as too large arrives as an oversize record (docs/record-format.md): it is never a change
of a snapshot; the snapshot lists it in ``Snapshot.oversize`` (:class:`~connectors.client.replay.Oversize`) and
:meth:`ChangeStreamConsumer.run` hands each to ``on_oversize``.

Every event is confirmed with :meth:`ChangeStreamConsumer.commit` (or by returning from the callback of
:meth:`ChangeStreamConsumer.run`): only then are the consumer state, the mutation log and the partition's
resume offset saved (one SQLite transaction) and the Kafka group offset committed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Self

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from connectors.client.mutation_log import DEFAULT_MAX_ENTRIES, LogTooShort, MutationLog, Prior, Undo
from connectors.client.rebuild import RebuildFold
from connectors.client.replay import Change, ConsumerPosition, Oversize, Rollback, Snapshot, VBucketReplayer
from connectors.client.state import MemoryStateStore, SqliteStateStore, StateStore
from connectors.exceptions import ConnectorError, DecodeError
from schemas.codec import decode, read_change, read_control
from schemas.errors import RecordFormatError

__all__ = ["DEFAULT_BATCH_SIZE", "FETCH_DEFAULTS", "GC_YOUNG_THRESHOLD", "ChangeStreamConsumer", "ClientEvent", "DeadLetter",
           "DeadLetterTopic",
           "PartialChange", "PriorLookup", "RollbackInstruction"]

log = logging.getLogger(__name__)


class _NotAboutConsumerProperties(logging.Filter):
    """Drops librdkafka's CONFWARN that a consumer property of the caller's configuration "will be ignored by
    this producer instance": the consumer's dead-letter producer and the AdminClient that creates its topic are
    given that configuration (its connection and security settings), and its consumer tuning does not concern
    them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is a consumer property and will be ignored" not in record.getMessage()


#: where librdkafka's lines of the consumer's dead-letter producer and AdminClient go (not raw to stderr)
_aux_log = logging.getLogger(f"{__name__}.librdkafka")
_aux_log.addFilter(_NotAboutConsumerProperties())

#: librdkafka fetch settings of the client unless the caller's config sets them (bench.client gives its raw
#: baseline consumer the same ones):
#:
#: * ``fetch.wait.max.ms``: partition EOF (caught_up) is only reported after an empty fetch: keep that wait short;
#: * ``fetch.max.bytes``: fetch responses of 1 MiB (librdkafka's minimum with the default ``message.max.bytes``)
#:   instead of 50 MiB: the application decodes one response while the broker prepares the next, instead of
#:   waiting for one huge response and then decoding it while the fetcher idles (docs/performance.md: twice the
#:   throughput from the embedded broker). A record larger than this is still returned, alone.
FETCH_DEFAULTS: Final[Mapping[str, Any]] = {"fetch.wait.max.ms": 100, "fetch.max.bytes": 1 << 20}
#: records taken from librdkafka at a time (bench.client gives its raw baseline consumer the same)
DEFAULT_BATCH_SIZE: Final = 2000
#: broker-connection errors after which the consumer checks where each partition resumes (docs/client.md)
_CONNECTION_LOST: Final = frozenset({KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT})
#: seconds between two checks, while no record arrives, that no assigned partition ends below the offset the
#: consumer reads it from (the broker lost its log, docs/client.md "The topic lost its log")
LOST_LOG_CHECK_INTERVAL: Final = 1.0
#: seconds to wait for the partitions' first offsets at a manual assignment (then librdkafka resolves them)
EARLIEST_TIMEOUT: Final = 5.0
#: CPython's young-generation GC threshold while :meth:`ChangeStreamConsumer.run` runs (at least; see there)
GC_YOUNG_THRESHOLD: Final = 50_000

#: ``prior_lookup(vbucket, keys)`` -> {key: (value, seqno)} of the keys that exist in the application now
PriorLookup = Callable[[int, Sequence[bytes]], Mapping[bytes, Prior]]


@dataclass(frozen=True, slots=True)
class RollbackInstruction:
    """Return ``vbucket`` to its state at ``to_seqno``.

    ``rebuild_from_zero`` False: restore every :class:`Undo` of ``undo`` (``prior_value`` None: delete the
    key). True: the mutation log does not reach back to ``to_seqno`` (or there is none): delete every document
    of the vbucket; the consumer then replays the vbucket from the start of its partition.
    """

    vbucket: int
    to_seqno: int
    undo: list[Undo]
    rebuild_from_zero: bool
    rollback: Rollback
    partition: int


@dataclass(frozen=True, slots=True)
class PartialChange:
    """``per_record=True``: one data record, exposed *before* its snapshot is complete (see docs/client.md:
    a prefix of a snapshot is not a consistent state; a rollback may take it back)."""

    change: Change
    partition: int

    @property
    def vbucket(self) -> int:
        return self.change.vbucket


ClientEvent = Snapshot | RollbackInstruction | PartialChange


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that could not be decoded, as handed to a dead-letter callback."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    error: str


class DeadLetterTopic:
    """The Kafka topic dead letters are copied to (docs/client.md "Corrupt records"): created on first use (one
    partition); each copy keeps the record's key, value and headers and adds ``dlq.topic``, ``dlq.partition``,
    ``dlq.offset``, ``dlq.error``, and is flushed before :meth:`copy` returns."""

    def __init__(self, client_conf: Mapping[str, Any], name: str) -> None:
        self.name = name
        self._conf = dict(client_conf)
        self._producer: Producer | None = None

    def copy(self, dl: DeadLetter) -> None:
        if self._producer is None:
            admin = AdminClient(self._conf)
            for f in admin.create_topics([NewTopic(self.name, num_partitions=1, replication_factor=1)]).values():
                try:
                    f.result(timeout=30)
                except KafkaException as ke:
                    if ke.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise ConnectorError(f"cannot create the dead-letter topic {self.name}: {ke}") from ke
            self._producer = Producer({**self._conf, "acks": "all"})
        headers: list[tuple[str, str | bytes | None]] = [
            *dl.headers, ("dlq.topic", dl.topic.encode()), ("dlq.partition", str(dl.partition).encode()),
            ("dlq.offset", str(dl.offset).encode()), ("dlq.error", dl.error.encode()[:1000])]
        self._producer.produce(self.name, key=dl.key, value=dl.value, headers=headers)
        if self._producer.flush(30) != 0:
            raise ConnectorError(f"could not copy {dl.topic}[{dl.partition}]@{dl.offset} to {self.name}")

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(10)


@dataclass(slots=True)
class _VB:
    replayer: VBucketReplayer
    partition: int
    #: records at or below this offset were already applied (state loaded from the store)
    skip_through: int
    #: offset of the state last confirmed (what the store holds)
    confirmed: int
    last_fed: int = -1
    #: while rebuilding from zero: the offset of the rollback that asked for it (the log is not trimmed)
    rebuild_until: int = -1
    #: while rebuilding from zero without a mutation log: the replay's events, folded (connectors/client/rebuild.py)
    fold: RebuildFold | None = None


@dataclass(slots=True)
class _Open:
    event: ClientEvent
    vbucket: int
    partition: int
    state: ConsumerPosition | None
    rebuild: bool = False


class ChangeStreamConsumer:
    """Consume a dcp-gateway topic as snapshot-atomic, rollback-aware events (docs/client.md).

    ``kafka``: bootstrap servers or a librdkafka config dict. ``group_id`` None: manual assignment of every
    partition; else a consumer group (eager ``range`` assignor). ``state_path``: the SQLite file of the
    default state store and mutation log (None: a memory store, nothing survives the process, no mutation
    log). ``state_store``: another :class:`~connectors.client.state.StateStore`. ``prior_lookup``: how the
    mutation log learns the application's prior versions (without it, every rollback that must undo
    something is a rebuild from zero). ``dead_letter``: a topic name (``{topic}`` is replaced), a callback
    taking a :class:`DeadLetter`, or None (no copy; :class:`DecodeError` is raised all the same).
    ``batch_size``: records taken from the Kafka client at a time. ``group_commit``: confirmed events per
    store transaction in :meth:`run` (the iterator APIs commit each event in :meth:`commit`).
    """

    def __init__(
        self,
        kafka: str | Mapping[str, Any],
        topic: str,
        *,
        group_id: str | None = None,
        state_path: str | Path | None = None,
        state_store: StateStore | None = None,
        per_record: bool = False,
        dead_letter: str | Callable[[DeadLetter], None] | None = "{topic}.dlq",
        prior_lookup: PriorLookup | None = None,
        mutation_log_max: int = DEFAULT_MAX_ENTRIES,
        batch_size: int = DEFAULT_BATCH_SIZE,
        poll_timeout: float = 0.2,
        group_commit: int = 64,
    ) -> None:
        self.topic = topic
        self.group_id = group_id
        self.per_record = per_record
        self.prior_lookup = prior_lookup
        self.poll_timeout = poll_timeout
        self._batch = batch_size
        _check_arguments(topic, state_path, state_store, dead_letter, mutation_log_max, batch_size, poll_timeout,
                         group_commit)
        self.group_commit = group_commit
        self._unflushed = 0
        self._unflushed_offsets: dict[int, int] = {}
        conf: dict[str, Any] = ({"bootstrap.servers": kafka} if isinstance(kafka, str) else dict(kafka))
        #: the AdminClient's and the dead-letter producer's configuration: the caller's, without the group and
        #: offset settings; its librdkafka lines to a Python logger that drops "consumer property ... ignored"
        self._client_conf = {k: v for k, v in conf.items() if not k.startswith(("group.", "enable.", "auto."))}
        if "logger" not in self._client_conf:
            self._client_conf["logger"] = _aux_log
        conf.update({"group.id": group_id or f"dcpgw-client-{uuid.uuid4().hex}", "enable.auto.commit": False,
                     "enable.partition.eof": True, "auto.offset.reset": "earliest"})
        for k, v in FETCH_DEFAULTS.items():
            conf.setdefault(k, v)
        if group_id is not None:
            conf.setdefault("partition.assignment.strategy", "range")
        user_error_cb = conf.get("error_cb")

        def on_error(err: KafkaError) -> None:
            # the connection to the brokers broke: when it is back, verify where each partition resumes
            # (docs/client.md "The topic lost its log")
            if err.code() in _CONNECTION_LOST:
                self._verify_pending = True
            if user_error_cb is not None:
                user_error_cb(err)

        conf["error_cb"] = on_error
        self._owns_store = state_store is None
        if state_store is not None:
            self.store: StateStore = state_store
        elif state_path is not None:
            self.store = SqliteStateStore(state_path, topic)
        else:
            self.store = MemoryStateStore()
        self.mutation_log: MutationLog | None = None
        if isinstance(self.store, SqliteStateStore):
            self.mutation_log = MutationLog(self.store.conn, mutation_log_max)
        if isinstance(dead_letter, str):
            self._dlq: DeadLetterTopic | None = self.dead_letter_topic(dead_letter)
            self._dlq_callback: Callable[[DeadLetter], None] | None = None
        else:
            self._dlq = None
            self._dlq_callback = dead_letter
        self._vbs: dict[int, _VB] = {}
        self._by_part: dict[int, dict[int, _VB]] = {}
        self._assigned: set[int] = set()
        self._eof: dict[int, bool] = {}
        #: partition -> the offset of the next record expected from it (-1: unknown, read from its start); a
        #: record below it, or a partition end (high watermark) below it, means the broker lost the log
        self._next: dict[int, int] = {}
        #: partitions whose log was lost and is read again from its start: the vbuckets of these partitions
        #: loaded from the store from then on ignore their stored offsets (docs/client.md "The topic lost its log")
        self._relogged: set[int] = set()
        self._next_lost_check = 0.0
        #: partition -> the identity of the last record fed from it: (offset, vbucket, type, seqno, vbuuid,
        #: snapshot end); after a lost broker connection the consumer reads that record again and compares
        self._tail: dict[int, tuple[Any, ...]] = {}
        #: partitions read again from their last record after a lost connection -> that record's identity
        self._verify: dict[int, tuple[Any, ...]] = {}
        self._verify_pending = False
        #: partitions found to have lost their log (the broker lost the topic; see docs/client.md)
        self.lost_logs = 0
        self._backlog: deque[Any] = deque()
        self._queue: deque[tuple[int, int, Snapshot | Rollback | PartialChange]] = deque()
        self._open: _Open | None = None
        #: a decode error met by :meth:`prefetch`: raised by the next event asked for (where it would have been)
        self._prefetch_error: DecodeError | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.records_consumed = 0
        self.dead_letters = 0
        #: oversize records in the snapshots handed out (changes Kafka refused as too large)
        self.oversize_records = 0
        self._stop = threading.Event()
        self._closed = False
        self.consumer = Consumer(conf)
        try:
            if group_id is None:
                md = self.consumer.list_topics(topic, timeout=30)
                t = md.topics.get(topic)
                if t is None or t.error is not None or not t.partitions:
                    raise ConnectorError(f"topic {topic!r} not found")
                self._assign(sorted(t.partitions))
            else:
                self.consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                        on_lost=self._on_revoke)
        except KafkaException as e:
            self.consumer.close()
            raise ConnectorError(f"cannot consume {topic!r}: {e}") from e

    # ------------------------------------------------------------------------------------- assignment
    def _start_offsets(self, parts: Sequence[int]) -> list[TopicPartition]:
        stored = self.store.partition_offsets()
        out = []
        for p in parts:
            o = stored.get(p)
            start = OFFSET_BEGINNING if o is None or o <= 0 else o
            self._next[p] = -1 if start == OFFSET_BEGINNING else start
            self._relogged.discard(p)
            out.append(TopicPartition(self.topic, p, start))
        return out

    def _earliest(self, tps: list[TopicPartition]) -> None:
        """Manual assignment: the partitions read from their start get their first offset, asked for in one
        request, instead of OFFSET_BEGINNING -- which librdkafka resolves itself, partition by partition: the first
        records of a topic of 1024 partitions arrived 0.3-0.45 s after the assignment instead of 0.15 s
        (docs/search.md "Performance"). The request is the consumer's own ``offsets_for_times`` at timestamp 0
        (the first offset whose record's timestamp is >= 0: the first record kept), not an AdminClient's
        ``list_offsets``: a new AdminClient per assignment crashed the process (SIGSEGV inside
        ``AdminClient.list_offsets``) about once per dozen test-suite runs (docs/client.md). Where the answer is
        missing or odd the partition keeps OFFSET_BEGINNING; a failed request leaves them all so. Nothing else
        changes: the consumer still treats them as read from their start (a log that starts later when it is
        fetched is reset to its start by librdkafka, as before)."""
        begin = [tp for tp in tps if tp.offset == OFFSET_BEGINNING]
        if not begin:
            return
        try:
            got = self.consumer.offsets_for_times([TopicPartition(self.topic, tp.partition, 0) for tp in begin],
                                                  timeout=EARLIEST_TIMEOUT)
        except (KafkaException, RuntimeError) as e:  # (a timeout, a broker without ListOffsets v1+)
            log.info("%s: the partitions' first offsets could not be asked for (%s): librdkafka resolves them",
                     self.topic, e)
            return
        first = {r.partition: r.offset for r in got if r.error is None}
        for tp in begin:
            o = first.get(tp.partition)
            if isinstance(o, int) and o >= 0:
                tp.offset = o

    def _assign(self, parts: Sequence[int]) -> None:
        tps = self._start_offsets(parts)
        self._earliest(tps)
        self.consumer.assign(tps)
        self._assigned = set(parts)
        self._eof = dict.fromkeys(parts, False)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        parts = [tp.partition for tp in partitions]
        tps = self._start_offsets(parts)
        consumer.assign(tps)
        self._assigned = set(parts)
        self._eof = dict.fromkeys(parts, False)
        log.info("assigned partitions %s of %s", parts, self.topic)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        parts = {tp.partition for tp in partitions}
        # What the application confirmed is committed before the partitions go (group commit), so the next
        # owner resumes after it; partial buffers are dropped: nothing partial is flushed.
        if self._open is None:
            with contextlib.suppress(ConnectorError):
                self.flush()
        for p in parts:
            for vb in self._by_part.pop(p, {}):
                self._vbs.pop(vb, None)
        self._backlog = deque(m for m in self._backlog if m.partition() not in parts)
        self._queue = deque(q for q in self._queue if q[1] not in parts)
        self._assigned -= parts
        for p in parts:
            self._eof.pop(p, None)
            self._next.pop(p, None)
            self._relogged.discard(p)
        with _suppress_kafka():
            consumer.unassign()
        log.info("revoked partitions %s of %s", sorted(parts), self.topic)

    @property
    def assignment(self) -> set[int]:
        return set(self._assigned)

    # ------------------------------------------------------------------------------------------ state
    def _vb(self, vb: int, partition: int, offset: int) -> _VB:
        s = self._vbs.get(vb)
        if s is None:
            st = self.store.load(vb)
            if st is not None and partition in self._relogged:
                # the partition lost its log: the stored offset is one of the lost log (docs/client.md)
                s = _VB(VBucketReplayer(st), partition, -1, -1)
            elif st is None:
                s = _VB(VBucketReplayer(ConsumerPosition(vb, offset=offset - 1)), partition, -1, offset - 1)
            else:
                s = _VB(VBucketReplayer(st), partition, st.offset, st.offset)
            self._vbs[vb] = s
            self._by_part.setdefault(partition, {})[vb] = s
        return s

    def caught_up(self) -> bool:
        """Every assigned partition reached its end (partition EOF) and no snapshot is pending."""
        if (not self._assigned or self._backlog or self._queue or self._open is not None
                or self._prefetch_error is not None):
            return False
        if not all(self._eof.get(p, False) for p in self._assigned):
            return False
        if any(s.replayer.has_partial for s in self._vbs.values()):
            return False
        # an end of partition seen before the broker lost the log is stale (Tansu sends no new one)
        return self._check_partition_ends() == 0

    # -------------------------------------------------------------------------------------- consuming
    def _fetch(self, timeout: float) -> bool:
        """Append what the consumer already fetched to the backlog, waiting up to ``timeout`` for the first
        record only; False when nothing came."""
        try:
            msgs = self.consumer.consume(self._batch, 0)
            if not msgs:
                first = self.consumer.poll(timeout)
                if first is None:
                    if time.monotonic() >= self._next_lost_check:
                        self._check_partition_ends()
                    return False
                msgs = [first, *self.consumer.consume(self._batch - 1, 0)] if self._batch > 1 else [first]
        except KafkaException as e:
            raise ConnectorError(f"consuming {self.topic!r} failed: {e}") from e
        if self._verify_pending and not self._backlog:
            self._reread_tails(msgs)  # the brokers answer again: what was just fetched is read again
            return True
        self._backlog.extend(msgs)
        return True

    def _feed_backlog(self) -> None:
        """Feed the backlog to the vbuckets' replayers, stopping after a record that produced a rollback (its
        confirmation may rewind the partition) or, in per-record mode, after any event.

        Hot path: a well-formed data record is decoded from its Avro value alone, straight into a
        :class:`Change` (``read_change``), and fed to its vbucket's replayer together with the records of the
        same vbucket next to it (``VBucketReplayer.feed_changes``); every other record goes through
        :meth:`_handle`: a well-formed Avro control record is decoded from its value alone (``read_control``),
        anything else (raw values, whatever the fast readers do not accept, errors) by the full, header-checking
        decoder.
        """
        backlog = self._backlog
        queue = self._queue
        if self.per_record:
            while backlog and not queue:
                self._handle(backlog.popleft())
            return
        read = read_change
        assigned = self._assigned
        eof = self._eof
        # A run: consecutive well-formed data records of one vbucket of one (assigned) partition, fed to its
        # replayer in one call when the run ends (another vbucket or partition, any other record, the end of
        # the backlog). The partition is checked and marked not at EOF once per run (an EOF only comes through
        # _handle, which ends the run).
        run: list[Change] = []
        add = run.append
        run_vb = run_p = -1
        done = 0  # records taken from the backlog (those of an unfed run go back if an exception escapes)
        try:
            for m in backlog:
                done += 1
                if m.error() is None:
                    v = m.value()
                    ch = read(v, m.offset(), Change) if v is not None else None
                    if ch is not None:
                        # fields by index: 3 vbucket (see Change)
                        if ch[3] == run_vb and m.partition() == run_p:
                            add(ch)
                            continue
                        if run:
                            fed, run = run, []
                            add = run.append
                            self._feed_run(run_vb, run_p, fed)
                        p = m.partition()
                        if p not in assigned:
                            run_vb = -1
                            continue
                        eof[p] = False
                        run_vb = ch[3]
                        run_p = p
                        add(ch)
                        continue
                if run:
                    fed, run = run, []
                    add = run.append
                    self._feed_run(run_vb, run_p, fed)
                run_vb = -1
                self._handle(m)
                if queue and queue[-1][2].__class__ is Rollback:
                    break
            if run:
                fed, run = run, []
                self._feed_run(run_vb, run_p, fed)
        finally:
            done -= len(run)
            if done == len(backlog):
                backlog.clear()
            else:
                for _ in range(done):
                    backlog.popleft()

    def _feed_run(self, vb: int, p: int, run: list[Change]) -> None:
        """Feed a run of ``vb``'s data records (partition ``p``, ascending offsets) to its replayer."""
        if self._verify and p in self._verify:
            head = run[0]
            if not self._reread(p, (head.offset, vb, head.type, head.seqno, head.vbuuid, -1)):
                return  # the partition lost its log: read again from its start
            run = run[1:]  # the record read again: already fed
            if not run:
                return
        self.records_consumed += len(run)
        nxt = self._next
        first = run[0][11]  # Change.offset
        if first < nxt.get(p, -1):
            self._lost_log(p, nxt[p], first, seek=False)
        last = run[-1]
        nxt[p] = last[11] + 1
        self._tail[p] = (last[11], vb, last[0], last[5], last[4], -1)
        s = self._vbs.get(vb)
        if s is None:
            s = self._vb(vb, p, run[0][11])  # Change.offset
        skip = s.skip_through
        if run[0][11] <= skip:  # records already applied (state loaded from the store, or a rewind)
            run = [ch for ch in run if ch[11] > skip]
            if not run:
                return
        s.last_fed = run[-1][11]
        snaps = s.replayer.feed_changes(run)
        if s.fold is not None:
            self._fold(s, vb, p, snaps)
            return
        for snap in snaps:
            self._queue.append((vb, p, snap))

    def _fold(self, s: _VB, vb: int, p: int, events: Sequence[Snapshot | Rollback]) -> None:
        """A rebuild from zero without a mutation log: the replay's events are folded until it passes the record
        where the rebuild was asked for; then one snapshot of what survived is queued (connectors/client/rebuild.py)."""
        fold = s.fold
        assert fold is not None
        for ev in events:
            fold.add(ev)
        if s.last_fed >= fold.until:
            s.fold = None
            snap = fold.snapshot(vb, s.replayer.state)
            if self.per_record:  # its changes one by one, then the boundary (as a per-record consumer sees any)
                self._queue.extend((vb, p, PartialChange(c, p)) for c in snap.changes)
            self._queue.append((vb, p, snap))

    def _handle(self, m: Any) -> None:
        p = m.partition()
        err = m.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                self._eof[p] = True
                return
            if err.retriable() or not err.fatal():
                log.warning("consumer error on %s: %s", self.topic, err)
                return
            raise ConnectorError(f"consuming {self.topic!r} failed: {err}")
        if p not in self._assigned:
            return
        self._eof[p] = False
        off = m.offset()
        self.records_consumed += 1
        nxt = self._next
        if off < nxt.get(p, -1):
            self._lost_log(p, nxt[p], off, seek=False)
        nxt[p] = off + 1
        try:
            # control records (snapshot markers, failover logs) from their value alone when it is well formed;
            # anything else -- and every record read_control does not accept -- through the full decoder
            v = m.value()
            rec = read_control(v) if v.__class__ is bytes and m.key() is None else None
            if rec is None:
                rec = decode(m.key(), v, m.headers())
        except RecordFormatError as e:
            self._dead_letter(m, e)
            raise DecodeError(f"{self.topic}[{p}]@{off}: {record_problem(e)} (copied to the dead-letter destination)",
                              self.topic, p, off) from e
        ident = (off, rec.vbucket, rec.type, rec.seqno, rec.vbuuid, -1 if rec.key is not None else rec.snap_end)
        if self._verify and p in self._verify:
            self._reread(p, ident)
            return  # the record read again (already handled), or a lost log read again from its start
        self._tail[p] = ident
        s = self._vb(rec.vbucket, p, off)
        if off <= s.skip_through:
            return
        s.last_fed = off
        before = s.replayer.accepted
        events = s.replayer.feed(rec, off)
        if s.fold is not None:
            self._fold(s, rec.vbucket, p, events)
            return
        if self.per_record and s.replayer.accepted != before and s.replayer.last_change is not None:
            self._queue.append((rec.vbucket, p, PartialChange(s.replayer.last_change, p)))
        for ev in events:
            self._queue.append((rec.vbucket, p, ev))

    def _dead_letter(self, m: Any, e: Exception) -> None:
        self.dead_letters += 1
        headers: list[tuple[str, bytes]] = [(str(k), v if isinstance(v, bytes) else b"" if v is None else str(v).encode())
                   for k, v in (m.headers() or [])]
        dl = DeadLetter(self.topic, m.partition(), m.offset(), m.key(), m.value(), headers, str(e))
        if self._dlq_callback is not None:
            self._dlq_callback(dl)
        elif self._dlq is not None:
            self._dlq.copy(dl)

    def dead_letter_topic(self, pattern: str) -> DeadLetterTopic:
        """The dead-letter topic ``pattern`` names (``{topic}`` replaced by this consumer's topic), reached with
        this consumer's connection settings; a :class:`ConnectorError` when the pattern is not one."""
        return DeadLetterTopic(self._client_conf, _dlq_topic_name(pattern, self.topic))

    def prefetch(self, timeout: float = 0.0) -> bool:
        """Fetch what the Kafka client has (waiting up to ``timeout`` for the first record) and decode it into
        the vbuckets' replayers and the queue of complete events -- the work the next events start with --
        without opening an event: nothing is applied, saved or committed (an application that is still starting
        -- the search indexer waiting for its writer process -- does it meanwhile). Returns False when it cannot
        go on before the queued events are applied: a rollback is queued (its confirmation may rewind its
        partition), a record failed to decode (its :class:`DecodeError` is raised by the next event asked for,
        where it would have been raised without the prefetch), an event is open, or ``per_record``; True
        otherwise (whether or not something arrived)."""
        queue = self._queue
        if (self.per_record or self._prefetch_error is not None or self._open is not None or self._backlog
                or (queue and queue[-1][2].__class__ is Rollback)):
            return False
        if not self._fetch(timeout):
            return True
        try:
            self._feed_backlog()
        except DecodeError as e:
            self._prefetch_error = e
            return False
        return not self._backlog

    def _next_event(self, timeout: float) -> ClientEvent | None:
        """The next event, opened (its transaction begun); None when nothing arrived within ``timeout``."""
        if self._prefetch_error is not None:
            e, self._prefetch_error = self._prefetch_error, None
            raise e
        while True:
            if self._queue:
                vb, p, ev = self._queue.popleft()
                return self._begin(vb, p, ev)
            if not self._backlog and not self._fetch(timeout):
                return None
            self._feed_backlog()

    def _begin(self, vb: int, p: int, ev: Snapshot | Rollback | PartialChange) -> ClientEvent:
        self.store.begin()
        mlog = self.mutation_log if self.prior_lookup is not None else None
        try:
            if isinstance(ev, Rollback):
                rebuild = False
                undo: list[Undo] = []
                if mlog is None:
                    rebuild = True
                else:
                    try:
                        undo = mlog.undo_to(vb, ev.restart_seqno)
                    except LogTooShort:
                        rebuild = True
                if rebuild and self.mutation_log is not None:
                    self.mutation_log.clear(vb)
                out: ClientEvent = RollbackInstruction(vb, 0 if rebuild else ev.restart_seqno, undo, rebuild, ev, p)
                self._open = _Open(out, vb, p, ev.state, rebuild)
                return out
            if isinstance(ev, PartialChange):
                if mlog is not None and self.prior_lookup is not None and mlog.records_priors:
                    c = ev.change
                    mlog.record(vb, [(c.seqno, c.key)], self.prior_lookup(vb, [c.key]))
                self._open = _Open(ev, vb, p, None)
                return ev
            if mlog is not None and self.prior_lookup is not None and ev.changes and mlog.records_priors:
                keys = list(dict.fromkeys(c.key for c in ev.changes))
                mlog.record(vb, [(c.seqno, c.key) for c in ev.changes], self.prior_lookup(vb, keys))
            self.oversize_records += len(ev.oversize)
            if self.per_record:
                ev = dataclasses.replace(ev, changes=())
            self._open = _Open(ev, vb, p, ev.state)
            return ev
        except BaseException:
            self.store.rollback()
            raise

    # -------------------------------------------------------------------------------------- confirming
    def commit(self, ev: ClientEvent) -> None:
        """Confirm that the application applied ``ev``: saves the consumer state (and the mutation log) in
        the store's transaction and commits it, then commits the Kafka group offset of its partition."""
        self._confirm(ev, durable=True)

    def flush(self) -> None:
        """Commit the events confirmed so far (the callback API groups up to ``group_commit`` of them per
        transaction), then their Kafka group offsets."""
        self.store.flush()
        self._unflushed = 0
        offsets = self._unflushed_offsets
        if self.group_id is not None and offsets:
            with _suppress_kafka():
                self.consumer.commit(offsets=[TopicPartition(self.topic, q, o) for q, o in offsets.items()],
                                     asynchronous=True)
        offsets.clear()

    def _confirm(self, ev: ClientEvent, durable: bool) -> None:
        op = self._open
        if op is None or op.event is not ev:
            raise ConnectorError("commit(ev): ev is not the event being applied (commit each event once, "
                                 "in order)")
        self._open = None
        p = op.partition
        states: list[ConsumerPosition] = []
        s = self._vbs.get(op.vbucket)
        if s is None:  # revoked meanwhile: nothing to save
            self.store.rollback()
            return
        if op.rebuild:
            fresh = ConsumerPosition(op.vbucket)
            if op.state is not None and op.state.applied_seqno == 0 and op.state.offset >= 0:
                # rolled back to zero by the gateway itself: it republishes everything after this record
                fresh = op.state.copy()
                s.confirmed = fresh.offset
            else:
                s.replayer = VBucketReplayer(fresh)
                s.skip_through = -1
                s.confirmed = -1
                s.rebuild_until = s.last_fed
                if self.mutation_log is None or self.prior_lookup is None:
                    # nothing can undo the rollbacks the replay meets again: fold them (connectors/client/rebuild.py)
                    s.fold = RebuildFold(s.last_fed)
                self._rewind(p, op.vbucket)
            states.append(fresh)
        elif op.state is not None:
            states.append(op.state)
            s.confirmed = op.state.offset
        part = self._by_part.get(p, {})
        if (op.state is not None or op.rebuild) and len(part) > 1:
            queued = {q[0] for q in self._queue}
            for vb, o in part.items():
                if (vb != op.vbucket and vb not in queued and not o.replayer.has_partial
                        and o.replayer.state.offset == o.last_fed and o.last_fed > o.confirmed):
                    states.append(o.replayer.state.copy())
                    o.confirmed = o.last_fed
        offsets: dict[int, int] = {}
        if states:
            offsets[p] = min(o.confirmed + 1 for o in part.values())
            if self.mutation_log is not None and s.last_fed > s.rebuild_until:
                self.mutation_log.trim(op.vbucket)
        self.store.save(states, offsets, durable=durable)
        self._unflushed += 1
        self._unflushed_offsets.update(offsets)
        if durable:
            self.flush()

    def _rewind(self, p: int, vb: int) -> None:
        """Replay partition ``p`` from its start for ``vb`` (rebuild from zero); the other vbuckets of the
        partition skip what they already consumed."""
        for other, o in self._by_part.get(p, {}).items():
            if other != vb:
                o.skip_through = max(o.skip_through, o.last_fed)
        self._queue = deque(q for q in self._queue if q[1] != p)
        self._seek_start(p)

    def _seek_start(self, p: int) -> None:
        """Read partition ``p`` again from its start (what was fetched of it and not fed yet is dropped)."""
        self._backlog = deque(m for m in self._backlog if m.partition() != p)
        self._eof[p] = False
        self._next[p] = -1
        try:
            self.consumer.seek(TopicPartition(self.topic, p, OFFSET_BEGINNING))
        except KafkaException:
            # seek needs a fetch position: re-assign the partition at its start instead
            self.consumer.incremental_unassign([TopicPartition(self.topic, p)])
            self.consumer.incremental_assign([TopicPartition(self.topic, p, OFFSET_BEGINNING)])

    # --------------------------------------------------------------------------------- lost partition log
    def _check_partition_ends(self) -> int:
        """While no record arrives (never on the hot path): a partition whose end -- the high watermark the
        last fetch response carried -- is below the offset the consumer reads it from lost its log. (Apache
        Kafka answers such a fetch with OFFSET_OUT_OF_RANGE and the consumer restarts at the partition's start:
        the first record then arrives below the expected offset, see :meth:`_lost_log`; Tansu answers with
        empty fetches, docs/kafka-compat.md.) ListOffsets is not asked: Tansu's answer is stale. Returns how many
        partitions lost their log."""
        self._next_lost_check = time.monotonic() + LOST_LOG_CHECK_INTERVAL
        lost = 0
        for p in sorted(self._assigned):
            expected = self._next.get(p, -1)
            if expected <= 0:
                continue
            try:
                wm = self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), cached=True)
            except KafkaException:
                continue
            if wm is None:
                continue
            end = wm[1]
            if p in self._verify:
                expected += 1  # the record at `expected` is being read again: it must still be there
            if 0 <= end < expected:
                self._lost_log(p, expected, end, seek=True)
                lost += 1
        return lost

    def _reread_tails(self, dropped: Sequence[Any]) -> None:
        """After the connection to the brokers was lost and is back: read the last record fed from each
        partition again (:meth:`_reread` compares it); ``dropped`` (just fetched, not fed) is fetched again.
        A broker that lost the topic while the gateway republished it past this consumer's offset shows no
        other sign (docs/client.md "The topic lost its log")."""
        self._verify_pending = False
        first: dict[int, int] = {}
        for m in dropped:
            if m.error() is None:
                first.setdefault(m.partition(), m.offset())
        for p in sorted(self._assigned):
            t = self._tail.get(p)
            if t is not None and self._next.get(p, -1) == t[0] + 1:
                self._verify[p] = t
                self._next[p] = at = t[0]
            elif p in first:
                at = first[p]
            else:
                continue  # nothing fed nor fetched: the consumer goes on where it is
            self._eof[p] = False
            try:
                self.consumer.seek(TopicPartition(self.topic, p, at))
            except KafkaException:
                self.consumer.incremental_unassign([TopicPartition(self.topic, p)])
                self.consumer.incremental_assign([TopicPartition(self.topic, p, at)])
        if self._verify:
            log.info("%s: the brokers' connection was lost and is back: reading the last record of %d "
                     "partition(s) again to check their logs", self.topic, len(self._verify))

    def _reread(self, p: int, ident: tuple[Any, ...]) -> bool:
        """The first record of partition ``p`` after :meth:`_reread_tails`: True if it is the record fed
        last (the log is the one this consumer read), else the partition lost its log (False)."""
        expected = self._verify.pop(p)
        if ident == expected:
            self._next[p] = expected[0] + 1
            return True
        log.warning("%s[%d]: offset %d holds another record than the one read there before the connection "
                    "was lost", self.topic, p, expected[0])
        self._lost_log(p, expected[0] + 1, ident[0], seek=True)
        return False

    def _lost_log(self, p: int, expected: int, found: int, *, seek: bool) -> None:
        """Partition ``p`` lost its log (the broker lost the topic; the gateway recreated it and republished
        every vbucket from seqno 0 behind a rollback record to 0): forget the offsets of the lost log -- the
        stored ones included -- and read the partition from its start, so that the rollback records take the
        vbuckets back to zero and the republished history rebuilds them (docs/client.md "The topic lost its
        log"). The replayers keep their state: a rollback record to 0 then yields a rollback."""
        log.warning("%s[%d]: the partition's log is lost (%s offset %d, below offset %d where this consumer "
                    "resumes it): the broker lost the topic; reading the partition again from its start",
                    self.topic, p, "it ends at" if seek else "a record arrived at", found, expected)
        self.lost_logs += 1
        self._relogged.add(p)
        self._verify.pop(p, None)
        self._tail.pop(p, None)
        for s in self._by_part.get(p, {}).values():
            s.skip_through = -1
            s.confirmed = -1
            s.last_fed = -1
            s.rebuild_until = -1
            s.fold = None
        self._next[p] = -1
        if seek:
            self._seek_start(p)

    def abandon(self) -> None:
        """Give up the event being applied (the application failed): nothing is saved; the consumer must be
        closed and recreated to see the event again."""
        self._open = None
        self.store.rollback()

    # -------------------------------------------------------------------------------------------- APIs
    def events(self, *, until_caught_up: bool = False) -> Iterator[ClientEvent]:
        """Events in order; ``commit(ev)`` each one before asking for the next. Stops when
        ``until_caught_up`` and :meth:`caught_up`. A :class:`DecodeError` ends the iteration; calling
        ``events()`` again continues after the bad record."""
        while True:
            if self._open is not None:
                raise ConnectorError("commit(ev) the previous event before asking for the next one")
            if self._stop.is_set():
                self._stop.clear()
                return
            if until_caught_up and not self._queue and not self._backlog and self.caught_up():
                return
            ev = self._next_event(self.poll_timeout)
            if ev is None:
                continue
            yield ev

    async def aevents(self, *, until_caught_up: bool = False) -> AsyncIterator[ClientEvent]:
        """``async for ev in consumer.aevents(): ...; consumer.commit(ev)`` -- Kafka polling runs in a
        worker thread, the event loop is never blocked by it."""
        loop = asyncio.get_running_loop()
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcpgw-client")
        while True:
            if self._open is not None:
                raise ConnectorError("commit(ev) the previous event before asking for the next one")
            if self._stop.is_set():
                self._stop.clear()
                return
            if until_caught_up and not self._queue and not self._backlog and self.caught_up():
                return
            ev = await loop.run_in_executor(self._executor, self._next_event, self.poll_timeout)
            if ev is not None:
                yield ev

    def run(
        self,
        on_snapshot: Callable[[Snapshot], None],
        on_rollback: Callable[[RollbackInstruction], None],
        *,
        until_caught_up: bool = True,
        on_change: Callable[[PartialChange], None] | None = None,
        on_error: Callable[[DecodeError], None] | None = None,
        on_oversize: Callable[[Oversize], None] | None = None,
    ) -> None:
        """Callback API: each event is confirmed when its callback returns; confirmed events are committed
        in groups of up to ``group_commit`` per store transaction (and always before the consumer waits for
        records, and when ``run`` returns or raises), so a crash redelivers at most the last group -- exactly
        once for applications that write into the state store's transaction (``store.conn``), whose writes
        roll back with it. A :class:`DecodeError` goes to ``on_error`` (then consumption continues) or,
        without it, is raised. ``on_oversize`` is called, after ``on_snapshot`` and before the snapshot is
        confirmed, for every change of the snapshot Kafka refused as too large (without it each is logged as a
        warning)."""
        # CPython's cyclic GC: with its default young-generation threshold (700 allocations) it collects
        # several times per fetched batch, rescanning the batch's librdkafka Messages and the buffered Change
        # tuples (tracked objects: a tuple subclass holding an enum member), and every ~10th pass promotes them
        # into full collections of the whole process (~6 % of the client's time, docs/performance.md). The
        # client owns this loop: while it runs the young threshold is at least GC_YOUNG_THRESHOLD (the engine
        # uses the same, engine.bucket.GC_THRESHOLDS); the application's own thresholds are restored when it
        # returns or raises. Nothing the client allocates forms reference cycles (refcounting frees it).
        thresholds = gc.get_threshold()
        if 0 < thresholds[0] < GC_YOUNG_THRESHOLD:  # (0: the application turned automatic collection off)
            gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
        try:
            while True:
                try:
                    for ev in self.events(until_caught_up=until_caught_up):
                        if isinstance(ev, Snapshot):
                            on_snapshot(ev)
                            for o in ev.oversize:
                                if on_oversize is not None:
                                    on_oversize(o)
                                else:
                                    log.warning("vbucket %d seqno %d: the change of key %r (%d bytes) is not in "
                                                "%s: Kafka refused it as too large (%s)", o.vbucket, o.seqno,
                                                o.key, o.size, self.topic, o.reason)
                        elif isinstance(ev, RollbackInstruction):
                            on_rollback(ev)
                        elif on_change is not None:
                            on_change(ev)
                        self._confirm(ev, durable=False)
                        if self._unflushed >= self.group_commit or not self._queue:
                            self.flush()  # before the consumer may wait for records
                    return
                except DecodeError as e:
                    self.flush()
                    if on_error is None:
                        raise
                    on_error(e)
                except BaseException:
                    if self._open is not None:
                        self.abandon()
                    raise
        finally:
            if gc.get_threshold()[0] == GC_YOUNG_THRESHOLD != thresholds[0]:
                gc.set_threshold(*thresholds)
            self.flush()  # what the application confirmed stays confirmed

    def stop(self) -> None:
        """Ask :meth:`run` / :meth:`events` / :meth:`aevents` to return before the next event (thread- and
        signal-safe; they notice within ``poll_timeout``). Cleared when they return."""
        self._stop.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._open is not None:
            self.abandon()
        with contextlib.suppress(ConnectorError):
            self.flush()
        with _suppress_kafka():
            self.consumer.close()
        if self._dlq is not None:
            self._dlq.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _dlq_topic_name(dead_letter: str, topic: str) -> str:
    try:
        name = dead_letter.format(topic=topic)
    except (KeyError, IndexError, ValueError) as e:
        raise ConnectorError(f"dead_letter must be a topic name ({{topic}} is replaced by the topic), a callback "
                             f"or None; {dead_letter!r} is not a valid pattern ({e!r})") from None
    if not name.strip():
        raise ConnectorError(f"dead_letter must be a topic name, a callback or None, got {dead_letter!r}")
    return name


def _check_arguments(topic: object, state_path: object, state_store: object, dead_letter: object,
                     mutation_log_max: object, batch_size: object, poll_timeout: object, group_commit: object) -> None:
    """The constructor's arguments, checked before anything is opened: a :class:`ConnectorError` naming the
    argument (docs/client.md "Arguments")."""
    if not isinstance(topic, str) or not topic:
        raise ConnectorError(f"topic must be a non-empty topic name, got {topic!r}")
    if state_path is not None and state_store is not None:
        raise ConnectorError("state_path and state_store are exclusive: state_path is the SQLite file of the default "
                             "store, state_store another store; give one")
    if state_path is not None and not isinstance(state_path, str | Path):
        raise ConnectorError(f"state_path must be a path (str or Path) or None, got {type(state_path).__name__}")
    if isinstance(dead_letter, str):
        _dlq_topic_name(dead_letter, topic)
    elif dead_letter is not None and not callable(dead_letter):
        raise ConnectorError(f"dead_letter must be a topic name (str, {{topic}} is replaced), a callback taking a "
                             f"DeadLetter, or None; got {type(dead_letter).__name__} {dead_letter!r}")
    if not _is_int(mutation_log_max) or mutation_log_max < 1:  # type: ignore[operator]
        raise ConnectorError(f"mutation_log_max must be an integer >= 1 (entries kept per vbucket), got "
                             f"{mutation_log_max!r}")
    if not _is_int(batch_size) or batch_size < 1:  # type: ignore[operator]
        raise ConnectorError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if (not isinstance(poll_timeout, int | float) or isinstance(poll_timeout, bool)
            or not 0 < poll_timeout < float("inf")):
        raise ConnectorError(f"poll_timeout must be a positive number of seconds, got {poll_timeout!r}")
    if not _is_int(group_commit) or group_commit < 1:  # type: ignore[operator]
        raise ConnectorError(f"group_commit must be >= 1, got {group_commit}")


def record_problem(e: RecordFormatError) -> str:
    """What is wrong with a record, in the record format's words, without the text of the internal exception
    the decoder met (e.g. ``IndexError: string index out of range`` from the Avro reader): that stays on the
    error's ``__cause__`` chain."""
    text = str(e)
    cause = e.__cause__ if e.__cause__ is not None else e.__context__
    if cause is not None and not isinstance(cause, RecordFormatError):
        detail = str(cause)
        for tail in (f": {type(cause).__name__}: {detail}", f": {detail}" if detail else None):
            if tail is not None and text.endswith(tail):
                text = text[: -len(tail)].rstrip()
                break
    return text


class _suppress_kafka:
    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: object) -> bool:
        if ev is not None and isinstance(ev, KafkaException):
            log.warning("ignored Kafka error: %s", ev)
            return True
        return False
