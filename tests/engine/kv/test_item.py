"""Item.dcp_size: what an item costs in DCP flow control, for every kind of item (read per item the gateway
publishes, so it reads the item's fields directly: this pins its values)."""

from __future__ import annotations

from engine.kv.item import DCP_COMPLETION_OVERHEAD, DCP_DELETION_OVERHEAD, DCP_MUTATION_OVERHEAD, Item
from schemas.dcp import Op


def test_dcp_size_of_every_kind_of_item() -> None:
    key, value = b"key-1", b'{"a": 1}'
    assert Item(key, value, 0, 5, 1, 9).dcp_size == DCP_MUTATION_OVERHEAD + 5 + 8
    assert Item(key, None, 0, 5, 1, 9).dcp_size == DCP_MUTATION_OVERHEAD + 5
    assert Item(key, None, 0, 5, 1, 9, op=Op.DELETION).dcp_size == DCP_DELETION_OVERHEAD + 5
    assert Item(key, b"xattrs", 0, 5, 1, 9, op=Op.DELETION).dcp_size == DCP_DELETION_OVERHEAD + 5 + 6
    assert Item(key, None, 0, 5, 1, 9, op=Op.EXPIRATION).dcp_size == DCP_DELETION_OVERHEAD + 5
    # a prepare (durability level, no prepared seqno): sized like a deletion-family message with its value
    assert Item(key, value, 0, 5, 1, 9, op=Op.PREPARE, level=2).dcp_size == DCP_DELETION_OVERHEAD + 5 + 8
    # a commit / abort (the seqno of the prepare it completes): header + two seqnos + key, whatever its value
    assert Item(key, value, 0, 6, 1, 9, prepared=5).dcp_size == DCP_COMPLETION_OVERHEAD + 5
    assert Item(key, None, 0, 6, 1, 9, op=Op.ABORT, prepared=5).dcp_size == DCP_COMPLETION_OVERHEAD + 5
    # level and prepared together (sync = prepared << 2 | level) still count as a completion
    assert Item(key, value, 0, 6, 1, 9, prepared=1, level=3).dcp_size == DCP_COMPLETION_OVERHEAD + 5
