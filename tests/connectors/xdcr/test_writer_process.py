"""The writer process (connectors/xdcr/writer_process.py): typed errors back from the child, later batches
skipped until reset, a new connection attempt after reset; against a real node process, batches pipelined in
order with their answers."""

from __future__ import annotations

import socket
import zlib
from pathlib import Path

import pytest

from connectors.xdcr.connection import Credentials
from connectors.xdcr.document import DocVersion
from connectors.xdcr.errors import TargetUnreachable
from connectors.xdcr.mcbp import Status
from connectors.xdcr.target import WriteOp
from connectors.xdcr.writer_process import Skipped, WriterProcess
from engine.network.process_cluster import NodeProcess

NVB = 4


def _op(i: int, rev: int = 1) -> WriteOp:
    key = b"k%d" % i
    return WriteOp(((zlib.crc32(key) >> 16) & 0x7FFF) % NVB,  # the key's vbucket (the node has no cluster map)
                   DocVersion(key, 1000 + rev, rev, 0, 0, False, 1, b'{"v": %d}' % rev))


def test_errors_come_back_typed_and_later_batches_wait_for_a_reset() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = WriterProcess(f"couchbase://127.0.0.1:{port}", Credentials(None, None), timeout=2.0)
    try:
        first, second = w.submit([_op(1)]), w.submit([_op(2)])
        with pytest.raises(TargetUnreachable):
            first.result(timeout=30)
        with pytest.raises(Skipped):
            second.result(timeout=30)
        w.reset()
        with pytest.raises(TargetUnreachable):  # it connects again
            w.submit([_op(1)]).result(timeout=30)
    finally:
        w.close()


def test_pipelined_batches_are_written_in_order(tmp_path: Path) -> None:
    node = NodeProcess("t", tmp_path / "t", NVB)
    node.start()
    w = WriterProcess(f"couchbase://127.0.0.1:{node.port}", Credentials(None, None))
    try:
        # the same keys in three batches, each a newer version: all accepted only if applied in order
        futs = [w.submit([_op(i, rev) for i in range(50)]) for rev in (1, 2, 3)]
        for f in futs:
            out = f.result(timeout=60)
            assert [r[1] for r in out.results] == [Status.SUCCESS] * 50
        out = w.submit([_op(i, 2) for i in range(50)]).result(timeout=60)  # behind what the target holds
        assert {r[1] for r in out.results} == {Status.KEY_EEXISTS}
    finally:
        w.close()
        node.kill()
