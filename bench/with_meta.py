"""The raw rate of writes with meta straight to an XDCR target: ``python -m bench.with_meta [--docs N]``.

The baseline ``bench.xdcr`` compares the replicator against (docs/xdcr.md "Target side"): N SET_WITH_META
frames sent over one connection, pipelined (at most ``window`` unanswered), to one node process -- no topic, no
batching logic, no checkpoints. :func:`send_with_meta` is the reusable part; it works against any endpoint that
speaks the opcodes (a node process, the KV port).

Figures:

* ``xdcr.raw_with_meta``  SET_WITH_META docs/s to a node process vs pipelined plain SETs of the same documents to
  a second, fresh node in the same run (information: ``target`` null)
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import figure
from engine.exceptions import Status
from engine.kv.conflict_resolution import ItemMeta
from engine.kv.vbucket import vbucket_of
from engine.network.process_cluster import NodeProcess
from engine.network.protocol import (
    SET_EXTRAS,
    FrameBuffer,
    Opcode,
    encode_with_meta_extras,
    request,
)

VALUE_SIZE = 256
#: a CAS far ahead of the wall clock's HLC, so the documents are never behind a target's own writes
BASE_CAS = 1 << 62


@dataclass(frozen=True, slots=True)
class MetaDoc:
    """One document to write with meta: key, body (None: a deletion), its vbucket on the target and metadata."""

    key: bytes
    value: bytes | None
    vbucket: int
    meta: ItemMeta


@dataclass
class WithMetaRun:
    """What one :func:`send_with_meta` run got back: answers by status, and the wall time."""

    sent: int = 0
    seconds: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def accepted(self) -> int:
        return self.statuses.get(Status.SUCCESS, 0)

    @property
    def rejected(self) -> int:
        return self.statuses.get(Status.KEY_EEXISTS, 0)

    @property
    def rate(self) -> float:
        return self.sent / self.seconds if self.seconds > 0 else 0.0


def make_docs(n: int, num_vbuckets: int, *, value_size: int = VALUE_SIZE, prefix: str = "xdcr") -> list[MetaDoc]:
    """``n`` JSON documents of ``value_size`` bytes with distinct source CASes (rev seqno 1)."""
    body = b'{"name": "' + b"x" * max(0, value_size - 12) + b'"}'
    out = []
    for i in range(n):
        k = f"{prefix}::{i:010d}".encode()
        out.append(MetaDoc(k, body, vbucket_of(k, num_vbuckets), ItemMeta(BASE_CAS + i, 1, 0, 0, 0x01)))
    return out


def _frames(docs: Iterable[MetaDoc], options: int) -> Iterator[bytes]:
    for i, d in enumerate(docs):
        m = d.meta
        extras = encode_with_meta_extras(m.flags, m.expiry, m.rev_seqno, m.cas, options)
        if d.value is None:
            yield request(Opcode.DEL_WITH_META, key=d.key, extras=extras, vbucket=d.vbucket, opaque=i)
        else:
            yield request(Opcode.SET_WITH_META, key=d.key, extras=extras, value=d.value, datatype=m.datatype,
                          vbucket=d.vbucket, opaque=i)


def _plain_frames(docs: Iterable[MetaDoc]) -> Iterator[bytes]:
    for i, d in enumerate(docs):
        yield request(Opcode.SET, key=d.key, extras=SET_EXTRAS.pack(0, 0), value=d.value or b"",
                      vbucket=d.vbucket, opaque=i)


def send_pipelined(host: str, port: int, frames: Iterable[bytes], *, window: int = 512,
                   timeout: float = 60.0) -> WithMetaRun:
    """Send ``frames`` (requests with distinct opaques) over one connection, at most ``window`` unanswered,
    and count the answers by status."""
    run = WithMetaRun()
    buf = FrameBuffer()
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    outstanding = 0
    pending: list[bytes] = []

    def read() -> int:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError(f"{host}:{port} closed the connection")
        buf.feed(data)
        n = 0
        for f in buf.frames():
            run.statuses[f.status] = run.statuses.get(f.status, 0) + 1
            n += 1
        return n

    t0 = time.perf_counter()
    try:
        for fr in frames:
            pending.append(fr)
            run.sent += 1
            if len(pending) >= 64 or outstanding + len(pending) >= window:
                sock.sendall(b"".join(pending))
                outstanding += len(pending)
                pending.clear()
                while outstanding >= window:
                    outstanding -= read()
        if pending:
            sock.sendall(b"".join(pending))
            outstanding += len(pending)
        while outstanding > 0:
            outstanding -= read()
    finally:
        run.seconds = time.perf_counter() - t0
        sock.close()
    return run


def send_with_meta(host: str, port: int, docs: Iterable[MetaDoc], *, options: int = 0,
                   window: int = 512) -> WithMetaRun:
    """SET_WITH_META (DEL_WITH_META for a None value) of every document, pipelined over one connection."""
    return send_pipelined(host, port, _frames(docs, options), window=window)


def raw_rate(host: str, port: int, docs: list[MetaDoc], *, options: int = 0, window: int = 512) -> float:
    """Documents/s of :func:`send_with_meta` (the XDCR bench's baseline)."""
    return send_with_meta(host, port, docs, options=options, window=window).rate


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.with_meta", description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--num-vbuckets", type=int, default=64)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args(argv)
    docs = make_docs(args.docs, args.num_vbuckets)
    with tempfile.TemporaryDirectory() as d:
        nodes = [NodeProcess(f"t{i}", Path(d) / f"t{i}", args.num_vbuckets, {"tune_gc": True}) for i in range(2)]
        try:
            for n in nodes:
                n.start()
            meta = send_with_meta(nodes[0].host, nodes[0].port, docs, window=args.window)
            plain = send_pipelined(nodes[1].host, nodes[1].port, _plain_frames(docs), window=args.window)
            if meta.accepted != len(docs) or plain.statuses.get(Status.SUCCESS, 0) != len(docs):
                raise SystemExit(f"not every write was accepted: {meta.statuses} / {plain.statuses}")
        finally:
            for n in nodes:
                n.kill()
    figure("xdcr.raw_with_meta", meta.rate, "docs/s", plain.rate, None, "higher")


if __name__ == "__main__":
    main()
