"""The XDCR replicator (connectors/xdcr) from a gateway topic into a target node process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from connectors.xdcr.replicator import XdcrReplicator, XdcrSettings, read_status
from engine import vbucket_of
from tests.connectors.xdcr.harness import diverging, source_docs, target_docs, target_node
from tests.harness import Harness, write


def replicate(h: Harness, node: Any, state: Path, **kw: Any) -> dict[str, Any]:
    with XdcrReplicator(h.client, h.topic, f"couchbase://127.0.0.1:{node.port}", state,
                        settings=XdcrSettings(**kw)) as r:
        r.run(until_caught_up=True)
        return r.status()


def check_equal(h: Harness, node: Any) -> dict[bytes, Any]:
    src = source_docs(h.bucket)
    keys = {k: vbucket_of(k, h.nvb) for k in src}
    tgt = target_docs(node, keys)
    bad = diverging(src, tgt)
    assert not bad, list(bad.items())[:5]
    return src


def test_replicates_documents_with_their_metadata(harness: Harness, target: Any, tmp_path: Path) -> None:
    h = harness
    write(h.bucket, 300)
    h.bucket.flush_all()
    h.settle()
    st = replicate(h, target, tmp_path / "state")
    src = check_equal(h, target)
    assert st["counters"]["written"] == len(src)
    # a second run writes nothing new
    st2 = replicate(h, target, tmp_path / "state")
    assert st2["counters"]["written"] == st["counters"]["written"]
    assert read_status(tmp_path / "state")["counters"]["written"] == len(src)


@pytest.mark.parametrize("writer_process", [True, False], ids=["writer-process", "writer-thread"])
def test_rollback_restores_lost_branch_documents(harness: Harness, target: Any, tmp_path: Path,
                                                 writer_process: bool) -> None:
    h = harness
    write(h.bucket, 100)
    h.bucket.flush_all()
    h.settle()
    replicate(h, target, tmp_path / "state", writer_process=writer_process)
    write(h.bucket, 60, start=50)  # overwrites + new keys, published but never persisted
    h.publish_unpersisted()
    replicate(h, target, tmp_path / "state", writer_process=writer_process)
    h.crash_engine()  # the source loses them: rollback records in the topic
    write(h.bucket, 10, start=5000)
    h.bucket.flush_all()
    h.settle()
    st = replicate(h, target, tmp_path / "state", writer_process=writer_process)
    assert st["counters"]["rollbacks"] > 0 and st["counters"]["restored"] > 0
    check_equal(h, target)


def test_target_that_lost_history_resumes_from_an_older_checkpoint(harness: Harness, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The target node is killed with writes it never persisted: it warms up with a new failover entry below
    the replicator's target positions; those vbuckets resume from the newest checkpoint the target still holds
    (or zero) and the lost documents are written again."""
    h = harness
    node = target_node(tmp_path, "lossy")
    try:
        write(h.bucket, 80)
        h.bucket.flush_all()
        h.settle()
        state = tmp_path / "state"
        replicate(h, node, state, checkpoint_interval=0)
        node.require().stop_persistence()
        write(h.bucket, 80, start=1000)
        h.bucket.flush_all()
        h.settle()
        replicate(h, node, state, checkpoint_interval=3600)  # no new checkpoint: only target positions move
        node.kill()
        node.start()  # unclean warmup: the unpersisted writes are gone, a new failover entry
        assert diverging(source_docs(h.bucket), target_docs(node, {k: vbucket_of(k, h.nvb)
                                                                   for k in source_docs(h.bucket)}))
        with caplog.at_level("WARNING", logger="connectors.xdcr.replicator"):
            replicate(h, node, state)
        lost = [r.getMessage() for r in caplog.records if "lost the history" in r.getMessage()]
        assert lost and any("from the checkpoint at seqno" in m for m in lost), lost
        check_equal(h, node)
    finally:
        node.kill()
