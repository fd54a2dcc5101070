"""A node process whose disk fills (engine/network/server.py ``_flusher``, docs/reliability.md "Full disk on a
node"): it keeps serving, says so once in its log and in its stats (``flush_failures``, ``flush_error``), retries
with a pause that grows up to ``FLUSH_RETRY_MAX_S`` (not a warning every 10 ms), and once the disk has room again
persists everything it acknowledged -- which a SIGKILL and a restart then find. Real process, real fault:
RLIMIT_FSIZE of the running node and its storage writer process lowered with prlimit(2) to the size of its largest
data file, then lifted. And a node whose storage writer process is frozen (SIGSTOP) keeps serving the same way."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from bench.chaos import cap_file_size
from engine import SnapshotMarker
from engine.network.process_cluster import ProcessCluster
from schemas.dcp import SnapshotFlags
from tests.engine.nodes import wait_for

pytestmark = pytest.mark.slow

CLUSTER = ProcessCluster
CLUSTER_DEFAULTS: dict[str, Any] = {"num_vbuckets": 4}


def _persisted_everything(c: ProcessCluster) -> bool:
    infos = [c.client("n0").vbucket_info(vb) for vb in range(4)]
    return all(i.persisted_seqno == i.high_seqno for i in infos)


def test_a_node_with_a_full_disk_keeps_serving_says_it_once_and_loses_nothing(make_cluster) -> None:
    c = make_cluster(nodes=1, replicas=0)
    node = c.node("n0")
    assert node.pid is not None
    log = node.data_dir.parent / "n0.log"
    docs: dict[str, bytes] = {}
    for i in range(20):
        docs[f"before{i}"] = json.dumps({"n": i}).encode()
        c.write(f"before{i}", docs[f"before{i}"])
    wait_for(lambda: _persisted_everything(c))

    # The disk is full: no file of the node's data directory can grow.
    largest = max(f.stat().st_size for f in node.data_dir.rglob("*") if f.is_file())
    cap_file_size(node.pid, largest)  # the process and its storage writer process
    try:
        pad = "x" * 2000
        i = 0
        deadline = time.monotonic() + 30
        while int(c.client("n0").stats()["flush_failures"]) == 0:  # writes until a flush needs more room
            assert time.monotonic() < deadline, "no flush failed with the data directory's files capped"
            for _ in range(50):
                key = f"during{i}"
                docs[key] = json.dumps({"n": i, "pad": pad}).encode()
                c.write(key, docs[key])  # acknowledged: in memory, not durable
                i += 1
            time.sleep(0.05)
        time.sleep(1.5)  # a few retry pauses
        stats = c.client("n0").stats()
        assert stats["flush_error"], stats
        failures = int(stats["flush_failures"])
        # retried with a growing pause: not a failure per 10 ms flush interval (150 in 1.5 s)
        assert 1 <= failures <= 15, failures
        assert not _persisted_everything(c)
        # still serving reads and writes meanwhile
        assert c.get("during0").value == docs["during0"]
        docs["while-full"] = b'{"late": true}'
        c.write("while-full", docs["while-full"])
        text = log.read_text(errors="replace")
        assert text.count("persisting failed") == 1, text[-3000:]
    finally:
        cap_file_size(node.pid, None)

    # Room again: everything acknowledged is persisted, the error clears, the log says so once.
    wait_for(lambda: _persisted_everything(c), timeout=30)
    stats = c.client("n0").stats()
    assert stats["flush_error"] == "" and int(stats["flush_failures"]) >= failures, stats
    wait_for(lambda: "persisting works again" in log.read_text(errors="replace"))

    c.kill("n0")
    c.restart("n0")
    for key, value in docs.items():
        assert c.get(key).value == value, key


def test_a_node_whose_storage_writer_is_stopped_keeps_serving_and_persists_after(make_cluster) -> None:
    """The storage's writer process frozen (SIGSTOP: a stalled disk, a stopped process): the node's event loop
    does not wait for it -- writes, reads, stats, DCP stream requests and their backfills are answered, nothing
    counts as persisted meanwhile -- and once it runs again everything written is persisted."""
    c = make_cluster(nodes=1, replicas=0)
    c.write("before", b'{"n": 0}')
    wait_for(lambda: _persisted_everything(c))
    c.kill("n0")
    c.restart("n0")  # warmed up from disk: a stream from 0 needs a backfill
    cl = c.client("n0")
    wait_for(lambda: int(cl.stats()["storage_writer_pid"]) > 0)  # started ahead by the node's flusher task
    writer = int(cl.stats()["storage_writer_pid"])
    os.kill(writer, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for i in range(50):
            c.write(f"during{i}", b'{"n": 1}')
        assert c.get("during7").value == b'{"n": 1}'
        assert int(cl.stats()["storage_writer_pid"]) == writer
        time.sleep(0.3)  # the node's flusher has handed a flush to the stopped process: it is in flight
        assert not _persisted_everything(c)
        p = c.dcp_producer("n0", "while-stopped")
        p.stream_request(c.vbucket_of("before"), 0)
        got: list[Any] = []
        while not any(getattr(m, "key", None) == b"before" for m in got):
            assert time.monotonic() - t0 < 5, f"the stream's backfill waited for the stopped writer: {got}"
            got += p.step(100)
        assert isinstance(got[0], SnapshotMarker) and got[0].flags & SnapshotFlags.DISK, got[0]  # a backfill
        assert time.monotonic() - t0 < 5, "a request waited for the stopped writer process"
    finally:
        os.kill(writer, signal.SIGCONT)
    wait_for(lambda: _persisted_everything(c), timeout=30)
    assert int(cl.stats()["storage_writer_pid"]) == writer  # the same process, not replaced
