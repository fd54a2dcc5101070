"""The writer process (connectors/xdcr/writer_process.py): typed errors back from the child, later batches
skipped until reset, a new connection attempt after reset; against a real node process, batches pipelined in
order with their answers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
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
from tests.harness import process_gone

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


#: a replicator: writes one batch of SIZE documents through its writer process, says the child's pid, waits
#: for a line on stdin, then queues BATCHES more batches of new documents and dies (SIGKILL) with them in the pipe
_DYING_REPLICATOR = textwrap.dedent("""
    import os, signal, sys, zlib
    from connectors.xdcr.connection import Credentials
    from connectors.xdcr.document import DocVersion
    from connectors.xdcr.target import WriteOp
    from connectors.xdcr.writer_process import WriterProcess
    port, batches, size, nvb = map(int, sys.argv[1:])
    w = WriterProcess(f"couchbase://127.0.0.1:{port}", Credentials(None, None))
    def op(i):
        key = b"k%d" % i
        return WriteOp(((zlib.crc32(key) >> 16) & 0x7FFF) % nvb,
                       DocVersion(key, 1000, 1, 0, 0, False, 1, b'{"v": 1}'))
    w.submit([op(i) for i in range(size)]).result(timeout=60)
    print(w._proc.pid, flush=True)
    sys.stdin.readline()
    for b in range(1, batches + 1):
        w.submit([op(b * size + i) for i in range(size)])
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_replicators_queued_batches_are_not_written_by_its_orphan(tmp_path: Path) -> None:
    """kill -9 of the replicator with batches queued: its writer process stops at the next batch (it checks that
    the replicator is still its parent) instead of writing the queue behind the next replicator's back. The
    writer process is stopped (SIGSTOP) while the replicator queues its batches and dies, then continued."""
    node = NodeProcess("t", tmp_path / "t", NVB)
    node.start()
    batches, size = 20, 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    replicator = subprocess.Popen([sys.executable, "-c", _DYING_REPLICATOR, str(node.port), str(batches),
                                   str(size), str(NVB)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    child = 0
    try:
        assert replicator.stdin is not None and replicator.stdout is not None
        child = int(replicator.stdout.readline())
        assert int(node.require().stats()["items"]) == size  # the first batch, answered
        os.kill(child, signal.SIGSTOP)
        replicator.stdin.write(b"go\n")
        replicator.stdin.flush()
        assert replicator.wait(60) == -signal.SIGKILL
        os.kill(child, signal.SIGCONT)
        assert process_gone(child, timeout=30), "the orphaned writer process went on"
        time.sleep(0.2)  # a write the node would still be answering
        written = int(node.require().stats()["items"])
        assert written == size, f"{written - size} documents of the {batches} x {size} queued were written"
    finally:
        if replicator.poll() is None:
            replicator.kill()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        node.kill()
