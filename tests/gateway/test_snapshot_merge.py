"""gateway/snapshot_merge.py: what rollback mitigation releases together, with its small memory snapshots merged
(docs/gateway.md "Publishing path"), over random runs of markers and items."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Item, SnapshotMarker
from engine.dcp.stream import MARKER_SIZE, Message
from gateway.snapshot_merge import merge_snapshots
from schemas.dcp import SnapshotFlags

VB = 7
MEMORY = SnapshotFlags.MEMORY
FLAG_CHOICES = [MEMORY, MEMORY | SnapshotFlags.CHK, SnapshotFlags.DISK | SnapshotFlags.CHK,
                MEMORY | SnapshotFlags.HISTORY | SnapshotFlags.MAY_CONTAIN_DUPLICATES]


def _item(seqno: int, key: bytes) -> Item:
    return Item(key=key, value=b"v", vbucket=VB, seqno=seqno, rev_seqno=1, cas=seqno)


def _marker(start: int, end: int, flags: SnapshotFlags = MEMORY) -> SnapshotMarker:
    return SnapshotMarker(VB, start, end, flags)


@st.composite
def released(draw: st.DrawFn) -> list[Message]:
    """One vbucket's released messages: maybe the tail of a snapshot published before, then snapshots, each a
    marker and its items (keys from a small alphabet, so that keys repeat across snapshots; unique inside a
    snapshot unless it keeps history), seqnos increasing with gaps (de-duplicated items)."""
    seqno = draw(st.integers(1, 50))
    out: list[Message] = []
    for _ in range(draw(st.integers(0, 3))):  # the rest of a snapshot already published
        out.append(_item(seqno, b"t%d" % seqno))
        seqno += 1
    for _ in range(draw(st.integers(0, 12))):
        flags = draw(st.sampled_from(FLAG_CHOICES))
        n = draw(st.integers(0, 6))
        alphabet = [b"k%d" % i for i in range(8)]
        if flags & SnapshotFlags.MAY_CONTAIN_DUPLICATES:
            keys = draw(st.lists(st.sampled_from(alphabet), min_size=n, max_size=n))
        else:
            keys = draw(st.lists(st.sampled_from(alphabet), min_size=n, max_size=n, unique=True))
        start = seqno
        items = []
        for k in keys:
            seqno += draw(st.integers(1, 3))
            items.append(_item(seqno, k))
        end = items[-1].seqno if items else start
        out.append(_marker(start, end, flags))
        out.extend(items)
        seqno = end + 1
    return out


def _snapshots(msgs: list[Message]) -> list[tuple[SnapshotMarker, list[Item]]]:
    snaps: list[tuple[SnapshotMarker, list[Item]]] = []
    for m in msgs:
        if type(m) is SnapshotMarker:
            snaps.append((m, []))
        elif snaps:
            assert isinstance(m, Item)
            snaps[-1][1].append(m)
    return snaps


@settings(max_examples=400, deadline=None)
@given(released(), st.integers(1, 20))
def test_merging_keeps_every_item_in_order_inside_valid_snapshots(msgs: list[Message], max_items: int) -> None:
    out, dropped = merge_snapshots(msgs, max_items)
    # the items, in the same order, the same objects
    assert [m for m in out if type(m) is Item] == [m for m in msgs if type(m) is Item]
    # what comes before the first marker is untouched
    lead = next((i for i, m in enumerate(msgs) if type(m) is SnapshotMarker), len(msgs))
    assert out[:lead] == msgs[:lead]
    before, after = _snapshots(msgs), _snapshots(out)
    # the markers merged away are buffer-acknowledged: their DCP bytes
    assert dropped == (len(before) - len(after)) * MARKER_SIZE
    ends_before = {m.end for m, _ in before}
    for marker, items in after:
        # a marker brackets its items, and ends where one of the original snapshots ended (a consistent point)
        assert all(marker.start <= it.seqno <= marker.end for it in items)
        assert marker.end in ends_before
        originals = [(m, its) for m, its in before if marker.start <= m.start and m.end <= marker.end]
        assert originals and originals[0][0].start == marker.start
        if len(originals) > 1:  # merged: memory snapshots of one kind, no key twice, at most max_items
            assert len(items) <= max_items
            assert len({it.key for it in items}) == len(items)
            kinds = {int(m.flags) & ~int(SnapshotFlags.CHK) for m, _ in originals}
            assert kinds == {int(MEMORY)}
            assert marker.flags == originals[0][0].flags
        else:
            assert marker == originals[0][0]
    # disk and history snapshots are never merged into or across
    for m, its in before:
        if m.flags & (SnapshotFlags.DISK | SnapshotFlags.HISTORY):
            assert (m, its) in after


def test_a_trickle_of_one_item_snapshots_becomes_one_snapshot() -> None:
    msgs: list[Message] = []
    for s in range(1, 11):
        msgs += [_marker(s, s, MEMORY | SnapshotFlags.CHK if s == 1 else MEMORY), _item(s, b"k%d" % s)]
    out, dropped = merge_snapshots(msgs)
    assert out[0] == _marker(1, 10, MEMORY | SnapshotFlags.CHK)
    assert out[1:] == [m for m in msgs if type(m) is Item]
    assert dropped == 9 * MARKER_SIZE


def test_a_key_written_again_starts_a_new_snapshot() -> None:
    msgs: list[Message] = [_marker(1, 2), _item(1, b"a"), _item(2, b"b"), _marker(3, 3), _item(3, b"c"),
                           _marker(4, 4), _item(4, b"a"), _marker(5, 5), _item(5, b"d")]
    out, dropped = merge_snapshots(msgs)
    assert [m for m in out if type(m) is SnapshotMarker] == [_marker(1, 3), _marker(4, 5)]
    assert dropped == 2 * MARKER_SIZE
