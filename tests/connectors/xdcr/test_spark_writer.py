"""The Spark job's batch writer (connectors/xdcr/spark_job.py ``XdcrBatchWriter.write_rows``) fed rows of the
``dcp`` source's schema directly, against a real target node process: a target that restarts mid-run with a new
vbuuid and without the writes it had not persisted gets them again in the same batch; a batch id is applied
once; filters and the restream choice on a filter change. (Spark itself runs in test_spark_job.py.)"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.xdcr.errors import FilterChanged
from connectors.xdcr.filters import Filters
from connectors.xdcr.spark_job import XdcrBatchWriter
from engine import vbucket_of
from tests.connectors.xdcr.harness import target_docs, target_node

NVB = 8


class Source:
    """Rows as the ``dcp`` source hands them (one Kafka partition per vbucket)."""

    def __init__(self) -> None:
        self.seqno = dict.fromkeys(range(NVB), 0)
        self.offset = itertools.count()
        self.cas = itertools.count(1_000_000)

    def row(self, key: str, rev: int, op: str = "mutation", value: bytes | None = None) -> dict[str, Any]:
        k = key.encode()
        vb = vbucket_of(k, NVB)
        self.seqno[vb] += 1
        body = None if op != "mutation" else (value or json.dumps({"k": key, "rev": rev}).encode())
        return {"op": op, "key": k, "value": body, "vbucket": vb, "vbuuid": 7, "seqno": self.seqno[vb],
                "snap_start": self.seqno[vb], "snap_end": self.seqno[vb], "rev": rev, "cas": next(self.cas),
                "kafka_partition": vb, "kafka_offset": next(self.offset), "flags": 0, "expiry": 0,
                "datatype": 1 if op == "mutation" else 0}


class Forwarder:
    """A fixed local address forwarding to the target node's current port: the node process listens on a new
    port at every start, a real node keeps its address."""

    def __init__(self, port_of: Callable[[], int]) -> None:
        self.port_of = port_of
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.port_of()), timeout=5)
                u.settimeout(None)
            except OSError:
                c.close()
                continue
            self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    n = target_node(tmp_path, "t", nvb=NVB)
    yield n
    n.kill()


def expect(node: Any, rows: list[dict[str, Any]]) -> None:
    """The target holds the newest row of every key, with its metadata."""
    newest = {r["key"]: r for r in rows}
    got = target_docs(node, {k: r["vbucket"] for k, r in newest.items()})
    for k, r in newest.items():
        deleted = r["op"] != "mutation"
        assert got[k] == (r["value"], r["cas"], r["rev"], 0, 0, deleted), (k, got[k], r)


def test_target_restart_mid_run_resends_what_it_lost(node: Any, tmp_path: Path) -> None:
    src = Source()
    fwd = Forwarder(lambda: int(node.port))
    url = f"couchbase://127.0.0.1:{fwd.port}"
    w = XdcrBatchWriter(url, tmp_path / "chk")
    try:
        b0 = [src.row(f"k{i}", 1) for i in range(30)]
        assert w.write_rows(lambda: b0, 0)
        node.require().stop_persistence()
        b1 = [src.row(f"k{i}", 2) for i in range(30)] + [src.row(f"big{i}", 1, value=b'{"p": "%s"}' % (b"x" * 400))
                                                         for i in range(5)]
        assert w.write_rows(lambda: b1, 1)
        assert w.metrics.get_meta == 5  # above the optimistic threshold: asked first
        node.kill()
        node.start()  # unclean warmup: batch 1 is gone, every vbucket on a new vbuuid
        b2 = [src.row(f"n{i}", 1) for i in range(30)]  # answered with the new vbuuids: the job checks the history
        assert w.write_rows(lambda: b2, 2)  # (the connection was lost: retried on a new one)
        assert w.resent >= 35 and w.metrics.retries >= 1, w.summary()
        expect(node, b0 + b1 + b2)
        assert not w.write_rows(lambda: b2, 2) and w.skipped_batches == 1  # idempotent per batch id
        # a new writer on the same checkpoint location: positions hold, nothing to resend
        w2 = XdcrBatchWriter(url, tmp_path / "chk")
        w2.prepare()
        assert w2.resent == 0
        w2.close()
    finally:
        w.close()
        fwd.close()


def test_filters_and_the_restream_choice(node: Any, tmp_path: Path) -> None:
    src = Source()
    url, chk = f"couchbase://127.0.0.1:{node.port}", tmp_path / "chk"
    rows = [src.row("a1", 1), src.row("b1", 1), src.row("b2", 1), src.row("b2", 2, op="deletion"),
            src.row("b3", 1), src.row("b3", 2, op="expiration"), src.row("b4", 1, value=b"\x00binary")]
    rows[-1]["datatype"] = 0
    w = XdcrBatchWriter(url, chk, filters=Filters("^b", skip_deletions=True, skip_expirations=True,
                                                  skip_binary=True))
    try:
        assert w.write_rows(lambda: rows, 0)
        assert w.metrics.filtered == 4 and w.metrics.written == 3, w.summary()
        assert set(target_docs(node, {r["key"]: r["vbucket"] for r in rows})) == {b"b1", b"b2", b"b3"}
    finally:
        w.close()
    (chk / "spark" / "offsets").mkdir(parents=True)  # Spark's offsets, as its checkpoint location keeps them
    with pytest.raises(FilterChanged, match="--restream"):
        XdcrBatchWriter(url, chk, filters=Filters("^a")).settle_filters()
    XdcrBatchWriter(url, chk, filters=Filters("^a"), restream=False).settle_filters()
    assert (chk / "spark").exists()
    w3 = XdcrBatchWriter(url, chk, filters=Filters("^a"))  # the recorded filters are now ^a: no question
    w3.settle_filters()
    w4 = XdcrBatchWriter(url, chk, filters=Filters(), restream=True)
    try:
        w4.prepare()
        assert not (chk / "spark").exists()  # Spark starts from the topic's beginning
        assert w4.write_rows(lambda: rows, 0)  # batch ids start again
        assert w4.metrics.written >= 1 and w4.metrics.filtered == 0
    finally:
        w4.close()
