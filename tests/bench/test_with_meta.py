"""The raw with-meta sender (bench/with_meta.py) the XDCR bench uses as its baseline, against a node process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.with_meta import MetaDoc, make_docs, send_with_meta
from engine.exceptions import Status
from engine.kv.conflict_resolution import ItemMeta
from engine.network.process_cluster import NodeProcess

NVB = 4


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess("t0", tmp_path / "t0", NVB)
    n.start()
    yield n
    n.kill()


def test_pipelined_writes_with_meta_are_all_answered(node: NodeProcess) -> None:
    docs = make_docs(2000, NVB)
    run = send_with_meta(node.host, node.port, docs, window=64)
    assert (run.sent, run.accepted, run.rejected) == (2000, 2000, 0) and run.rate > 0
    # the same documents again: every one is an identical echo (KEY_EEXISTS), nothing is written
    again = send_with_meta(node.host, node.port, docs, window=64)
    assert (again.accepted, again.rejected) == (0, 2000)
    stats = node.require().stats()
    assert (stats["accepted"], stats["rejected_identical"]) == ("2000", "2000")
    # deletions (a None value) go as DEL_WITH_META
    d = docs[0]
    gone = send_with_meta(node.host, node.port, [MetaDoc(d.key, None, d.vbucket, ItemMeta(d.meta.cas + 1, 2))])
    assert gone.statuses == {Status.SUCCESS: 1}
    assert node.require().get_meta(d.key, vbucket=d.vbucket).deleted
