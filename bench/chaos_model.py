"""What the fault campaign (bench/chaos.py) checks against: the writes it sent, and a replay of the topic.

* :class:`KeyHistory` -- every write of one key in the order the (single) writer sent it, with its outcome
  (acknowledged, ambiguous, refused) and when it was acknowledged; :meth:`KeyHistory.explain` maps the value
  read back from the engine to one of those writes and lists the acknowledged writes it implies were lost.
* :class:`TopicReplay` -- an independent replay of the gateway's topic into a dict, with the record format's
  consumer rules (docs/record-format.md "What consumers must do"): whole snapshots only, a rollback record
  restores the state at its restart boundary. It shares no code with connectors/ (whose Replicator is one of
  the things compared), only the record decoder.

The plain-write window and the loss rules are described in docs/reliability.md "Fault campaign".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from schemas.records import DecodedRecord, RecordType

#: outcome of one write
ACKED = "acked"  # 2xx: the product acknowledged it
AMBIGUOUS = "ambiguous"  # no answer (killed, timed out) or 504 SYNC_WRITE_AMBIGUOUS: may or may not be applied
REFUSED = "refused"  # 4xx / 503: not applied

#: kinds of write (plain, or the durability level of a sync write)
PLAIN = "plain"
MAJORITY = "majority"
PERSIST = "persist_to_majority"

_WID = re.compile(rb'^\{"w":(\d+),')


def make_value(wid: int, size: int) -> bytes:
    """The document body of write ``wid``: JSON ``{"w": wid, "p": "xxx..."}`` of about ``size`` bytes."""
    head = b'{"w":%d,"p":"' % wid
    return head + b"x" * max(0, size - len(head) - 2) + b'"}'


def value_wid(value: bytes) -> int | None:
    """The write id a document body carries (None: not one of ours)."""
    m = _WID.match(value[:32])
    return int(m.group(1)) if m else None


@dataclass(slots=True)
class Write:
    wid: int
    kind: str  # PLAIN / MAJORITY / PERSIST
    deleted: bool
    size: int  # body size (0 for a delete)
    expiry: int  # relative seconds, 0 = none
    sent: float  # monotonic time the request was sent
    outcome: str = AMBIGUOUS
    acked_at: float = 0.0
    vbucket: int | None = None
    vbuuid: int | None = None
    seqno: int | None = None

    def value(self) -> bytes | None:
        return None if self.deleted else make_value(self.wid, self.size)

    def gone_by(self, now: float) -> str:
        """Whether this write's document is absent at ``now``: "no", "yes", or "maybe" (an expiry near now:
        the engine rounds expiry times to whole seconds)."""
        if self.deleted:
            return "yes"
        if not self.expiry:
            return "no"
        t0 = self.acked_at or self.sent
        if now >= t0 + self.expiry + 1.5:
            return "yes"
        if now <= self.sent + self.expiry - 1.5:
            return "no"
        return "maybe"


@dataclass
class Explanation:
    #: the observed value matches no write of this key (a corrupt / foreign value): divergent
    unknown: bool = False
    #: acknowledged writes the observed value implies were lost (newest last)
    lost: list[Write] = field(default_factory=list)


@dataclass
class KeyHistory:
    key: str
    writes: list[Write] = field(default_factory=list)

    def explain(self, observed: bytes | None, now: float) -> Explanation:
        """Which write the engine's value is, and which acknowledged writes after it were lost.

        The newest write the value can be is chosen (a delete, an expired write and the initial absence all
        read as "absent"); ambiguous writes may or may not have happened, refused ones did not."""
        ws = [w for w in self.writes if w.outcome != REFUSED]
        idx: int | None = None
        if observed is None:
            idx = -1  # the key never written
            for i in range(len(ws) - 1, -1, -1):
                if ws[i].gone_by(now) != "no":
                    idx = i
                    break
        else:
            wid = value_wid(observed)
            for i in range(len(ws) - 1, -1, -1):
                w = ws[i]
                if w.wid == wid and not w.deleted:
                    if w.value() != observed or w.gone_by(now) == "yes":
                        return Explanation(unknown=True)
                    idx = i
                    break
            if idx is None:
                return Explanation(unknown=True)
        lost = [w for w in ws[idx + 1:] if w.outcome == ACKED
                and not (observed is None and w.gone_by(now) != "no")]
        return Explanation(lost=lost)


# ---------------------------------------------------------------------- topic replay
@dataclass
class _VB:
    docs: dict[bytes, bytes] = field(default_factory=dict)
    #: (snapshot end, docs at that boundary), oldest first; (0, {}) is the empty start
    history: list[tuple[int, dict[bytes, bytes]]] = field(default_factory=lambda: [(0, {})])
    pending: list[DecodedRecord] = field(default_factory=list)
    snap: tuple[int, int] | None = None


class TopicReplay:
    """The state a consumer following the record format's rules builds from the topic (key -> value)."""

    def __init__(self) -> None:
        self.vbs: dict[int, _VB] = {}
        self.rollbacks = 0
        #: rollback records whose restart boundary is no complete snapshot this replay saw
        self.bad_rollbacks = 0

    def apply(self, r: DecodedRecord) -> None:
        st = self.vbs.setdefault(r.vbucket, _VB())
        t = r.type
        if t is RecordType.SNAPSHOT:
            if st.snap is not None and st.pending and r.snap_start > st.snap[1]:
                self._commit(st)  # the previous snapshot's tail was filtered out: it is complete
            st.snap = (r.snap_start, r.snap_end) if not (st.pending and st.snap) else \
                (min(st.snap[0], r.snap_start), max(st.snap[1], r.snap_end))
        elif t is RecordType.ROLLBACK:
            self.rollbacks += 1
            restart = r.snap_end
            if st.snap is not None and st.pending and st.snap[1] <= restart:
                self._commit(st)
            while len(st.history) > 1 and st.history[-1][0] > restart:
                st.history.pop()
            st.docs = dict(st.history[-1][1])
            st.pending.clear()
            st.snap = None
        elif r.is_data:
            if st.snap is None:
                return  # outside any snapshot: an invariant violation, reported by check_partition
            if st.pending and r.seqno <= st.pending[-1].seqno:
                return
            st.pending.append(r)
            if r.seqno >= st.snap[1]:
                self._commit(st)

    def _commit(self, st: _VB) -> None:
        for r in st.pending:
            assert r.key is not None
            if r.type is RecordType.MUTATION:
                assert r.value is not None
                st.docs[r.key] = r.value
            else:
                st.docs.pop(r.key, None)
        st.pending.clear()
        assert st.snap is not None
        if st.history[-1][0] < st.snap[1]:
            st.history.append((st.snap[1], dict(st.docs)))

    def state(self) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        for st in self.vbs.values():
            out.update(st.docs)
        return out
