"""Items: the immutable unit a vbucket stores, queues in checkpoints, persists and streams over DCP.

A value assigned to the hash table is immutable and shared by the write queue, the flusher and every stream
(docs/engine.md "Decisions and differences from kv_engine", item as message). An :class:`Item` is created for every accepted change and never modified
afterwards, so a DCP stream can hand the very object to its consumer as the mutation / deletion /
expiration message (kv_engine's ``MutationResponse`` wraps a ``queued_item`` the same way).
"""

from __future__ import annotations

from typing import Final

import orjson

from schemas.dcp import Op

#: the ops of data a DCP client without sync writes receives (and the gateway publishes)
DATA_OPS: Final = (Op.MUTATION, Op.DELETION, Op.EXPIRATION)
#: Op.MUTATION as a module constant (Item.dcp_size, per item sent: no enum attribute lookup)
_OP_MUTATION: Final = Op.MUTATION


class Datatype:
    """memcached datatype bits (``protocol_binary_datatype_t``)."""

    RAW: Final = 0x00
    JSON: Final = 0x01
    SNAPPY: Final = 0x02
    XATTR: Final = 0x04


#: bytes a JSON document can start with (after optional whitespace), checked before parsing.
_JSON_START: Final = frozenset(b'{["-0123456789tfn')
_WS: Final = b" \t\r\n"

#: fixed per-item overhead counted towards checkpoint memory (object header, slots, list slot, index entry).
ITEM_OVERHEAD: Final = 120
#: memcached binary header (24) + DCP mutation extras (31) -- the size a mutation costs in flow control.
DCP_MUTATION_OVERHEAD: Final = 24 + 31
DCP_DELETION_OVERHEAD: Final = 24 + 21
#: header + prepared seqno + commit / abort seqno (DCP_COMMIT, DCP_ABORT)
DCP_COMPLETION_OVERHEAD: Final = 24 + 16


def detect_datatype(value: bytes) -> int:
    """Return ``Datatype.JSON`` when ``value`` is a valid JSON document, else ``Datatype.RAW``.

    kv_engine validates JSON on every store to set the datatype; a cheap first-byte check avoids parsing
    values that cannot be JSON.
    """
    if not value:
        return Datatype.RAW
    first = value[0]
    if first not in _JSON_START:
        stripped = value.lstrip(_WS)
        if not stripped or stripped[0] not in _JSON_START:
            return Datatype.RAW
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        return Datatype.RAW
    return Datatype.JSON


class Item:
    """One accepted change of one document. Immutable by convention once queued.

    ``prev_seqno`` is the by-seqno of the version of the same key that this item supersedes on disk (0 if
    none): the flusher uses it to mark that older row as superseded without an index lookup.
    ``expiry`` is an absolute epoch second (0 = never); for deletions and expirations it is the delete
    time, as in kv_engine's ``delete_time``.
    """

    #: twelve slots, no ``__dict__``: 128 bytes an item (docs/engine.md "Item layout and memory"). A thirteenth
    #: slot would cost 16 more (CPython's allocator rounds to 16 bytes), so the two sync-write fields share one.
    __slots__ = (
        "cas",
        "datatype",
        "expiry",
        "flags",
        "key",
        "op",
        "prev_seqno",
        "rev_seqno",
        "seqno",
        "sync",
        "value",
        "vbucket",
    )

    key: bytes
    value: bytes | None
    vbucket: int
    seqno: int
    rev_seqno: int
    cas: int
    flags: int
    expiry: int
    datatype: int
    op: Op
    prev_seqno: int
    sync: int

    def __init__(
        self,
        key: bytes,
        value: bytes | None,
        vbucket: int,
        seqno: int,
        rev_seqno: int,
        cas: int,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        op: Op = Op.MUTATION,
        prev_seqno: int = 0,
        level: int = 0,
        prepared: int = 0,
    ) -> None:
        self.key = key
        self.value = value
        self.vbucket = vbucket
        self.seqno = seqno
        self.rev_seqno = rev_seqno
        self.cas = cas
        self.flags = flags
        self.expiry = expiry
        self.datatype = datatype
        self.op = op
        self.prev_seqno = prev_seqno
        #: ``prepared << 2 | level``: 0 for every item outside synchronous replication (see :attr:`level`,
        #: :attr:`prepared`)
        self.sync = prepared << 2 | level if prepared or level else 0

    @property
    def level(self) -> int:
        """Durability level of a prepare (engine.kv.durability.Level), 0 otherwise."""
        return self.sync & 3

    @property
    def prepared(self) -> int:
        """For a commit (a MUTATION / DELETION) or an ABORT: the seqno of the prepare it completes, else 0."""
        return self.sync >> 2

    @property
    def deleted(self) -> bool:
        """True for deletions and expirations (tombstones)."""
        return self.op is not Op.MUTATION

    @property
    def mem_size(self) -> int:
        """Bytes this item is charged against the checkpoint memory quota."""
        v = self.value
        return ITEM_OVERHEAD + len(self.key) + (len(v) if v is not None else 0)

    @property
    def dcp_size(self) -> int:
        """Bytes this item costs in DCP flow control (header + extras + key + value)."""
        # called for every item a DCP stream sends (the gateway's hot path): the attributes are read directly,
        # not through :attr:`prepared`
        if self.sync > 3:
            # a commit / abort (docs/durability.md "Node processes"): DCP_COMMIT / DCP_ABORT carry the two seqnos and the key only. A
            # client without sync writes receives a commit as a larger mutation and acks more: harmless.
            return DCP_COMPLETION_OVERHEAD + len(self.key)
        v = self.value
        if v is None:
            return (DCP_MUTATION_OVERHEAD if self.op is _OP_MUTATION else DCP_DELETION_OVERHEAD) + len(self.key)
        return (DCP_MUTATION_OVERHEAD if self.op is _OP_MUTATION else DCP_DELETION_OVERHEAD) + len(self.key) + len(v)

    def __repr__(self) -> str:
        return (
            f"Item({self.op.name.lower()} vb={self.vbucket} seqno={self.seqno} key={self.key!r} "
            f"rev={self.rev_seqno} cas={self.cas})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Item):
            return NotImplemented
        return (
            self.key == other.key
            and self.value == other.value
            and self.vbucket == other.vbucket
            and self.seqno == other.seqno
            and self.rev_seqno == other.rev_seqno
            and self.cas == other.cas
            and self.flags == other.flags
            and self.expiry == other.expiry
            and self.datatype == other.datatype
            and self.op == other.op
            and self.sync == other.sync
        )

    __hash__ = None  # type: ignore[assignment]
