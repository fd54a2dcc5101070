"""Bidirectional XDCR A <-> B (docs/xdcr.md "Bidirectional"): concurrent conflicting writes on both clusters;
after replication in both directions both clusters hold the same winner -- document and metadata -- for every
key, in both conflict-resolution modes, and the replication stops by itself (loop prevention: a document
replicated back is rejected as identical, so it never becomes a new mutation)."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import pytest

from connectors.xdcr.document import ConflictMode
from connectors.xdcr.replicator import XdcrReplicator, XdcrSettings
from engine import vbucket_of
from gateway.broker import Broker
from tests.connectors.xdcr.harness import ClusterSide, target_docs

pytestmark = pytest.mark.slow

KEYS = [f"k{i}" for i in range(40)]


def _replicate(src: ClusterSide, dst: ClusterSide, state: Path, mode: str) -> dict[str, Any]:
    src.publish()
    with XdcrReplicator(src.client, src.topic, dst.url, state,
                        settings=XdcrSettings(conflict_resolution=ConflictMode(mode), batch_docs=16)) as r:
        r.run(until_caught_up=True)
        return r.metrics.to_dict()


@pytest.mark.parametrize("mode", ["seqno", "lww"])
def test_concurrent_conflicting_writes_converge_to_one_winner(kafka_broker: Broker, tmp_path: Path,
                                                              mode: str) -> None:
    rng = random.Random(7)
    a = ClusterSide(kafka_broker, tmp_path / "a", mode)
    b = ClusterSide(kafka_broker, tmp_path / "b", mode)
    try:
        for rnd in range(3):
            for side, name in ((a, "a"), (b, "b")):
                for k in rng.sample(KEYS, 25):
                    if rng.random() < 0.15:
                        with contextlib.suppress(Exception):
                            side.cluster.delete(k)
                    else:
                        for _ in range(rng.randint(1, 3)):  # more revisions on one side than the other
                            side.cluster.write(k, f'{{"from": "{name}", "round": {rnd}}}'.encode(),
                                               flags=rng.randint(0, 3))
            _replicate(a, b, tmp_path / "ab", mode)
            _replicate(b, a, tmp_path / "ba", mode)
        # quiescence: another round in both directions writes nothing (identical metadata rejected)
        highs = (a.high_seqnos(), b.high_seqnos())
        ab = _replicate(a, b, tmp_path / "ab", mode)
        ba = _replicate(b, a, tmp_path / "ba", mode)
        assert (a.high_seqnos(), b.high_seqnos()) == highs
        keys = {k.encode(): vbucket_of(k.encode(), a.nvb) for k in KEYS}
        # a tombstone's flags are not on the DCP wire (a deletion carries by seqno, rev seqno, delete time):
        # compared without them (docs/xdcr.md "What differs")
        da, db = ({k: (d if not d[5] else (*d[:3], 0, *d[4:])) for k, d in target_docs(n, keys).items()}
                  for n in (a.node, b.node))
        assert da == db, {k: (da.get(k), db.get(k)) for k in keys if da.get(k) != db.get(k)}
        winners = {v[0] for v in da.values() if v[0] is not None}
        assert any(b'"from": "a"' in w for w in winners) and any(b'"from": "b"' in w for w in winners)
        print(f"\nbidirectional {mode}: a->b {ab['written']} written {ab['rejected']}, "
              f"b->a {ba['written']} written {ba['rejected']}")
    finally:
        a.close()
        b.close()
