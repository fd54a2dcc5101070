"""The vbucket map: balanced deterministic generation, no double copies, JSON round trip, revisions, bad shapes."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import InvalidArgument
from engine.cluster.vbucket_map import VBucketMap


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("replicas", [0, 1, 2, 3])
@pytest.mark.parametrize("num_vbuckets", [1, 8, 64, 1024])
def test_generate_is_balanced_without_double_copies(nodes: int, replicas: int, num_vbuckets: int) -> None:
    names = [f"n{i}" for i in range(nodes)]
    if replicas >= nodes:
        with pytest.raises(InvalidArgument):
            VBucketMap.generate(names, replicas, num_vbuckets)
        return
    m = VBucketMap.generate(names, replicas, num_vbuckets)
    assert m.num_vbuckets == num_vbuckets and m.num_replicas == replicas and m.revision == 1
    for chain in m.chains:
        assert None not in chain
        assert len(set(chain)) == len(chain) == replicas + 1
    for slot in range(replicas + 1):
        counts = Counter(c[slot] for c in m.chains)
        per_node = [counts.get(n, 0) for n in names]
        assert max(per_node) - min(per_node) <= 1, (slot, per_node)
    total = Counter(n for c in m.chains for n in c)
    per_node = [total.get(n, 0) for n in names]
    assert max(per_node) - min(per_node) <= replicas + 1  # only the last partial block of n vbuckets
    if num_vbuckets % nodes == 0:
        assert max(per_node) == min(per_node)
    assert VBucketMap.generate(names, replicas, num_vbuckets) == m  # deterministic


def test_json_round_trip_and_revision() -> None:
    m = VBucketMap.generate(["a", "b", "c"], 2, 16)
    assert VBucketMap.from_json(m.to_json()) == m
    chains = [list(c) for c in m.chains]
    chains[0] = [chains[0][1], chains[0][0], None]
    m2 = m.with_chains(chains)
    assert m2.revision == m.revision + 1 and m2.chains[0][2] is None
    assert m.chains[0][2] is not None  # the old revision is unchanged (immutable)
    m3 = m2.with_chains(m2.chains, ["a", "b", "c", "d"])
    assert m3.revision == 3 and m3.nodes[-1] == "d"
    assert VBucketMap.from_json(m3.to_json()) == m3
    assert m.active(5) == m.chains[5][0] and m.replicas(5) == m.chains[5][1:]
    assert m2.replicas(0) == [chains[0][1]]
    assert sorted(m.vbuckets_of("a", 0) + m.vbuckets_of("b", 0) + m.vbuckets_of("c", 0)) == list(range(16))
    with pytest.raises(Exception):  # noqa: B017 - frozen model
        m.revision = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    "doc",
    [
        '{"revision": 1, "nodes": ["a", "b"], "chains": [["a", "a"]]}',  # two copies on one node
        '{"revision": 1, "nodes": ["a", "b"], "chains": [["a", "c"]]}',  # unknown node
        '{"revision": 1, "nodes": ["a", "b"], "chains": [["a", "b"], ["a"]]}',  # ragged
        '{"revision": 1, "nodes": ["a", "a"], "chains": [["a"]]}',  # duplicate node names
        '{"revision": -1, "nodes": ["a"], "chains": [["a"]]}',  # negative revision
        '{"revision": 1, "nodes": [], "chains": [["a"]]}',  # no nodes
        '{"revision": 1, "nodes": ["a"], "chains": []}',  # no vbuckets
        '{"revision": 1, "nodes": ["a","b","c","d","e"], "chains": [["a","b","c","d","e"]]}',  # 4 replicas
        '{"revision": 1, "nodes": ["a"], "chains": [["a"]], "extra": 1}',  # unknown field
        'not json',
    ],
)
def test_bad_shapes_rejected(doc: str) -> None:
    with pytest.raises(InvalidArgument):
        VBucketMap.from_json(doc)


def test_bad_generate_arguments() -> None:
    with pytest.raises(InvalidArgument):
        VBucketMap.generate([], 0, 4)
    with pytest.raises(InvalidArgument):
        VBucketMap.generate(["a", "a"], 0, 4)
    with pytest.raises(InvalidArgument):
        VBucketMap.generate(["a", "b", "c", "d", "e"], 4, 4)
    with pytest.raises(InvalidArgument):
        VBucketMap.generate(["a"], 0, 0)
    m = VBucketMap.generate(["a", "b"], 1, 4)
    with pytest.raises(InvalidArgument):
        m.with_chains([["a", "a"]] * 4)
