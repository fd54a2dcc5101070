"""Shared helpers of the XDCR tests: a target node process and the comparison of documents with their
metadata between the source (an in-process engine bucket) and a target node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import Bucket
from engine.exceptions import KeyNotFound
from engine.kv.vbucket import VBucketState
from engine.network.process_cluster import NodeProcess
from schemas.dcp import Op

#: (value or None, cas, rev seqno, flags, expiry, deleted)
Doc = tuple[bytes | None, int, int, int, int, bool]


def target_node(tmp: Path, name: str = "t0", nvb: int = 8, mode: str = "seqno", **cfg: Any) -> NodeProcess:
    node = NodeProcess(name, tmp / name, nvb, {"conflict_resolution": mode, **cfg})
    node.start()
    return node


def source_docs(bucket: Bucket) -> dict[bytes, Doc]:
    """Every document and tombstone of the bucket's active vbuckets with its metadata."""
    out: dict[bytes, Doc] = {}
    for vb in bucket.vbuckets():
        if vb.state is not VBucketState.ACTIVE:
            continue
        for k, it in vb.ht.items():
            deleted = it.op is not Op.MUTATION
            out[bytes(k)] = (None if deleted else bytes(it.value or b""), it.cas, it.rev_seqno, it.flags,
                             it.expiry, deleted)
    return out


def target_docs(node: NodeProcess, keys: dict[bytes, int]) -> dict[bytes, Doc]:
    """The target's version of each key (key -> vbucket); keys with neither document nor tombstone are
    absent."""
    c = node.require()
    out: dict[bytes, Doc] = {}
    for k, vb in keys.items():
        try:
            m = c.get_meta(k, vbucket=vb)
        except KeyNotFound:
            continue
        value = None if m.deleted else c.get(k, vbucket=vb).value
        out[k] = (value, m.cas, m.rev_seqno, m.flags, m.expiry, m.deleted)
    return out


def diverging(src: dict[bytes, Doc], tgt: dict[bytes, Doc]) -> dict[bytes, tuple[Doc | None, Doc | None]]:
    """Keys whose target version differs from the source's. A source deletion matches a target tombstone with
    the same metadata; a key the source does not hold at all (its branch was rolled back) matches an absent
    key or any target tombstone."""
    bad: dict[bytes, tuple[Doc | None, Doc | None]] = {}
    for k in set(src) | set(tgt):
        s, t = src.get(k), tgt.get(k)
        if s is None:
            if t is not None and not t[5]:
                bad[k] = (s, t)
        elif s != t:
            bad[k] = (s, t)
    return bad
