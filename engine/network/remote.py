"""Clients of an engine node process (engine/network/server.py) over the memcached binary protocol (engine/network/protocol.py).

* :class:`RemoteNode`: front-end GET / SET / DELETE, OBSERVE_SEQNO, vbucket state commands with the
  partition-state CAS, stats, and the node's private admin commands. One connection, blocking, thread-safe.
* :class:`RemoteDcpProducer`: a DCP connection that duck-types :class:`engine.dcp.producer.DcpProducer`
  (``stream_request``, ``step``, ``buffer_acknowledge``, ``close_stream``, ``get_failover_log``, ``close``), so
  :class:`engine.dcp.replication.DcpConsumer` and DCP clients work over the network unchanged.

Errors are the engine's typed exceptions (status code -> ``engine.exceptions``); a node that cannot be reached
or drops the connection raises :class:`NodeUnavailable` (TMPFAIL, retriable -- what the in-process cluster
answers for a down node).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine.dcp.stream import MAX_SEQNO, Message, StreamEnd, StreamFlags
from engine.exceptions import (
    EngineClosed,
    InvalidArgument,
    KeyExists,
    NotMyVBucket,
    StateCasMismatch,
    Status,
    TemporaryFailure,
)
from engine.kv.conflict_resolution import ItemMeta
from engine.kv.durability import Durability
from engine.kv.item import Item
from engine.kv.vbucket import GetResult, MutationResult, VBucketInfo, VBucketState
from engine.network.dcp_batch import DcpFrameBuffer
from engine.network.protocol import (
    CODE_STATES,
    DCP_OPEN_PRODUCER,
    GET_EXTRAS,
    GET_META_V2,
    OBSERVE0,
    OBSERVE1,
    OPEN_EXTRAS,
    SET_EXTRAS,
    STATE_CODES,
    TOKEN_EXTRAS,
    U32,
    U64,
    WITH_META_OPCODES,
    Frame,
    FrameBuffer,
    Opcode,
    ProtocolError,
    conflict_error,
    decode_failover_log,
    decode_get_meta_extras,
    encode_durability_frame,
    encode_stream_request,
    encode_with_meta_extras,
    error_from,
    request,
    response,
)
from schemas.failover_log import FailoverEntry

_RECV = 1 << 20


class NodeUnavailable(TemporaryFailure):
    """The node process cannot be reached or dropped the connection (TMPFAIL, retriable)."""


@dataclass(frozen=True)
class NodeObserve:
    """One node's OBSERVE_SEQNO answer (kv_engine format 0, or format 1 after a failover)."""

    vbucket: int
    vbuuid: int
    persisted_seqno: int
    current_seqno: int
    failed_over: bool = False
    old_vbuuid: int | None = None
    last_seqno: int | None = None


class _Connection:
    """A blocking binary-protocol connection: send requests, read frames, match responses by opaque."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise NodeUnavailable(f"cannot connect to {host}:{port}: {e}") from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = FrameBuffer()
        self.opaques = itertools.count(1)
        self.closed = False

    def send(self, data: bytes) -> None:
        if self.closed:
            raise NodeUnavailable(f"connection to {self.host}:{self.port} is closed")
        try:
            self.sock.sendall(data)
        except OSError as e:
            self.close()
            raise NodeUnavailable(f"{self.host}:{self.port}: {e}") from e

    def read(self, timeout: float | None) -> list[Frame]:
        """Frames available after waiting at most ``timeout`` for data (None: the connection timeout)."""
        out = list(self.buf.frames())
        if out:
            return out
        if not self.fill(timeout):
            return []
        try:
            return list(self.buf.frames())
        except ProtocolError:
            self.close()
            raise

    def fill(self, timeout: float | None) -> bool:
        """Wait at most ``timeout`` for data (None: the connection timeout), then buffer it and whatever else
        the socket holds; False when nothing arrived in time."""
        if self.closed:
            raise NodeUnavailable(f"connection to {self.host}:{self.port} is closed")
        try:
            self.sock.settimeout(self.timeout if timeout is None else timeout)
            data = self.sock.recv(_RECV)
        except TimeoutError:
            return False
        except OSError as e:
            self.close()
            raise NodeUnavailable(f"{self.host}:{self.port}: {e}") from e
        if not data:
            self.close()
            raise NodeUnavailable(f"{self.host}:{self.port} closed the connection")
        self.buf.feed(data)
        self.drain(got=True)  # whatever else is already buffered in the socket, without waiting
        return True

    def drain(self, *, got: bool = False) -> bool:
        """Buffer whatever the socket holds now, without waiting; False when it held nothing. A close by the
        node raises :class:`NodeUnavailable` -- after the data before it, once that was buffered (``got``: the
        caller buffered some already)."""
        if self.closed:
            raise NodeUnavailable(f"connection to {self.host}:{self.port} is closed")
        try:
            self.sock.setblocking(False)
            while True:
                more = self.sock.recv(_RECV)
                if not more:
                    if got:
                        break  # the frames before the close are kept; the next drain reports it
                    self.close()
                    raise NodeUnavailable(f"{self.host}:{self.port} closed the connection")
                self.buf.feed(more)
                got = True
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self.close()
            raise NodeUnavailable(f"{self.host}:{self.port}: {e}") from e
        return got

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on this socket
            with contextlib.suppress(OSError):
                self.sock.close()


class RemoteNode:
    """A client of one engine node process (front end, observe, state commands, stats, admin)."""

    def __init__(self, host: str, port: int, *, timeout: float = 30.0) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self._conn: _Connection | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteNode({self.host}:{self.port})"

    def _call(self, opcode: int, *, vbucket: int = 0, key: bytes = b"", extras: bytes = b"",
              value: bytes = b"", cas: int = 0, datatype: int = 0, multi: bool = False,
              framing: bytes = b"") -> list[Frame]:
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = _Connection(self.host, self.port, self.timeout)
            opaque = next(conn.opaques)
            conn.send(request(opcode, key=key, extras=extras, value=value, datatype=datatype, vbucket=vbucket,
                              opaque=opaque, cas=cas, framing=framing))
            got: list[Frame] = []
            while True:
                frames = conn.read(None)
                if not frames:
                    conn.close()
                    raise NodeUnavailable(f"{self}: no answer to opcode 0x{opcode:02x}")
                for f in frames:
                    if f.is_request or f.opaque != opaque:
                        continue
                    if f.status != Status.SUCCESS:
                        raise self._error(f, vbucket, cas)
                    got.append(f)
                    if not multi or not f.key:
                        return got

    @staticmethod
    def _error(f: Frame, vbucket: int, cas: int) -> Exception:
        if f.opcode == Opcode.SET_VBUCKET_STATE and f.status == Status.KEY_EEXISTS:
            return StateCasMismatch(vbucket, f.cas, cas)  # docs/cluster.md "Partition-state CAS" step 6: the current CAS comes back
        if f.status == Status.KEY_EEXISTS and f.opcode in WITH_META_OPCODES:
            return conflict_error(f) or error_from(f, vbucket)
        return error_from(f, vbucket)

    # ------------------------------------------------------------------ front end
    def get(self, key: bytes | str, *, vbucket: int) -> GetResult:
        """GET (kv_engine answers value, CAS and flags; expiry / rev seqno / seqno are not on the wire: 0)."""
        k = key.encode() if isinstance(key, str) else bytes(key)
        (f,) = self._call(Opcode.GET, vbucket=vbucket, key=k)
        (flags,) = GET_EXTRAS.unpack(f.extras) if len(f.extras) == 4 else (0,)
        return GetResult(k, f.value, f.cas, flags, 0, f.datatype, 0, 0, vbucket)

    def set(self, key: bytes | str, value: bytes | str, *, vbucket: int, cas: int = 0, flags: int = 0,
            expiry: int = 0, durability: Durability | None = None) -> MutationResult:
        """SET; the answer carries the mutation token (as after HELLO MutationSeqno). With ``durability`` a
        sync write (docs/durability.md "Node processes": magic 0x08, durability frame info), answered once committed."""
        k = key.encode() if isinstance(key, str) else bytes(key)
        v = value.encode() if isinstance(value, str) else bytes(value)
        framing = encode_durability_frame(durability) if durability is not None and durability.level else b""
        (f,) = self._call(Opcode.SET, vbucket=vbucket, key=k, value=v, cas=cas,
                          extras=SET_EXTRAS.pack(flags, expiry), framing=framing)
        uuid, seqno = TOKEN_EXTRAS.unpack(f.extras)
        return MutationResult(vbucket, uuid, seqno, f.cas)

    def set_replication_topology(
        self, vbucket: int, chain: Sequence[str | None], second: Sequence[str | None] | None = None,
    ) -> None:
        """The replication chain of an active vbucket (kv_engine: SET_VBUCKET_STATE active with the value
        ``{"topology": [[active, replica...]]}``, or two chains during a rebalance move; unconditional, the
        state stays active)."""
        topology = [list(chain)] if second is None else [list(chain), list(second)]
        self._call(Opcode.SET_VBUCKET_STATE, vbucket=vbucket, extras=bytes([STATE_CODES["active"]]),
                   value=orjson.dumps({"topology": topology}))

    def delete(self, key: bytes | str, *, vbucket: int, cas: int = 0,
               durability: Durability | None = None) -> MutationResult:
        k = key.encode() if isinstance(key, str) else bytes(key)
        framing = encode_durability_frame(durability) if durability is not None and durability.level else b""
        (f,) = self._call(Opcode.DELETE, vbucket=vbucket, key=k, cas=cas, framing=framing)
        uuid, seqno = TOKEN_EXTRAS.unpack(f.extras)
        return MutationResult(vbucket, uuid, seqno, f.cas)

    # ------------------------------------------------------------------ XDCR target (docs/xdcr.md "Target side")
    def get_meta(self, key: bytes | str, *, vbucket: int) -> ItemMeta:
        """GET_META (version 2: with the datatype) of a document or tombstone; KeyNotFound for neither."""
        k = key.encode() if isinstance(key, str) else bytes(key)
        (f,) = self._call(Opcode.GET_META, vbucket=vbucket, key=k, extras=bytes([GET_META_V2]))
        deleted, flags, expiry, rev, datatype = decode_get_meta_extras(f.extras)
        return ItemMeta(f.cas, rev, flags, expiry, datatype, deleted)

    def _with_meta(self, opcode: int, key: bytes | str, value: bytes | str | None, meta: ItemMeta, options: int,
                   vbucket: int, cas: int) -> MutationResult:
        k = key.encode() if isinstance(key, str) else bytes(key)
        v = b"" if value is None else value.encode() if isinstance(value, str) else bytes(value)
        extras = encode_with_meta_extras(meta.flags, meta.expiry, meta.rev_seqno, meta.cas, options)
        (f,) = self._call(opcode, vbucket=vbucket, key=k, value=v, extras=extras, cas=cas, datatype=meta.datatype)
        uuid, seqno = TOKEN_EXTRAS.unpack(f.extras)
        return MutationResult(vbucket, uuid, seqno, f.cas)

    def set_with_meta(self, key: bytes | str, value: bytes | str, meta: ItemMeta, options: int = 0, *,
                      vbucket: int, cas: int = 0) -> MutationResult:
        """SET_WITH_META; :class:`ConflictRejected` (KEY_EEXISTS) when the target keeps its document."""
        return self._with_meta(Opcode.SET_WITH_META, key, value, meta, options, vbucket, cas)

    def add_with_meta(self, key: bytes | str, value: bytes | str, meta: ItemMeta, options: int = 0, *,
                      vbucket: int, cas: int = 0) -> MutationResult:
        return self._with_meta(Opcode.ADD_WITH_META, key, value, meta, options, vbucket, cas)

    def del_with_meta(self, key: bytes | str, meta: ItemMeta, options: int = 0, *, vbucket: int, cas: int = 0,
                      value: bytes | None = None) -> MutationResult:
        return self._with_meta(Opcode.DEL_WITH_META, key, value, meta, options, vbucket, cas)

    def observe_seqno(self, vbucket: int, vbuuid: int) -> NodeObserve:
        """OBSERVE_SEQNO on this node (an active answers its high / persisted seqno, a replica the end of its
        last complete snapshot received / persisted -- see docs/cluster.md)."""
        (f,) = self._call(Opcode.OBSERVE_SEQNO, vbucket=vbucket, value=U64.pack(vbuuid))
        if f.value[:1] == b"\x01":
            _fmt, vb, uuid, persisted, current, old, last = OBSERVE1.unpack(f.value)
            return NodeObserve(vb, uuid, persisted, current, True, old, last)
        _fmt, vb, uuid, persisted, current = OBSERVE0.unpack(f.value)
        return NodeObserve(vb, uuid, persisted, current)

    # ------------------------------------------------------------------ vbucket states (state CAS)
    def state_cas(self, vbucket: int) -> int:
        (f,) = self._call(Opcode.GET_VBUCKET_STATE, vbucket=vbucket)
        return f.cas

    def vbucket_state(self, vbucket: int) -> VBucketState:
        (f,) = self._call(Opcode.GET_VBUCKET_STATE, vbucket=vbucket)
        return VBucketState(CODE_STATES[U32.unpack(f.value)[0]])

    def set_vbucket_state(self, vbucket: int, state: VBucketState | str, *, cas: int | None = None) -> int:
        """SET_VBUCKET_STATE with the partition-state CAS in the header (0 = unconditional); returns the new
        CAS; :class:`StateCasMismatch` carries the current one."""
        code = STATE_CODES[VBucketState(state).value]
        (f,) = self._call(Opcode.SET_VBUCKET_STATE, vbucket=vbucket, extras=bytes([code]), cas=cas or 0)
        return f.cas

    def promote(self, vbucket: int, *, takeover: bool = False, cas: int | None = None) -> FailoverEntry | None:
        """SET_VBUCKET_STATE(active) of a replica: kv_engine promotion (a failover entry at the last complete
        snapshot; none with ``takeover``, kv_engine's ``transfer``). Returns the entry created."""
        body = orjson.dumps({"transfer": takeover})
        (f,) = self._call(Opcode.SET_VBUCKET_STATE, vbucket=vbucket, extras=bytes([STATE_CODES["active"]]),
                          value=body, datatype=0x01, cas=cas or 0)
        entry = orjson.loads(f.value).get("failover_entry") if f.value else None
        return None if entry is None else FailoverEntry(int(entry[0]), int(entry[1]))

    def failover_log(self, vbucket: int) -> list[FailoverEntry]:
        (f,) = self._call(Opcode.DCP_GET_FAILOVER_LOG, vbucket=vbucket)
        return decode_failover_log(f.value)

    # ------------------------------------------------------------------ stats
    def stats(self, group: str = "") -> dict[str, str]:
        """STAT: one answer per statistic, then an empty-key terminator (memcached)."""
        frames = self._call(Opcode.STAT, key=group.encode(), multi=True)
        return {f.key.decode(): f.value.decode() for f in frames if f.key}

    def vbucket_info(self, vbucket: int) -> VBucketInfo:
        """``stats vbucket-details <vb>``: state, state CAS, seqnos, snapshot bookkeeping, failover log."""
        s = self.stats(f"vbucket-details {vbucket}")
        log = tuple((int(u), int(q)) for u, q in orjson.loads(s["failover_log"]))
        return VBucketInfo(vbucket, VBucketState(s["state"]), int(s["state_cas"]), int(s["high_seqno"]),
                           int(s["persisted_seqno"]), int(s["snapshot_complete"]),
                           int(s["snapshot_persisted"]), log)

    # ------------------------------------------------------------------ admin
    def set_replication(self, sources: dict[str, tuple[str, int, Sequence[int]]]) -> None:
        """Tell the node which replication streams to pull: ``{source node: (host, port, vbuckets)}`` (private
        SET_REPLICATION). Returns once streams no longer wanted have stopped."""
        body = {n: {"host": h, "port": p, "vbuckets": sorted(vbs)} for n, (h, p, vbs) in sources.items()}
        self._call(Opcode.SET_REPLICATION, value=orjson.dumps({"sources": body}), datatype=0x01)

    def add_stream_takeover(self, source: str, vbucket: int) -> None:
        """DCP_ADD_STREAM with the TAKEOVER flag (docs/rebalance.md "Node processes"): the node's replication link
        from ``source`` re-requests ``vbucket`` as a takeover stream; answers at once (OK or an error)."""
        self._call(Opcode.DCP_ADD_STREAM, vbucket=vbucket, key=source.encode(), extras=U32.pack(0x01))

    def takeover_stats(self, vbucket: int, connection: str) -> dict[str, str]:
        """``stats dcp-vbtakeover <vb> <connection>`` on this (producer) node: status and estimate."""
        return self.stats(f"dcp-vbtakeover {vbucket} {connection}")

    def stop_persistence(self) -> None:
        """STOP_PERSISTENCE (kv_engine): the flusher stops until START_PERSISTENCE."""
        self._call(Opcode.STOP_PERSISTENCE)

    def start_persistence(self) -> None:
        self._call(Opcode.START_PERSISTENCE)

    def flush(self) -> None:
        """Persist everything queued now (private FLUSH_NOW)."""
        self._call(Opcode.FLUSH_NOW)

    def stats_poll(self, group: str, *, clock: Callable[[], float] = time.monotonic) -> StatsPoll:
        """``stats group`` polled without waiting, on a connection of its own (:class:`StatsPoll`)."""
        return StatsPoll(self.host, self.port, group, timeout=self.timeout, clock=clock)

    def dcp_producer(self, name: str, *, buffer_size: int = 0, poll_timeout: float = 0.05) -> RemoteDcpProducer:
        """Open a DCP producer connection named ``name`` on this node."""
        return RemoteDcpProducer(self.host, self.port, name, buffer_size=buffer_size, poll_timeout=poll_timeout,
                                 timeout=self.timeout)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class StatsPoll:
    """One STAT group asked for again and again on a connection of its own, without the asker waiting for the
    node: :meth:`ask` sends the request (one outstanding at most), :meth:`answer` returns the answer once all of
    it arrived and None before. Rollback mitigation's persistence poll of a gateway attached to running nodes
    (gateway/source.py, docs/scale-out.md "Persistence polling"): a node busy flushing answers late, and the
    publishing loop goes on meanwhile instead of waiting for it."""

    def __init__(self, host: str, port: int, group: str, *, timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host, self.port, self.group, self.timeout = host, port, group, timeout
        self.clock = clock
        self._conn: _Connection | None = None
        self._opaque = 0
        #: clock() when the outstanding request was sent (None: none outstanding); the caller's bookkeeping --
        #: waits and the no-answer timeout are real time (time.monotonic), whatever ``clock`` is
        self.asked_at: float | None = None
        self._sent = 0.0
        self._got: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"StatsPoll({self.group!r} {self.host}:{self.port})"

    @property
    def outstanding(self) -> bool:
        return self.asked_at is not None

    def ask(self) -> None:
        """Send the request (nothing when one is outstanding). :class:`NodeUnavailable` when the node cannot
        be reached."""
        if self.asked_at is not None:
            return
        conn = self._conn
        if conn is None or conn.closed:
            conn = self._conn = _Connection(self.host, self.port, self.timeout)
        self._opaque = next(conn.opaques)
        self._got = {}
        conn.send(request(Opcode.STAT, key=self.group.encode(), opaque=self._opaque))
        self._sent = time.monotonic()
        self.asked_at = self.clock()

    def answer(self, wait: float = 0.0) -> dict[str, str] | None:
        """The outstanding request's answer (one entry per statistic) once complete, waiting at most ``wait``
        seconds for it; None before (or when nothing was asked). The node's error for the request as its typed
        exception (e.g. :class:`InvalidArgument` for a group it does not know); :class:`NodeUnavailable` when the
        connection broke or no answer came within the connection timeout."""
        conn = self._conn
        if self.asked_at is None or conn is None:
            return None
        deadline = time.monotonic() + wait
        try:
            while True:
                for f in conn.buf.frames():
                    if f.is_request or f.opaque != self._opaque:
                        continue
                    if f.status != Status.SUCCESS:
                        self.asked_at = None
                        raise error_from(f, 0)
                    if not f.key:  # the terminator: the answer is complete
                        self.asked_at = None
                        return self._got
                    self._got[f.key.decode()] = f.value.decode()
                left = deadline - time.monotonic()
                if not (conn.fill(left) if left > 0 else conn.drain()):
                    if time.monotonic() - self._sent > self.timeout:
                        conn.close()
                        raise NodeUnavailable(f"{self}: no answer within {self.timeout} s")
                    if left <= 0:
                        return None
        except ProtocolError:
            conn.close()
            raise
        except NodeUnavailable:
            self.asked_at = None
            raise

    def close(self) -> None:
        self.asked_at = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@dataclass
class RemoteStream:
    """A stream open on a :class:`RemoteDcpProducer` (the opaque its messages carry)."""

    vbucket: int
    opaque: int
    ready: deque[Message] = field(default_factory=deque)


class RemoteDcpProducer:
    """A DCP producer connection on a node process, duck-typing :class:`engine.dcp.producer.DcpProducer`.

    ``step`` returns the messages that arrived (waiting up to ``poll_timeout`` for the first), decoded to the
    engine's :class:`SnapshotMarker` / :class:`Item` / :class:`StreamEnd`. With ``buffer_size`` the connection
    uses DCP flow control (DCP_CONTROL connection_buffer_size) and ``buffer_acknowledge`` sends
    DCP_BUFFER_ACKNOWLEDGEMENT.
    """

    def __init__(self, host: str, port: int, name: str, *, buffer_size: int = 0, poll_timeout: float = 0.05,
                 timeout: float = 30.0) -> None:
        if not name:
            raise InvalidArgument("a DCP connection needs a name")
        self.name = name
        self.buffer_size = buffer_size
        self.poll_timeout = poll_timeout
        self.streams: dict[int, RemoteStream] = {}
        #: vbucket -> the opaque of its open stream (what the batch decoder matches pushed frames against)
        self._opaques: dict[int, int] = {}
        self._pending: list[Message] = []
        self._conn = _Connection(host, port, timeout)
        # pushed DCP frames decoded in one pass (engine/network/dcp_batch.py: docs/scale-out.md)
        self._conn.buf = DcpFrameBuffer()
        self.items_received = 0
        self.sync_writes = False
        self._call(Opcode.DCP_OPEN, key=name.encode(), extras=OPEN_EXTRAS.pack(0, DCP_OPEN_PRODUCER))
        if buffer_size:
            self._call(Opcode.DCP_CONTROL, key=b"connection_buffer_size", value=str(buffer_size).encode())

    def __repr__(self) -> str:
        return f"RemoteDcpProducer({self.name!r} {self._conn.host}:{self._conn.port} streams={sorted(self.streams)})"

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def _receive(self, timeout: float | None) -> tuple[bool, Frame | None]:
        """Queue the pushed DCP messages of the open streams (the tail of a stream this connection no longer
        has and DCP noops are dropped), waiting at most ``timeout`` for data when no whole frame is buffered.
        Returns (whether anything arrived, the last response frame received: there is at most one outstanding
        request)."""
        conn = self._conn
        buf = conn.buf
        assert isinstance(buf, DcpFrameBuffer)
        try:
            frames, answer = buf.take_dcp(self._opaques, self._pending)
            if frames:
                return True, answer
            if not conn.fill(timeout):
                return False, None
            _frames, answer = buf.take_dcp(self._opaques, self._pending)
        except ProtocolError:
            conn.close()
            raise
        return True, answer

    def _call(self, opcode: int, *, vbucket: int = 0, key: bytes = b"", extras: bytes = b"",
              value: bytes = b"") -> tuple[Frame, int]:
        if self._conn.closed:
            raise EngineClosed(f"connection {self.name!r} is closed")
        opaque = next(self._conn.opaques)
        self._conn.send(request(opcode, key=key, extras=extras, value=value, vbucket=vbucket, opaque=opaque))
        while True:
            arrived, f = self._receive(None)
            if not arrived:
                self._conn.close()
                raise NodeUnavailable(f"{self.name}: no answer to opcode 0x{opcode:02x}")
            if f is not None and f.opaque == opaque:
                if f.status != Status.SUCCESS:
                    raise error_from(f, vbucket)
                return f, opaque

    # ------------------------------------------------------------------ DcpProducer API
    def stream_request(
        self, vbucket: int, start_seqno: int, end_seqno: int = MAX_SEQNO, vbuuid: int = 0,
        snap_start: int | None = None, snap_end: int | None = None, *, flags: StreamFlags | int = StreamFlags.NONE,
        opaque: int = 0, failover_log: Sequence[FailoverEntry] | None = None,
    ) -> list[FailoverEntry]:
        """DCP_STREAM_REQ; the failover log on OK, :class:`RollbackRequired` on ROLLBACK, typed errors
        otherwise (``opaque`` is chosen by the connection)."""
        snap_start = start_seqno if snap_start is None else snap_start
        snap_end = start_seqno if snap_end is None else snap_end
        existing = self.streams.get(vbucket)
        if existing is not None:
            raise KeyExists(f"a stream for vbucket {vbucket} is already open on {self.name!r}")
        ex, val = encode_stream_request(start_seqno, end_seqno, vbuuid, snap_start, snap_end, int(flags),
                                        failover_log)
        opq = next(self._conn.opaques)
        # Register before sending: pushed messages for the stream may follow the OK in the same read.
        self.streams[vbucket] = RemoteStream(vbucket, opq)
        self._opaques[vbucket] = opq
        try:
            self._conn.send(request(Opcode.DCP_STREAM_REQ, extras=ex, value=val, vbucket=vbucket, opaque=opq))
            while True:
                arrived, f = self._receive(None)
                if not arrived:
                    self._conn.close()
                    raise NodeUnavailable(f"{self.name}: no answer to a stream request")
                if f is not None and f.opaque == opq:
                    if f.status != Status.SUCCESS:
                        raise error_from(f, vbucket)
                    return decode_failover_log(f.value)
        except BaseException:
            if self.streams.get(vbucket) is not None and self.streams[vbucket].opaque == opq:
                del self.streams[vbucket]
                del self._opaques[vbucket]
            raise

    def step(self, max_messages: int = 4096) -> list[Message]:
        """The messages received (waiting up to ``poll_timeout`` when none is buffered)."""
        if self._conn.closed:
            return []
        if not self._pending:
            _arrived, f = self._receive(self.poll_timeout)
            if f is not None:
                raise ProtocolError(f"{self.name}: unexpected response opcode 0x{f.opcode:02x}")
        pending = self._pending
        if len(pending) <= max_messages:
            out, self._pending = pending, []
        else:
            out = pending[:max_messages]
            del pending[:max_messages]
        items = len(out)
        for m in out:  # one type check a message, no queue operations
            if type(m) is not Item:
                items -= 1
                if type(m) is StreamEnd and m.vbucket in self.streams:
                    del self.streams[m.vbucket]
                    del self._opaques[m.vbucket]
        self.items_received += items
        return out

    def control(self, key: str, value: str) -> None:
        """DCP_CONTROL (``enable_sync_writes``, ``consumer_name``, ``connection_buffer_size``)."""
        self._call(Opcode.DCP_CONTROL, key=key.encode(), value=value.encode())
        if key == "enable_sync_writes":
            self.sync_writes = value == "true"

    def seqno_acknowledged(self, vbucket: int, seqno: int) -> int:
        """DCP_SEQNO_ACKNOWLEDGED (docs/durability.md; no answer, as kv_engine). Returns 0: the commits happen on the
        node."""
        if not self._conn.closed:
            self._conn.send(request(Opcode.DCP_SEQNO_ACKNOWLEDGED, extras=U64.pack(seqno), vbucket=vbucket))
        return 0

    def buffer_acknowledge(self, nbytes: int) -> None:
        """DCP_BUFFER_ACKNOWLEDGEMENT (sent only when flow control is on, as kv_engine clients do)."""
        if nbytes < 0:
            raise InvalidArgument("cannot acknowledge a negative number of bytes")
        if self.buffer_size and nbytes and not self._conn.closed:
            self._conn.send(request(Opcode.DCP_BUFFER_ACKNOWLEDGEMENT, extras=U32.pack(nbytes)))

    def close_stream(self, vbucket: int) -> None:
        """DCP_CLOSE_STREAM (NOT_MY_VBUCKET when no stream is open)."""
        self._call(Opcode.DCP_CLOSE_STREAM, vbucket=vbucket)

    def discard_stream(self, vbucket: int) -> None:
        """Forget a stream closed at the consumer's request and what was received of it. The node counted the
        dropped messages against the connection's flow-control buffer when it pushed them: their bytes are
        buffer-acknowledged here, or every close would shrink the window for good (a group member closes all
        its streams at each in-process recovery, docs/scale-out.md "Delivery within the lease")."""
        self.streams.pop(vbucket, None)
        self._opaques.pop(vbucket, None)
        if any(m.vbucket == vbucket for m in self._pending):
            dropped = sum(m.dcp_size for m in self._pending if m.vbucket == vbucket)
            self._pending = [m for m in self._pending if m.vbucket != vbucket]
            self.buffer_acknowledge(dropped)

    def get_failover_log(self, vbucket: int) -> list[FailoverEntry]:
        f, _ = self._call(Opcode.DCP_GET_FAILOVER_LOG, vbucket=vbucket)
        return decode_failover_log(f.value)

    # ------------------------------------------------------------------ takeover acks (engine/dcp/takeover.py)
    def _respond(self, opcode: int, vbucket: int) -> None:
        # kv_engine: the consumer answers a pushed marker with ACK / a SET_VBUCKET_STATE with a response
        # carrying the stream's opaque; the producer finds the stream by it (DcpProducer::handleResponse).
        s = self.streams.get(vbucket)
        if s is None:
            raise NotMyVBucket(f"{self.name}: no stream for vbucket {vbucket}")
        if not self._conn.closed:
            self._conn.send(response(opcode, opaque=s.opaque))

    def snapshot_marker_ack(self, vbucket: int) -> None:
        self._respond(Opcode.DCP_SNAPSHOT_MARKER, vbucket)

    def set_vbucket_state_ack(self, vbucket: int) -> None:
        self._respond(Opcode.DCP_SET_VBUCKET_STATE, vbucket)

    @property
    def has_work(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        """Disconnect: the node ends every stream of this connection."""
        self.streams.clear()
        self._opaques.clear()
        self._pending.clear()
        self._conn.close()


def connect(address: str, **kwargs: Any) -> RemoteNode:
    """``RemoteNode`` for ``host:port``."""
    host, _, port = address.rpartition(":")
    return RemoteNode(host or "127.0.0.1", int(port), **kwargs)


__all__ = ["NodeObserve", "NodeUnavailable", "RemoteDcpProducer", "RemoteNode", "RemoteStream", "StatsPoll", "connect"]
