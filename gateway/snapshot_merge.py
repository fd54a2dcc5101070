"""Merging the small memory snapshots rollback mitigation releases together (docs/gateway.md "Publishing path").

With rollback mitigation the publisher holds what each DCP step returns until it is persisted, and releases a
vbucket's held messages together once the flush covering them landed. A step runs on every pump round, so at a
steady trickle of writes each step takes one or two items per vbucket: each is a memory snapshot of its own,
and the topic carried almost one snapshot record per data record (measured: 0.8 at 64 vbuckets, 22,000 writes/s),
each of them also a snapshot end (a delivery report and an acknowledged position of its own).

Snapshots released together are consecutive in their vbucket and all persisted, so nothing is lost by publishing
them as one: a consumer reaches a consistent state at the merged end, as it would at the last of them. What a
merged snapshot must not break:

* **no repeated key** in a snapshot that is not flagged as keeping history (docs/record-format.md,
  ``MAY_CONTAIN_DUPLICATES``): a snapshot whose items repeat a key of the merged one so far starts a new one;
* **same kind**: only memory snapshots with the same flags (the checkpoint bit aside: the merged one keeps the
  first's) are merged -- never a disk snapshot (a de-duplicated state of its own), never one keeping history;
* **bounded**: at most ``max_items`` items, so that a consumer stopped inside a snapshot re-reads little, and
  the key sets built here stay small; large snapshots (a bulk load's) are left as they are.

The markers merged away were DCP messages too: their flow-control bytes are returned, for the caller to
buffer-acknowledge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from engine import Item, SnapshotMarker
from engine.dcp.stream import Message
from schemas.dcp import SnapshotFlags

#: a merged snapshot holds at most this many items (docs/gateway.md "Publishing path")
MERGE_MAX_ITEMS: Final = 1024

#: flags whose snapshots are never merged: a disk snapshot, a history one, one asking for an acknowledgement
_UNMERGEABLE: Final = int(SnapshotFlags.DISK | SnapshotFlags.HISTORY | SnapshotFlags.MAY_CONTAIN_DUPLICATES
                          | SnapshotFlags.ACK)
#: the bit a merged snapshot may differ in: it starts a checkpoint (the merged one keeps the first's)
_CHK: Final = int(SnapshotFlags.CHK)


def merge_snapshots(msgs: Sequence[Message], max_items: int = MERGE_MAX_ITEMS) -> tuple[list[Message], int]:
    """``msgs`` (one vbucket's released messages, in order) with consecutive mergeable memory snapshots
    merged; and the DCP bytes of the markers merged away. Messages before the first marker (the rest of a
    snapshot already published) and anything that is neither a marker nor an item are kept where they are."""
    out: list[Message] = []
    dropped = 0
    n = len(msgs)
    #: the open merged snapshot: its index in ``out``, its marker, its item count, its items' keys (built when
    #: a snapshot first asks to join it) or, until then, its items
    at = -1
    head: SnapshotMarker | None = None
    count = 0
    keys: set[bytes] | None = None
    first: Sequence[Item] = ()
    i = 0
    while i < n:
        m = msgs[i]
        if type(m) is not SnapshotMarker:
            out.append(m)
            if type(m) is not Item:
                head = None  # something else between snapshots: nothing merges across it
            i += 1
            continue
        j = i + 1
        while j < n and type(msgs[j]) is Item:
            j += 1
        span: Sequence[Item] = msgs[i + 1:j]  # type: ignore[assignment]  # items only, checked above
        size = j - i - 1
        if head is not None and count + size <= max_items and m.start > head.end \
                and int(m.flags) & ~_CHK == int(head.flags) & ~_CHK:
            if keys is None:
                keys = {x.key for x in first}
            new = {x.key for x in span}
            if len(keys) == count and len(new) == size and keys.isdisjoint(new):
                keys |= new
                count += size
                head = SnapshotMarker(m.vbucket, head.start, m.end, head.flags)
                out[at] = head
                out.extend(span)
                dropped += m.dcp_size
                i = j
                continue
        at = len(out)
        out.append(m)
        out.extend(span)
        head = None
        if size <= max_items and not int(m.flags) & _UNMERGEABLE:
            head = m
            count = size
            keys = None
            first = span
        i = j
    return out, dropped


__all__ = ["MERGE_MAX_ITEMS", "merge_snapshots"]
