"""An engine node process: one :class:`~engine.bucket.Bucket` served over TCP (memcached binary protocol).

``python -m engine.network.server --data-dir D --port P --num-vbuckets V [--name n0]`` prints ``READY port=<port>``
once it listens. kv_engine counterparts: the memcached front end (GET / SET / DELETE / OBSERVE_SEQNO / STAT),
``SET_VBUCKET_STATE`` with the partition-state CAS (docs/cluster.md "Partition-state CAS"), DCP producer connections (``dcp/producer.cc``:
stream request -> OK + failover log / ROLLBACK / errors, then pushed markers, mutations, deletions,
expirations and stream ends, flow control by buffer acks), and the replica side: the node pulls its replica
vbuckets from the active nodes with :class:`~engine.dcp.replication.DcpConsumer` over
:class:`~engine.network.remote.RemoteDcpProducer` connections (one thread per source node).

Single-threaded access to the bucket: everything touching it runs on the asyncio loop's thread; a replication
thread reaches the bucket only through :class:`_LoopBucket`, which runs each call on the loop. A periodic
flusher persists what was queued. The storage is the engine's SQLite storage, so a SIGKILLed node warms up like
a crashed single-node engine (unclean shutdown: its actives get a failover entry).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import orjson

from engine.bucket import Bucket
from engine.cluster.manager import branch_end
from engine.config import BucketConfig
from engine.dcp.producer import DcpProducer
from engine.dcp.replication import MAX_ROLLBACKS_PER_REQUEST, DcpConsumer
from engine.dcp.stream import SnapshotMarker, StreamFlags
from engine.exceptions import (
    EngineError,
    InvalidArgument,
    KeyExists,
    NotMyVBucket,
    StateCasMismatch,
    Status,
    SyncWriteAmbiguous,
    TemporaryFailure,
    UnknownCommand,
)
from engine.kv.conflict_resolution import ConflictResolutionMismatch
from engine.kv.data_dir import DataDirLock, DataDirLocked
from engine.kv.durability import SyncWrite
from engine.kv.item import Item
from engine.kv.vbucket import VBucketState
from engine.network.dcp_batch import encode_dcp_batch
from engine.network.protocol import (
    CODE_STATES,
    DCP_OPEN_PRODUCER,
    GET_EXTRAS,
    HEADER_LEN,
    OBSERVE0,
    OBSERVE1,
    OPEN_EXTRAS,
    SET_EXTRAS,
    STATE_CODES,
    STREAM_REQ_EXTRAS,
    TOKEN_EXTRAS,
    U32,
    U64,
    Frame,
    Opcode,
    ProtocolError,
    decode_failover_log,
    decode_framing,
    encode_failover_log,
    error_response,
    frame_from,
    parse_header,
    response,
)
from engine.network.remote import RemoteDcpProducer
from engine.network.with_meta import WITH_META_OPCODES
from engine.network.with_meta import answer as with_meta_answer
from schemas.failover_log import FailoverEntry

log = logging.getLogger("engine.server")
#: flow-control buffer of a replication connection (kv_engine ``dcp_conn_buffer_size``, 10 MiB)
REPLICATION_BUFFER_BYTES = 10 * 1024 * 1024
#: items per flush transaction: as kv_engine's flusher, which runs on a writer thread of its own and never holds
#: up the front end, the transactions run in the storage's writer process (docs/engine.md "Background flush")
#: while the loop serves the connections; a backlog (1M items after START_PERSISTENCE) goes in steps
FLUSH_STEP_ITEMS = 10_000
#: how often the flusher task looks whether the transaction in flight ended (it only waits while one runs)
FLUSH_POLL_S = 0.002
#: the longest pause between flush attempts while they fail (a full disk): the pause doubles from the flush
#: interval up to this; one log line when flushing fails, one when it works again (docs/reliability.md)
FLUSH_RETRY_MAX_S = 1.0
T = TypeVar("T")


class _LoopBucket:
    """The replica bucket as a replication thread sees it: every call runs on the loop thread (single-threaded
    access to the bucket), then wakes the node's DCP connections."""

    def __init__(self, server: NodeServer) -> None:
        self._server = server

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                fut.set_exception(e)
            self._server.kick()

        self._server.loop.call_soon_threadsafe(call)
        return fut.result(timeout=60)

    @property
    def closed(self) -> bool:
        return self._server.bucket.closed

    def replica_position(self, vbucket: int) -> tuple[int, int, int]:
        return self._run(self._server.bucket.replica_position, vbucket)

    def failover_log(self, vbucket: int) -> list[FailoverEntry]:
        return self._run(self._server.bucket.failover_log, vbucket)

    def rollback_vbucket(self, vbucket: int, seqno: int) -> int:
        return self._run(self._server.bucket.rollback_vbucket, vbucket, seqno)

    def replace_failover_log(self, vbucket: int, entries: list[FailoverEntry]) -> None:
        self._run(self._server.bucket.replace_failover_log, vbucket, entries)

    def apply_replica_message(self, message: SnapshotMarker | Item) -> None:
        self._run(self._server.bucket.apply_replica_message, message)

    # A takeover stream's state messages (engine/dcp/takeover.py): pending, then active with transfer.
    def set_vbucket_state(self, vbucket: int, state: VBucketState, *, cas: int | None = None) -> int:
        return self._run(lambda: self._server.bucket.set_vbucket_state(vbucket, state, cas=cas))

    def promote(self, vbucket: int, *, takeover: bool = False, cas: int | None = None) -> FailoverEntry | None:
        return self._run(lambda: self._server.bucket.promote(vbucket, takeover=takeover, cas=cas))

    def durability_ack_seqno(self, vbucket: int) -> int:
        return self._run(self._server.bucket.durability_ack_seqno, vbucket)

    def durability_ack_seqnos(self, vbuckets: list[int]) -> dict[int, int]:
        return self._run(self._server.bucket.durability_ack_seqnos, vbuckets)


class ReplicationLink(threading.Thread):
    """One replication connection ``replication:<src>-><me>`` (kv_engine's name): pulls the vbuckets this node
    replicates from ``src`` and applies them with :class:`DcpConsumer`. Reconnects and re-requests (from the
    replica's own position, rolling back when told) until stopped."""

    def __init__(self, server: NodeServer, src: str, host: str, port: int, vbuckets: Sequence[int]) -> None:
        super().__init__(name=f"replication:{src}->{server.name}", daemon=True)
        self.server = server
        self.src = src
        self.address = (host, port)
        self.vbuckets = sorted(vbuckets)
        self.stopping = threading.Event()
        self.consumer: DcpConsumer | None = None
        self.connects = 0
        self.errors = 0
        self.rollbacks = 0
        self.messages = 0
        #: vbuckets to re-request as takeover streams (DCP_ADD_STREAM with TAKEOVER, docs/rebalance.md)
        self._takeovers: set[int] = set()
        self._lock = threading.Lock()
        self.takeovers = 0

    def request_takeover(self, vbucket: int) -> None:
        with self._lock:
            self._takeovers.add(vbucket)

    def _start_takeovers(self, consumer: DcpConsumer) -> None:
        """Convert the requested streams to takeover streams: close, then request with TAKEOVER from the
        replica's own position (rolling back if told, which a caught-up copy never is)."""
        with self._lock:
            todo, self._takeovers = sorted(self._takeovers), set()
        for vb in todo:
            consumer.close_stream(vb)
            with contextlib.suppress(NotMyVBucket, TemporaryFailure, KeyExists):
                for _ in range(MAX_ROLLBACKS_PER_REQUEST):
                    if consumer.request_stream(vb, takeover=True) is not None:
                        self.takeovers += 1
                        break

    @property
    def spec(self) -> tuple[str, int, tuple[int, ...]]:
        return (self.address[0], self.address[1], tuple(self.vbuckets))

    def run(self) -> None:
        target = _LoopBucket(self.server)
        while not self.stopping.is_set():
            try:
                producer = RemoteDcpProducer(*self.address, self.name, poll_timeout=0.02,
                                             buffer_size=self.server.replication_buffer)
            except EngineError:
                self.stopping.wait(0.05)
                continue
            self.connects += 1
            try:
                # sync replication (docs/durability.md): replication enables sync writes and seqno-acks as this node
                consumer = self.consumer = DcpConsumer(self.name, target, producer,
                                                       consumer_name=self.server.name)
            except (EngineError, OSError):
                producer.close()
                self.stopping.wait(0.05)
                continue
            rounds = 0
            try:
                while not self.stopping.is_set() and not producer.closed:
                    if self._takeovers:
                        self._start_takeovers(consumer)
                    rounds += 1
                    if rounds % 5 == 0:
                        consumer.acknowledge_seqnos()  # persist levels: acks once the flusher persisted
                    for vb in self.vbuckets:
                        if not consumer.is_open(vb):
                            # NOT_MY_VBUCKET: the source is not active (yet) or this copy is not a replica
                            # (yet): retried on the next round, as ns_server keeps re-creating streams.
                            with contextlib.suppress(NotMyVBucket, TemporaryFailure, KeyExists):
                                consumer.add_stream(vb)
                    consumer.step(512)
                    self.rollbacks = consumer.rollbacks
                    self.messages = consumer.messages
            except (EngineError, OSError) as e:
                self.errors += 1
                log.debug("%s: %s", self.name, e)
            finally:
                with contextlib.suppress(Exception):
                    consumer.close()
            self.stopping.wait(0.05)

    def stop(self) -> None:
        self.stopping.set()
        c = self.consumer
        if c is not None:
            with contextlib.suppress(Exception):
                c.producer.close()


class _Conn:
    """One client connection: its DCP producer (after DCP_OPEN as a producer) and the stream opaques."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.producer: DcpProducer | None = None
        self.opaques: dict[int, int] = {}
        self.wake = asyncio.Event()
        self.pusher: asyncio.Task[None] | None = None
        self.closed = False


class NodeServer:
    """Serves one bucket: front end, state commands, DCP producers, replication links, the flusher."""

    def __init__(self, bucket: Bucket, name: str = "node", *, host: str = "127.0.0.1", port: int = 0,
                 flush_interval: float = 0.01, parent_pid: int | None = None,
                 replication_buffer: int = REPLICATION_BUFFER_BYTES) -> None:
        self.bucket = bucket
        self.name = name
        self.host = host
        self.port = port
        self.flush_interval = flush_interval
        self.parent_pid = parent_pid
        #: flow-control buffer of this node's replication connections (0 = none)
        self.replication_buffer = replication_buffer
        self.persistence = True
        self.links: dict[str, ReplicationLink] = {}
        self.conns: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()
        self.bad_frames = 0
        #: vbucket -> (seqno, vbuuid, its "vb:vbuuid:seqno" entry) of the last ``stats vbucket-persisted``
        self._persisted_entries: dict[int, tuple[int, int, str]] = {}
        #: that stat's last answer and the bucket's ``persistence_revision`` it was built at: valid until either
        #: moves (whoever flushed: in ``dcpgw up --gateways K`` the gateway service flushes the same bucket
        #: too, without this server knowing) or the next :meth:`kick`
        self._persisted_text: str | None = None
        self._persisted_revision = -1

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop that owns the bucket (set by :meth:`start`)."""
        if self._loop is None:
            raise InvalidArgument("the node server is not started")
        return self._loop

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Listen; returns the port."""
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.loop.create_task(self._flusher())
        if self.parent_pid is not None:
            self.loop.create_task(self._watch_parent())
        return self.port

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    async def shutdown(self, *, clean: bool = True) -> None:
        """Stop replication, close connections and the bucket (clean: flushed, clean-shutdown marker)."""
        for link in self.links.values():
            link.stop()
        await asyncio.gather(*(asyncio.to_thread(link.join, 5) for link in self.links.values()))
        self.links.clear()
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            c.closed = True
            c.writer.close()
        if not self.bucket.closed:
            self.bucket.close(clean=clean)

    async def _flusher(self) -> None:
        # kv_engine's flusher task: persist whatever the checkpoints queued, in seqno order, per vbucket -- in
        # the background: the loop serves the connections while the writer process commits a step; the step
        # lands (persisted seqnos move, OBSERVE_SEQNO and the persist levels see it) once committed.
        b = self.bucket
        loop = asyncio.get_running_loop()
        if self.persistence:
            b.start_flush_writer()  # the first flush need not wait for the writer process to start
        failing = 0  # failed attempts in a row
        pause = retry_at = 0.0
        while not b.closed:
            await asyncio.sleep(self.flush_interval)
            while not b.closed and loop.time() >= retry_at and (
                    b.flush_pending or (self.persistence and b.dirty_vbuckets)):
                if not b.flush_done:
                    await asyncio.sleep(FLUSH_POLL_S)  # the connections' turn while the transaction runs
                    continue
                try:
                    landed = b.complete_flush() if b.flush_pending else 0
                    n = b.start_flush(FLUSH_STEP_ITEMS) if self.persistence and b.dirty_vbuckets else 0
                except EngineError as e:
                    # e.g. a full disk: the items stay queued (acknowledged in memory) and are tried again after
                    # a pause doubling up to FLUSH_RETRY_MAX_S; said once (the bucket's stats carry
                    # flush_failures and flush_error)
                    if not failing:
                        log.warning("persisting failed: %s (retried until it works, at least every %.0f s)", e,
                                    FLUSH_RETRY_MAX_S)
                    failing += 1
                    pause = min(max(pause * 2, self.flush_interval), FLUSH_RETRY_MAX_S)
                    retry_at = loop.time() + pause
                    break
                if landed:
                    if failing:
                        log.warning("persisting works again after %d failed attempts", failing)  # paired with the failure
                        failing = 0
                        pause = 0.0
                    self.kick()
                if not n:
                    break
                await asyncio.sleep(0)
            if not b.closed and b.process_durability_timeouts():
                self.kick()  # the durability timeout task (kv_engine DurabilityTimeoutTask): aborts to send

    async def _watch_parent(self) -> None:
        # A node started by a cluster manager dies with it (no orphan processes after a test failure).
        while True:
            await asyncio.sleep(0.2)
            if os.getppid() != self.parent_pid:
                os._exit(3)

    def kick(self) -> None:
        """Wake every DCP connection: something may be ready to send."""
        for c in self.conns:
            if c.producer is not None:
                c.wake.set()

    # ------------------------------------------------------------------ connections
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        self.conns.add(conn)
        try:
            while not conn.closed:
                header = await reader.readexactly(HEADER_LEN)
                try:
                    h = parse_header(header)
                except ProtocolError as e:
                    # The stream cannot be resynchronised: answer EINVAL and drop this connection only.
                    self.bad_frames += 1
                    writer.write(error_response(header[1], e))
                    await writer.drain()
                    break
                f = frame_from(h, await reader.readexactly(h[6]))
                if not f.is_request:
                    self._response(conn, f)  # a takeover ack, or e.g. a client's answer to a DCP noop
                    continue
                await self._dispatch(conn, f)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # hang-up, or the node shutting down
        finally:
            conn.closed = True
            conn.wake.set()
            self.conns.discard(conn)
            if conn.producer is not None:
                conn.producer.close()
            with contextlib.suppress(Exception):
                writer.close()

    def _response(self, conn: _Conn, f: Frame) -> None:
        """A consumer's response on a producer connection: the ack of a marker sent with ACK or of a
        SET_VBUCKET_STATE of a takeover stream, matched to its stream by opaque (kv_engine
        ``DcpProducer::handleResponse``)."""
        p = conn.producer
        if p is None or f.opcode not in (Opcode.DCP_SNAPSHOT_MARKER, Opcode.DCP_SET_VBUCKET_STATE):
            return
        vb = next((v for v, o in conn.opaques.items() if o == f.opaque), None)
        if vb is None:
            return  # a stream closed meanwhile
        try:
            if f.opcode == Opcode.DCP_SNAPSHOT_MARKER:
                p.snapshot_marker_ack(vb)
            else:
                p.set_vbucket_state_ack(vb)
        except EngineError as e:
            log.warning("%s: takeover ack for vbucket %d refused: %s", p.name, vb, e)
        conn.wake.set()
        self.kick()

    async def _push(self, conn: _Conn) -> None:
        """Push the producer's messages to the client (kv_engine: the front-end thread steps the connection
        whenever its socket is writable), within flow control."""
        p = conn.producer
        assert p is not None
        w = conn.writer
        try:
            while not conn.closed and not p.closed:
                msgs = p.step(512)
                if msgs:
                    opq = conn.opaques
                    sync = p.sync_writes
                    w.write(encode_dcp_batch(msgs, opq, sync=sync))  # one buffer, one write per batch
                    await w.drain()
                    continue
                conn.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(conn.wake.wait(), 0.05)
        except (ConnectionError, EngineError):
            conn.closed = True

    async def _dispatch(self, conn: _Conn, f: Frame) -> None:
        w = conn.writer
        try:
            out = await self._execute(conn, f)
        except StateCasMismatch as e:
            w.write(error_response(f.opcode, e, f.opaque, cas=e.current_cas))
            return
        except EngineError as e:
            w.write(error_response(f.opcode, e, f.opaque))
            return
        except Exception as e:  # a bug must not take the node down: EINTERNAL, as memcached answers
            log.exception("opcode 0x%02x failed", f.opcode)
            w.write(response(f.opcode, Status.EINTERNAL, value=str(e).encode(), opaque=f.opaque))
            return
        if out is not None:
            w.write(out)

    def _need(self, f: Frame, extras: int | tuple[int, ...], key: bool = False) -> None:
        sizes = (extras,) if isinstance(extras, int) else extras
        if len(f.extras) not in sizes:
            raise ProtocolError(f"opcode 0x{f.opcode:02x}: extras of {len(f.extras)} bytes, expected {sizes}")
        if key and not f.key:
            raise ProtocolError(f"opcode 0x{f.opcode:02x} needs a key")

    async def _execute(self, conn: _Conn, f: Frame) -> bytes | None:
        b = self.bucket
        op = f.opcode
        vb = f.vbucket
        if op == Opcode.GET:
            self._need(f, 0, key=True)
            g = b.get(f.key, vbucket=vb)
            return response(op, extras=GET_EXTRAS.pack(g.flags), value=g.value, datatype=g.datatype,
                            opaque=f.opaque, cas=g.cas)
        if op == Opcode.SET:
            self._need(f, 8, key=True)
            flags, expiry = SET_EXTRAS.unpack(f.extras)
            durability = decode_framing(f.framing) if f.framing else None
            if durability is not None:  # a sync write (docs/durability.md), answered once committed (or ambiguous)
                sw = b.set(f.key, f.value, cas=f.cas, flags=flags, expiry=expiry, datatype=f.datatype or None,
                           vbucket=vb, durability=durability)
                r = await self._completed(sw)
            else:
                r = b.set(f.key, f.value, cas=f.cas, flags=flags, expiry=expiry, datatype=f.datatype or None,
                          vbucket=vb)
            self.kick()
            return response(op, extras=TOKEN_EXTRAS.pack(r.vbuuid, r.seqno), opaque=f.opaque, cas=r.cas)
        if op == Opcode.DELETE:
            self._need(f, 0, key=True)
            durability = decode_framing(f.framing) if f.framing else None
            if durability is not None:
                r = await self._completed(b.delete(f.key, cas=f.cas, vbucket=vb, durability=durability))
            else:
                r = b.delete(f.key, cas=f.cas, vbucket=vb)
            self.kick()
            return response(op, extras=TOKEN_EXTRAS.pack(r.vbuuid, r.seqno), opaque=f.opaque, cas=r.cas)
        if op in WITH_META_OPCODES:  # the XDCR target (docs/xdcr.md "Target side", engine/network/with_meta.py)
            out = with_meta_answer(b, f)
            self.kick()
            return out
        if op == Opcode.OBSERVE_SEQNO:
            return self._observe(f)
        if op == Opcode.SET_VBUCKET_STATE:
            return self._set_state(f)
        if op == Opcode.GET_VBUCKET_STATE:
            v = b.vbucket(vb)
            return response(op, value=U32.pack(STATE_CODES[v.state.value]), opaque=f.opaque, cas=v.state_cas)
        if op == Opcode.STAT:
            return self._stats(f)
        if op == Opcode.DCP_GET_FAILOVER_LOG:
            return response(op, value=encode_failover_log(b.failover_log(vb)), opaque=f.opaque)
        if op == Opcode.DCP_OPEN:
            self._need(f, 8, key=True)
            _seqno, flags = OPEN_EXTRAS.unpack(f.extras)
            if not flags & DCP_OPEN_PRODUCER:
                raise InvalidArgument("this node opens producer connections only (its replication consumers "
                                      "are its own outbound connections)")
            if conn.producer is not None:
                raise KeyExists("DCP_OPEN on a connection that is already a DCP connection")
            conn.producer = b.dcp_producer(f.key.decode(errors="replace"))
            conn.pusher = self.loop.create_task(self._push(conn))
            return response(op, opaque=f.opaque)
        if op in (Opcode.DCP_CONTROL, Opcode.DCP_STREAM_REQ, Opcode.DCP_CLOSE_STREAM,
                  Opcode.DCP_BUFFER_ACKNOWLEDGEMENT, Opcode.DCP_NOOP, Opcode.DCP_SEQNO_ACKNOWLEDGED):
            return self._dcp(conn, f)
        if op == Opcode.STOP_PERSISTENCE:
            self.persistence = False
            if b.flush_pending:
                b.complete_flush(wait=True)  # the step handed to the writer lands now; nothing after it
            return response(op, opaque=f.opaque)
        if op == Opcode.START_PERSISTENCE:
            self.persistence = True
            return response(op, opaque=f.opaque)
        if op == Opcode.FLUSH_NOW:
            b.flush_all()
            self.kick()
            return response(op, opaque=f.opaque)
        if op == Opcode.SET_REPLICATION:
            await self._set_replication(f)
            return response(op, opaque=f.opaque)
        if op == Opcode.DCP_ADD_STREAM:
            return self._add_stream(f)
        raise UnknownCommand(f"unknown opcode 0x{op:02x}")

    async def _completed(self, sw: SyncWrite | Any) -> Any:
        """Wait for a sync write (this connection only: the loop keeps serving the replication connections
        whose seqno-acks commit it, and the flusher); the commit's result or SYNC_WRITE_AMBIGUOUS."""
        self.kick()
        while not sw.done:
            if self.bucket.closed:
                raise SyncWriteAmbiguous(f"sync write of {sw.key!r}: the node shut down before it completed")
            self.bucket.process_durability_timeouts()
            if sw.done:
                break
            await asyncio.sleep(0.001)
        return sw.result()

    def _dcp(self, conn: _Conn, f: Frame) -> bytes | None:
        p = conn.producer
        op = f.opcode
        if op == Opcode.DCP_NOOP:
            return response(op, opaque=f.opaque)
        if p is None:
            raise InvalidArgument(f"opcode 0x{op:02x} needs a DCP producer connection (DCP_OPEN first)")
        if op == Opcode.DCP_BUFFER_ACKNOWLEDGEMENT:
            self._need(f, 4)
            p.buffer_acknowledge(U32.unpack(f.extras)[0])
            conn.wake.set()
            return None  # kv_engine sends no answer to a buffer ack
        if op == Opcode.DCP_SEQNO_ACKNOWLEDGED:
            # DCP_SEQNO_ACKNOWLEDGED: the consumer's replica acks its high prepared seqno; kv_engine sends no answer
            self._need(f, 8)
            p.seqno_acknowledged(f.vbucket, U64.unpack(f.extras)[0])
            self.kick()
            return None
        if op == Opcode.DCP_CONTROL:
            if f.key in (b"enable_sync_writes", b"consumer_name"):
                p.control(f.key.decode(), f.value.decode(errors="replace"))
                return response(op, opaque=f.opaque)
            if f.key == b"connection_buffer_size":
                try:
                    size = int(f.value)
                except ValueError as e:
                    raise InvalidArgument(f"bad connection_buffer_size {f.value!r}") from e
                if size < 0:
                    raise InvalidArgument("connection_buffer_size must be >= 0")
                p.buffer_size = size
                return response(op, opaque=f.opaque)
            raise InvalidArgument(f"unsupported DCP control {f.key!r}")
        if op == Opcode.DCP_CLOSE_STREAM:
            p.close_stream(f.vbucket)
            p.discard_stream(f.vbucket)  # no stream-end for a close the consumer asked for (kv_engine)
            conn.opaques.pop(f.vbucket, None)
            return response(op, opaque=f.opaque)
        # DCP_STREAM_REQ
        self._need(f, STREAM_REQ_EXTRAS.size)
        flags, _reserved, start, end, vbuuid, snap_start, snap_end = STREAM_REQ_EXTRAS.unpack(f.extras)
        client_log = decode_failover_log(f.value) if f.value else None
        entries = p.stream_request(f.vbucket, start, end, vbuuid, snap_start, snap_end, flags=flags,
                                   opaque=f.opaque, failover_log=client_log)
        conn.opaques[f.vbucket] = f.opaque
        conn.wake.set()
        # Written before the pusher runs again (same loop, synchronous write): the OK precedes the data.
        return response(op, value=encode_failover_log(entries), opaque=f.opaque)

    def _add_stream(self, f: Frame) -> bytes:
        # DCP_ADD_STREAM (docs/rebalance.md "Node processes"): here only with TAKEOVER, naming the source node whose replication link
        # carries the vbucket (this node's consumers are its own outbound links); answered at once.
        self._need(f, 4, key=True)
        (flags,) = U32.unpack(f.extras)
        if not flags & StreamFlags.TAKEOVER:
            raise InvalidArgument("DCP_ADD_STREAM: only takeover streams are added this way (flag 0x01)")
        src = f.key.decode(errors="replace")
        link = self.links.get(src)
        if link is None or f.vbucket not in link.vbuckets or not link.is_alive():
            raise NotMyVBucket(f"no replication of vbucket {f.vbucket} from {src!r} on {self.name}")
        link.request_takeover(f.vbucket)
        return response(f.opcode, opaque=f.opaque)

    def _observe(self, f: Frame) -> bytes:
        # kv_engine OBSERVE_SEQNO: format 0 (vbuuid, persisted, current) or, when the client's vbuuid is not
        # the current one, format 1 adding the old vbuuid and the last seqno of that branch in the history.
        # A replica answers with the end of its last complete snapshot received / persisted (docs/cluster.md
        # "Observe by seqno": a replica "has" a seqno once it holds a complete snapshot at or above it).
        if len(f.value) != 8:
            raise ProtocolError("OBSERVE_SEQNO needs an 8-byte vbuuid body")
        (uuid,) = U64.unpack(f.value)
        v = self.bucket.vbucket(f.vbucket)
        if v.state is VBucketState.ACTIVE:
            current, persisted = v.high_seqno, v.persisted_seqno
        elif v.state is VBucketState.REPLICA:
            current, persisted = v.snapshot_complete, v.snapshot_persisted
        else:
            raise NotMyVBucket(f"vbucket {f.vbucket} is {v.state.value}")
        entries = v.failover.entries
        latest = entries[0].vbuuid
        if uuid == latest:
            body = OBSERVE0.pack(0, f.vbucket, latest, persisted, current)
        else:
            last = branch_end(entries, uuid, current)
            body = OBSERVE1.pack(1, f.vbucket, latest, persisted, current, uuid, last)
        return response(f.opcode, value=body, opaque=f.opaque)

    def _set_state(self, f: Frame) -> bytes:
        # SET_VBUCKET_STATE: 1-byte (kv_engine 7) or 4-byte extras; the header CAS is the partition-state CAS
        # (0 = unconditional); replica -> active is a promotion (value {"transfer": true} = takeover).
        self._need(f, (1, 4))
        code = f.extras[0] if len(f.extras) == 1 else U32.unpack(f.extras)[0]
        if code not in CODE_STATES:
            raise InvalidArgument(f"bad vbucket state {code}")
        state = VBucketState(CODE_STATES[code])
        cas = f.cas or None
        b = self.bucket
        v = b.vbucket(f.vbucket)
        body = b""
        opts: dict[str, Any] = {}
        if f.value:
            try:
                opts = orjson.loads(f.value)
            except orjson.JSONDecodeError as e:
                raise InvalidArgument(f"bad SET_VBUCKET_STATE body: {e}") from e
            if not isinstance(opts, dict):
                raise InvalidArgument("SET_VBUCKET_STATE body must be a JSON object")
        topology = opts.get("topology")
        if topology is not None and (state is not VBucketState.ACTIVE or not isinstance(topology, list)
                                     or not 1 <= len(topology) <= 2
                                     or not all(isinstance(ch, list) for ch in topology)):
            # kv_engine: up to two chains (the second during a rebalance move)
            raise InvalidArgument(f"bad topology {topology!r}: [[active, replica...]] (or two chains) for an "
                                  "active vbucket")
        if topology is not None and v.state is not VBucketState.ACTIVE:
            # only an active copy takes a topology here (the manager never promotes with one)
            raise NotMyVBucket(f"vbucket {f.vbucket} is {v.state.value}: a topology needs an active vbucket")
        if state is VBucketState.ACTIVE and v.state in (VBucketState.REPLICA, VBucketState.PENDING):
            entry = b.promote(f.vbucket, takeover=bool(opts.get("transfer")), cas=cas)
            body = orjson.dumps({"failover_entry": None if entry is None else [entry.vbuuid, entry.seqno]})
            new_cas = v.state_cas
        else:
            new_cas = b.set_vbucket_state(f.vbucket, state, cas=cas)
        if topology is not None:
            # kv_engine: ns_server sends the replication chain with setVBucketState (docs/durability.md)
            b.set_replication_topology(f.vbucket, topology[0], topology[1] if len(topology) > 1 else None)
        self.kick()
        return response(f.opcode, value=body, opaque=f.opaque, cas=new_cas)

    def _stats(self, f: Frame) -> bytes:
        group = f.key.decode(errors="replace").strip()
        b = self.bucket
        stats: dict[str, Any]
        if group == "":
            stats = dict(b.stats())
            stats["name"] = self.name
            stats["bad_frames"] = self.bad_frames
            stats["persistence"] = int(self.persistence)
        elif group.startswith("vbucket-details"):
            parts = group.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise InvalidArgument("usage: vbucket-details <vbucket>")
            i = b.vbucket_info(int(parts[1]))
            stats = {"state": i.state.value, "state_cas": i.state_cas, "high_seqno": i.high_seqno,
                     "persisted_seqno": i.persisted_seqno, "snapshot_complete": i.snapshot_complete,
                     "snapshot_persisted": i.snapshot_persisted,
                     "failover_log": orjson.dumps(i.failover).decode()}
        elif group.startswith("dcp-vbtakeover"):
            parts = group.split()
            if len(parts) != 3 or not parts[1].isdigit():
                raise InvalidArgument("usage: dcp-vbtakeover <vbucket> <connection>")
            vbid = int(parts[1])
            producer = b.producers.get(parts[2])
            if producer is None:
                v = b.vbucket(vbid)
                stats = {"name": parts[2], "status": "does_not_exist", "estimate": v.high_seqno,
                         "vb_state": v.state.value}
            else:
                stats = dict(producer.takeover_stats(vbid))
        elif group == "vbucket-states":
            # every vbucket's state in one answer (a gateway attached to running nodes learns the actives:
            # docs/scale-out.md)
            stats = {str(v.id): v.state.value for v in b.vbuckets()}
        elif group == "vbucket-states packed":
            # the same in one stat "vbuckets", "<vb>:<state>" separated by spaces: one frame instead of one per
            # vbucket (every attached gateway asks every 0.5 s; reading 1024 frames cost it ~10 ms)
            stats = {"vbuckets": " ".join(f"{v.id}:{v.state.value}" for v in b.vbuckets())}
        elif group == "vbucket-persisted":
            # what OBSERVE_SEQNO answers (_observe: latest vbuuid, persisted seqno -- a replica's end of its last
            # complete snapshot persisted) for every active and replica vbucket, in one stat "vbuckets" whose
            # value is "<vb>:<vbuuid>:<seqno>" separated by spaces (one frame, not one per vbucket): a gateway
            # attached to running nodes polls persistence for rollback mitigation with it (docs/scale-out.md)
            stats = {"vbuckets": self._persisted_table()}
        elif group == "replication":
            stats = {}
            for src, link in sorted(self.links.items()):
                stats[f"{src}:vbuckets"] = ",".join(map(str, link.vbuckets))
                stats[f"{src}:connects"] = link.connects
                stats[f"{src}:errors"] = link.errors
                stats[f"{src}:rollbacks"] = link.rollbacks
                stats[f"{src}:messages"] = link.messages
                stats[f"{src}:takeovers"] = link.takeovers
        else:
            raise InvalidArgument(f"unknown stat group {group!r}")
        out = [response(f.opcode, key=k.encode(), value=str(v).encode(), opaque=f.opaque)
               for k, v in stats.items()]
        out.append(response(f.opcode, opaque=f.opaque))  # memcached: an empty key ends the stats
        return b"".join(out)

    def _persisted_table(self) -> str:
        """``stats vbucket-persisted``'s value. Polled by every attached gateway up to 50 times a second
        (docs/scale-out.md): members polling between two flushes share one answer, and each vbucket's entry is
        formatted again only when its vbuuid or seqno moved."""
        revision = self.bucket.persistence_revision
        if self._persisted_text is not None and revision == self._persisted_revision:
            return self._persisted_text
        active, replica = VBucketState.ACTIVE, VBucketState.REPLICA
        cache = self._persisted_entries
        out: list[str] = []
        for v in self.bucket.vbuckets():
            state = v.state
            if state is active:
                seqno = v.persisted_seqno
            elif state is replica:
                seqno = v.snapshot_persisted
            else:
                continue
            uuid = v.failover.latest.vbuuid
            c = cache.get(v.id)
            if c is None or c[0] != seqno or c[1] != uuid:
                c = cache[v.id] = (seqno, uuid, f"{v.id}:{uuid}:{seqno}")
            out.append(c[2])
        text = self._persisted_text = " ".join(out)
        self._persisted_revision = revision
        return text

    async def _set_replication(self, f: Frame) -> None:
        try:
            sources = orjson.loads(f.value)["sources"]
            wanted = {str(n): (str(d["host"]), int(d["port"]), tuple(sorted(int(x) for x in d["vbuckets"])))
                      for n, d in sources.items()}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidArgument(f"bad SET_REPLICATION body: {e}") from e
        stopping = [link for src, link in self.links.items()
                    if wanted.get(src) != link.spec or not link.is_alive()]
        for link in stopping:
            link.stop()
            del self.links[link.src]
        # Answer only once the streams no longer wanted are gone (the manager promotes after this).
        await asyncio.gather(*(asyncio.to_thread(link.join, 30) for link in stopping))
        for src, (host, port, vbs) in sorted(wanted.items()):
            if src not in self.links and vbs:
                link = ReplicationLink(self, src, host, port, vbs)
                self.links[src] = link
                link.start()


async def serve(args: argparse.Namespace) -> None:
    overrides: dict[str, Any] = orjson.loads(args.config_json) if args.config_json else {}
    overrides.setdefault("tune_gc", False)
    if args.conflict_resolution is not None:
        overrides["conflict_resolution"] = args.conflict_resolution
    cfg = BucketConfig(data_dir=Path(args.data_dir), num_vbuckets=args.num_vbuckets, **overrides)
    # One process per node directory (a node of an earlier cluster manager still exiting must not share it):
    # held until this process exits (docs/reliability.md "Data directory").
    lock = DataDirLock.acquire(cfg.data_dir)
    bucket = Bucket(cfg, clock=time.time)  # the node process is an edge: the real clock (docs/engine.md)
    server = NodeServer(bucket, args.name, host=args.host, port=args.port,
                        flush_interval=args.flush_interval_ms / 1000.0, parent_pid=args.parent_pid,
                        replication_buffer=args.replication_buffer_bytes)
    port = await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    sys.stdout.write(f"READY port={port} pid={os.getpid()}\n")
    sys.stdout.flush()
    await server.wait_stopped()
    await server.shutdown(clean=True)
    lock.release()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``python -m engine.network.server --data-dir D --port P --num-vbuckets V``."""
    ap = argparse.ArgumentParser(prog="python -m engine.network.server", description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (printed on the READY line)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--num-vbuckets", type=int, default=1024)
    ap.add_argument("--name", default="node")
    ap.add_argument("--flush-interval-ms", type=float, default=10.0)
    ap.add_argument("--replication-buffer-bytes", type=int, default=REPLICATION_BUFFER_BYTES,
                    help="flow-control buffer of the replication connections this node opens (0 = none)")
    ap.add_argument("--config-json", default="", help="BucketConfig overrides as a JSON object")
    ap.add_argument("--conflict-resolution", choices=("seqno", "lww"), default=None,
                    help="the bucket's XDCR conflict-resolution mode, fixed at creation (docs/xdcr.md)")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    try:
        asyncio.run(serve(args))
    except (DataDirLocked, ConflictResolutionMismatch) as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
