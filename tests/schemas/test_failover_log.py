"""Failover log: kv_engine FailoverTable rules, needsRollback, and the client-log rollback point.

References: kv_engine ``engines/ep/src/failover-table.cc`` (``FailoverTable``, ``needsRollback``); docs/rollback.md
(the rules, the UPR specification's worked examples, the mapping and the differences).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.errors import InvalidArgument
from schemas.failover_log import (
    U64_MAX,
    VBUUID_BITS,
    FailoverEntry,
    FailoverLog,
    needs_rollback,
    rollback_point,
    sanitized,
    stream_rollback,
)

A, B, C, D = 0xA, 0xB, 0xC, 0xD
CAFEBABE, DEADBEEF, BA5EBA11 = 0xCAFEBABE, 0xDEADBEEF, 0xBA5EBA11


def E(u: int, s: int) -> FailoverEntry:
    return FailoverEntry(u, s)


def flog(*pairs: tuple[int, int], max_entries: int = 25, seed: int = 1) -> FailoverLog:
    return FailoverLog([E(u, s) for u, s in pairs], max_entries=max_entries, rng=random.Random(seed))


def pairs(log: FailoverLog) -> list[tuple[int, int]]:
    return log.to_pairs()


# --------------------------------------------------------------------------------------------------------
# needs_rollback: one test per kv_engine rule (docs/rollback.md "kv_engine's `needsRollback`", in that order)
# --------------------------------------------------------------------------------------------------------


def test_rule2_start_zero_never_rolls_back() -> None:
    log = flog((B, 10), (A, 0))
    # unknown uuid, uuid 0, purge above start: start 0 wins over all of them
    assert log.needs_rollback(0, 10, 0xFFFF, 0, 0, 0) is None
    assert log.needs_rollback(0, 10, 0, 0, 0, 0) is None
    assert log.needs_rollback(0, 10, A, 0, 0, 5) is None


def test_rule2_strict_vbuuid() -> None:
    log = flog((B, 10), (A, 0))
    # STRICT_VBUUID with a non-zero uuid at start 0: the uuid must be known
    assert log.needs_rollback(0, 10, 0xFFFF, 0, 0, 0, strict_vbuuid=True) == 0
    assert log.needs_rollback(0, 10, A, 0, 0, 0, strict_vbuuid=True) is None
    assert log.needs_rollback(0, 10, B, 0, 0, 0, strict_vbuuid=True) is None
    # uuid 0 is exempt even when strict
    assert log.needs_rollback(0, 10, 0, 0, 0, 0, strict_vbuuid=True) is None
    # strict changes nothing once start > 0
    assert log.needs_rollback(5, 10, B, 5, 5, 0, strict_vbuuid=True) is None


def test_rule3_purge_above_start_rolls_back_to_zero() -> None:
    log = flog((A, 0))
    assert log.needs_rollback(5, 20, A, 5, 5, 6) == 0
    assert log.needs_rollback(5, 20, A, 5, 5, 5) is None  # purge == start: nothing purged above start
    # purge is checked before the uuid lookup (same answer, 0, for an unknown uuid)
    assert log.needs_rollback(5, 20, 0xFFFF, 5, 5, 6) == 0


def test_rule5_unknown_uuid_rolls_back_to_zero() -> None:
    log = flog((B, 10), (A, 0))
    assert log.needs_rollback(5, 20, 0xFFFF, 5, 5, 0) == 0
    assert log.needs_rollback(5, 20, 0, 5, 5, 0) == 0  # uuid 0 with start > 0 always gets 0


def test_rule4_upper_is_next_newer_entry_seqno() -> None:
    log = flog((B, 10), (A, 0))
    assert log.needs_rollback(8, 20, A, 8, 8, 0) is None  # within A's shared history
    assert log.needs_rollback(10, 20, A, 10, 10, 0) is None  # exactly at the branch point
    assert log.needs_rollback(15, 20, A, 15, 15, 0) == 10  # above it: back to the branch point
    assert log.needs_rollback(15, 20, B, 15, 15, 0) is None  # newest uuid: upper = high


def test_rule4_scan_is_oldest_to_newest() -> None:
    # A damaged / duplicated uuid: kv_engine matches the OLDEST entry with the uuid.
    log = flog((A, 20), (B, 10), (A, 0))
    assert log.needs_rollback(15, 30, A, 15, 15, 0) == 10


def test_rule6_start_at_snapshot_start_means_nothing_of_it_held() -> None:
    log = flog((B, 10), (A, 0))
    # start == snap_start: snap_end collapses to start, 8 <= 10 -> no rollback despite snap_end 20
    assert log.needs_rollback(8, 30, A, 8, 20, 0) is None
    # one item into the same snapshot: the snapshot crosses the branch point -> back to its start
    assert log.needs_rollback(9, 30, A, 8, 20, 0) == 8


def test_rule7_snapshot_inside_shared_history() -> None:
    log = flog((B, 10), (A, 0))
    assert log.needs_rollback(7, 30, A, 5, 10, 0) is None
    assert log.needs_rollback(7, 30, A, 5, 11, 0) == 5


def test_rule8_complete_snapshot_rolls_back_to_upper() -> None:
    log = flog((B, 10), (A, 0))
    # start == snap_end: the whole snapshot is held, snap_start becomes start -> min(10, 12) = 10
    assert log.needs_rollback(12, 30, A, 5, 12, 0) == 10


def test_rule9_partial_snapshot_rolls_back_to_min_upper_snapstart() -> None:
    log = flog((B, 10), (A, 0))
    assert log.needs_rollback(11, 30, A, 5, 12, 0) == 5  # snapshot start below the branch point
    assert log.needs_rollback(15, 30, A, 12, 20, 0) == 10  # snapshot start above the branch point


def test_newest_uuid_and_start_above_high_rolls_back_to_high() -> None:
    log = flog((A, 0))
    assert log.needs_rollback(15, 10, A, 15, 15, 0) == 10
    assert log.needs_rollback(8, 10, A, 5, 12, 0) == 5  # partial snapshot reaching above high
    assert log.needs_rollback(10, 10, A, 10, 10, 0) is None


@pytest.mark.parametrize(
    "args",
    [
        (-1, 10, A, 0, 0, 0),
        (1, -1, A, 0, 0, 0),
        (1, 10, -1, 0, 0, 0),
        (1, 10, U64_MAX + 1, 0, 0, 0),
        (1, 10, A, -1, 1, 0),
        (1, 10, A, 1, U64_MAX + 1, 0),
        (1, 10, A, 1, 1, -5),
    ],
)
def test_needs_rollback_rejects_out_of_range(args: tuple[int, int, int, int, int, int]) -> None:
    with pytest.raises(InvalidArgument):
        flog((A, 0)).needs_rollback(*args)


def test_rollback_point_rejects_out_of_range() -> None:
    log = flog((A, 0))
    with pytest.raises(InvalidArgument):
        log.rollback_point(-1, 10, [E(A, 0)], 0, 0, 0)
    with pytest.raises(InvalidArgument):
        log.rollback_point(1, 10, [E(A, 0)], 1, 1, U64_MAX + 1)


# --------------------------------------------------------------------------------------------------------
# The UPR design specification's worked examples (docs/rollback.md): every one
# --------------------------------------------------------------------------------------------------------
#
# Mapping of the specification's table form to stream-request fields (docs/rollback.md "The UPR specification's worked examples as stream requests"):
# * "seen through seq T"            -> start_seqno = T
# * "snapshot at S" (last complete) -> if S == T: snap_start = snap_end = T (snapshot complete);
#                                      else snap_start = S, snap_end = OPEN_END: the client is inside the
#                                      snapshot after S; in the specification the marker follows the snapshot, so its
#                                      end is unknown -- take it beyond every seqno of the example.
# * server sentinel ffffffff        -> high_seqno = HIGH >= snap_end (the specification's sentinel stands for "the
#                                      server holds everything the client saw"); the answer is the same for
#                                      any larger high.
# * client sentinel 00000000        -> not sent: the snapshot fields above carry it.
# * "RollbackSeq/StartSeq is X"     -> X == T means "no rollback, stream from T" -> None; X < T -> X.

OPEN_END = 100
HIGH = 100


@dataclass(frozen=True)
class SeedCase:
    name: str
    server: tuple[tuple[int, int], ...]
    client: tuple[tuple[int, int], ...]
    snapshot_at: int  # S
    seen_through: int  # T
    seed_answer: int  # the specification's RollbackSeq/StartSeq
    expected: int | None  # what rollback_point answers

    def request(self, high: int = HIGH) -> tuple[int, int, list[FailoverEntry], int, int, int]:
        s, t = self.snapshot_at, self.seen_through
        snap_end = t if s == t else OPEN_END
        return t, max(high, snap_end), [E(u, q) for u, q in self.client], s, snap_end, 0


SEED_CASES = [
    SeedCase("1 first connect, no log, no snapshot", ((CAFEBABE, 0),), (), 0, 0, 0, None),
    SeedCase("2 no failover, no snapshot, seen 5", ((CAFEBABE, 0),), ((CAFEBABE, 0),), 0, 5, 5, None),
    SeedCase("3 no failover, snapshot 6, seen 7", ((CAFEBABE, 0),), ((CAFEBABE, 0),), 6, 7, 7, None),
    SeedCase(
        "4 deadbeef failover at 5, snapshot 6, seen 7",
        ((DEADBEEF, 5), (CAFEBABE, 0)),
        ((CAFEBABE, 0),),
        6,
        7,
        5,
        5,
    ),
    SeedCase(
        "5 deadbeef failover at 8, snapshot 6, seen 7",
        ((DEADBEEF, 8), (CAFEBABE, 0)),
        ((CAFEBABE, 0),),
        6,
        7,
        6,
        6,
    ),
    SeedCase(
        "6 deadbeef at 8, client ba5eba11 at 7, snapshot 7, seen 9",
        ((DEADBEEF, 8), (CAFEBABE, 0)),
        ((BA5EBA11, 7), (CAFEBABE, 0)),
        7,
        9,
        7,
        7,
    ),
    SeedCase(
        "7 deadbeef at 8, client ba5eba11 at 7, snapshot 6, seen 9",
        ((DEADBEEF, 8), (CAFEBABE, 0)),
        ((BA5EBA11, 7), (CAFEBABE, 0)),
        6,
        9,
        6,
        6,
    ),
    SeedCase(
        "8 deadbeef created with no replica, client ba5eba11 at 7, snapshot 7, seen 9",
        ((DEADBEEF, 0),),
        ((BA5EBA11, 7), (CAFEBABE, 0)),
        7,
        9,
        0,
        0,
    ),
]


@pytest.mark.parametrize("case", SEED_CASES, ids=[c.name for c in SEED_CASES])
@pytest.mark.parametrize("high", [HIGH, HIGH + 50])
def test_seed_001_worked_examples(case: SeedCase, high: int) -> None:
    server = flog(*case.server)
    start, hi, client, snap_start, snap_end, purge = case.request(high)
    got = server.rollback_point(start, hi, client, snap_start, snap_end, purge)
    assert got == case.expected
    # "RollbackSeq/StartSeq is X": X == T is the stream start (no rollback), X < T is a rollback to X.
    assert (case.seed_answer == case.seen_through) == (got is None)
    if got is not None:
        assert got == case.seed_answer


def test_seed_001_not_possible_case() -> None:
    """Seed: master still at cafebabe (at 9), client saw ba5eba11 at 7 -- "Not possible!".

    It is possible in kv_engine (e.g. the client streamed from a node promoted with ba5eba11 and now
    streams from a replica or an old active still on cafebabe).  The engine answers it like any other
    request: common ancestor cafebabe@0, branch point min(server high 9, client's next entry 7) = 7, and
    the client, mid-snapshot after its complete snapshot at 7, rolls back to 7.  kv_engine's single-uuid
    rule does not know ba5eba11 and rolls back to 0.
    """
    server = flog((CAFEBABE, 0))
    client = [E(BA5EBA11, 7), E(CAFEBABE, 0)]
    assert server.rollback_point(9, 9, client, 7, OPEN_END, 0) == 7
    assert server.rollback_point(9, HIGH, client, 7, OPEN_END, 0) == 7
    assert server.rollback_point(9, 9, client, 9, 9, 0) == 7  # complete snapshot at 9: same answer
    assert server.needs_rollback(9, 9, BA5EBA11, 7, OPEN_END, 0) == 0


def test_seed_example_5_kv_engine_difference_when_snapshot_ends_in_shared_history() -> None:
    """Seed example 5 rolls back to the last complete snapshot (6) whatever the open snapshot's end.

    kv_engine knows the marker's end: if the open snapshot [6, 8] ends at or below the branch point 8 the
    client's partial snapshot is entirely shared history and the stream continues without a rollback.
    """
    server = flog((DEADBEEF, 8), (CAFEBABE, 0))
    client = [E(CAFEBABE, 0)]
    assert server.rollback_point(7, 20, client, 6, 8, 0) is None
    assert server.rollback_point(7, 20, client, 6, 9, 0) == 6


def test_seed_server_sentinel_is_not_the_server_high() -> None:
    """The UPR specification's server sentinel is the client's seen-through seqno; kv_engine uses the server's high.

    A server on the same branch but behind the client (e.g. a replica) makes the client roll back.
    """
    server = flog((CAFEBABE, 0))
    client = [E(CAFEBABE, 0)]
    assert server.rollback_point(7, 7, client, 7, 7, 0) is None  # seed example 3 when complete at 7
    assert server.rollback_point(7, 5, client, 7, 7, 0) == 5  # server behind: back to its high
    assert server.rollback_point(7, 5, client, 6, 9, 0) == 5


def test_elision_not_applied_literally_keeps_bound() -> None:
    """The client's entry N@10 lies above its last complete snapshot (3) but still bounds the shared
    history: its partial snapshot [3, 11] came from branch N, which shares only up to 10 with the
    server's branch M (shares up to 11).  Eliding N@10 would give upper 11 >= 11 -> no rollback, and the
    client would miss items de-duplicated into N's seqno 11.  The answer is a rollback to 3."""
    server = flog((0x11, 11), (0x10, 0))
    client = [E(0x1, 10), E(0x10, 0)]
    assert server.rollback_point(5, 20, client, 3, 11, 0) == 3


def test_elision_not_applied_keeps_kv_engine_answer() -> None:
    """Client's newest entry B@7 is above its last complete snapshot (5); kv_engine streams it (same
    branch, server has everything).  Eliding B@7 would force a rollback to 5."""
    server = flog((B, 7), (A, 0))
    client = [E(B, 7), E(A, 0)]
    assert server.needs_rollback(8, 9, B, 5, 9, 0) is None
    assert server.rollback_point(8, 9, client, 5, 9, 0) is None


# --------------------------------------------------------------------------------------------------------
# rollback_point: direct rules
# --------------------------------------------------------------------------------------------------------


def test_rollback_point_start_zero_and_purge_and_no_ancestor() -> None:
    server = flog((B, 10), (A, 0))
    assert server.rollback_point(0, 20, [E(0xFF, 3)], 0, 0, 99) is None
    assert server.rollback_point(5, 20, [E(A, 0)], 5, 5, 6) == 0
    assert server.rollback_point(5, 20, [E(0xFF, 3)], 5, 5, 0) == 0
    assert server.rollback_point(5, 20, [], 5, 5, 0) == 0
    # same uuid but a different seqno is not a common ancestor
    assert server.rollback_point(5, 20, [E(A, 1)], 5, 5, 0) == 0


def test_rollback_point_uses_older_common_ancestor() -> None:
    # Client saw branches X@30 and B@10 over A@0; the server took over from B at 20 (C@20).
    server = flog((C, 20), (B, 10), (A, 0))
    client = [E(0x99, 30), E(B, 10), E(A, 0)]
    # kv_engine: uuid 0x99 unknown -> rollback to 0; the common ancestor B@10 gives min(20, 30) = 20
    assert server.needs_rollback(35, 50, 0x99, 35, 35, 0) == 0
    assert server.rollback_point(35, 50, client, 35, 35, 0) == 20
    assert server.rollback_point(25, 50, client, 25, 25, 0) == 20
    assert server.rollback_point(18, 50, client, 18, 18, 0) is None


# --------------------------------------------------------------------------------------------------------
# construction, create_entry, prune_above, replace, pairs, vbuuid_at
# --------------------------------------------------------------------------------------------------------


def test_new_vbucket_log_has_one_entry_at_zero() -> None:
    log = FailoverLog.new(rng=random.Random(3))
    assert len(log) == 1
    assert log.latest.seqno == 0
    assert 0 < log.latest.vbuuid < 2**VBUUID_BITS
    assert FailoverLog.new(rng=random.Random(3)) == log  # deterministic given the rng
    assert len(FailoverLog(rng=random.Random(0))) == 1 and FailoverLog(rng=random.Random(0)).latest.seqno == 0


def test_create_entry_prunes_above_and_pushes_front() -> None:
    log = flog((C, 20), (B, 10), (A, 0))
    e = log.create_entry(15)
    assert list(log) == [e, E(B, 10), E(A, 0)]
    assert e.seqno == 15 and e.vbuuid not in (0, A, B, C)
    e2 = log.create_entry(15)  # an entry at an equal seqno is kept
    assert list(log) == [e2, e, E(B, 10), E(A, 0)]
    e3 = log.create_entry(0)
    assert list(log) == [e3, E(A, 0)]


def test_create_entry_caps_the_log() -> None:
    log = FailoverLog.new(max_entries=3, rng=random.Random(7))
    first = log.latest
    made = [log.create_entry(s) for s in (5, 10, 15, 20)]
    assert len(log) == 3
    assert log.entries == tuple(reversed(made[1:]))
    assert first not in log.entries
    assert len({e.vbuuid for e in log}) == 3


def test_create_entry_never_reuses_a_uuid_in_the_log() -> None:
    taken = random.Random(11).getrandbits(VBUUID_BITS)  # the first uuid Random(11) would draw
    log = FailoverLog([E(taken, 0)], rng=random.Random(11))
    assert log.create_entry(5).vbuuid != taken


def test_loading_sanitises_like_kv_engine() -> None:
    assert pairs(flog((0, 5), (A, 3))) == [(A, 3)]  # uuid 0 dropped
    assert pairs(flog((C, 10), (B, 20), (A, 5))) == [(C, 10), (A, 5)]  # seqno above a newer entry
    # compared with the newer entry that was KEPT
    assert pairs(flog((C, 10), (B, 20), (D, 15), (A, 5))) == [(C, 10), (A, 5)]
    assert pairs(flog((C, 10), (0, 3), (B, 7))) == [(C, 10), (B, 7)]
    assert pairs(flog((B, 5), (A, 5))) == [(B, 5), (A, 5)]  # equal seqnos are fine
    assert pairs(flog((D, 30), (C, 20), (B, 10), (A, 0), max_entries=2)) == [(D, 30), (C, 20)]


def test_loading_an_empty_or_fully_damaged_log_creates_an_entry() -> None:
    log = FailoverLog.from_pairs([(0, 5), (0, 0)], rng=random.Random(1), high_seqno=7)
    assert len(log) == 1 and log.latest.seqno == 7 and log.latest.vbuuid != 0
    assert FailoverLog([], rng=random.Random(0), high_seqno=3).latest.seqno == 3


def test_invalid_construction() -> None:
    for bad in (0, -1):
        with pytest.raises(InvalidArgument):
            FailoverLog(max_entries=bad)
    with pytest.raises(InvalidArgument):
        FailoverEntry(-1, 0)
    with pytest.raises(InvalidArgument):
        FailoverEntry(U64_MAX + 1, 0)
    with pytest.raises(InvalidArgument):
        FailoverEntry(1, -1)
    with pytest.raises(InvalidArgument):
        FailoverLog.from_pairs([(1, 2, 3)])
    with pytest.raises(InvalidArgument):
        flog((A, 0)).create_entry(-1)
    assert FailoverEntry(0, 0).vbuuid == 0  # representable (a client with no log), never kept in a log
    assert FailoverEntry(U64_MAX, U64_MAX).seqno == U64_MAX


def test_prune_above() -> None:
    log = flog((C, 20), (B, 10), (A, 0))
    log.prune_above(15)
    assert pairs(log) == [(B, 10), (A, 0)]
    log.prune_above(10)
    assert pairs(log) == [(B, 10), (A, 0)]
    log.prune_above(0)
    assert pairs(log) == [(A, 0)]


def test_prune_above_emptying_pushes_a_fresh_entry() -> None:
    log = flog((B, 10))
    log.prune_above(5)
    assert len(log) == 1 and log.latest.seqno == 5 and log.latest.vbuuid not in (0, B)


def test_replace_adopts_the_producers_log() -> None:
    log = flog((A, 0))
    log.replace([E(C, 20), E(B, 10), E(A, 0)])
    assert pairs(log) == [(C, 20), (B, 10), (A, 0)]
    log.replace([E(D, 5), E(0, 3)])  # sanitised
    assert pairs(log) == [(D, 5)]
    with pytest.raises(InvalidArgument):
        log.replace([])
    with pytest.raises(InvalidArgument):
        log.replace([E(0, 1)])
    assert pairs(log) == [(D, 5)]


def test_pairs_round_trip_through_json() -> None:
    log = FailoverLog.new(rng=random.Random(5))
    for s in (3, 9, 9, 40):
        log.create_entry(s)
    stored = json.dumps(log.to_pairs())
    back = FailoverLog.from_pairs(json.loads(stored))
    assert back == log and back.entries == log.entries
    assert list(back) == list(log.entries)


def test_equality_and_container_protocol() -> None:
    a = flog((B, 10), (A, 0))
    assert a == flog((B, 10), (A, 0), max_entries=5, seed=99)  # cap and rng are not part of equality
    assert a != flog((A, 0))
    assert a != [E(B, 10), E(A, 0)]
    assert len(a) == 2 and list(a) == [E(B, 10), E(A, 0)] and a.latest == E(B, 10)


def test_vbuuid_at() -> None:
    log = flog((C, 20), (B, 10), (A, 0))
    assert [log.vbuuid_at(s) for s in (0, 1, 10, 11, 20, 21, 1000)] == [A, A, A, B, B, C, C]
    same = flog((D, 5), (C, 5), (A, 0))
    assert [same.vbuuid_at(s) for s in (5, 6)] == [A, D]
    assert flog((B, 10)).vbuuid_at(3) == B  # older history is not tracked: the oldest entry
    with pytest.raises(InvalidArgument):
        log.vbuuid_at(-1)


# --------------------------------------------------------------------------------------------------------
# hypothesis
# --------------------------------------------------------------------------------------------------------

seqnos = st.integers(0, 60)


@st.composite
def server_logs(draw: st.DrawFn) -> list[FailoverEntry]:
    """A sane log: unique non-zero uuids, seqnos non-increasing newest -> oldest."""
    n = draw(st.integers(1, 8))
    uuids = draw(st.lists(st.integers(1, 2**48 - 1), min_size=n, max_size=n, unique=True))
    seqs = sorted(draw(st.lists(seqnos, min_size=n, max_size=n)), reverse=True)
    return [E(u, s) for u, s in zip(uuids, seqs, strict=True)]


@st.composite
def positions(draw: st.DrawFn, hi: int = 80) -> tuple[int, int, int]:
    """(start, snap_start, snap_end) with snap_start <= start <= snap_end (checked by the stream request)."""
    start = draw(st.integers(0, hi))
    snap_start = draw(st.integers(0, start))
    snap_end = draw(st.integers(start, hi + 10))
    return start, snap_start, snap_end


@given(
    server=server_logs(),
    k=st.integers(0, 7),
    junk=st.lists(st.tuples(st.integers(0, 2**48), seqnos), max_size=4),
    pos=positions(),
    high=st.integers(0, 90),
    purge=st.integers(0, 30),
)
def test_rollback_point_equals_needs_rollback_when_client_newest_is_known(
    server: list[FailoverEntry],
    k: int,
    junk: list[tuple[int, int]],
    pos: tuple[int, int, int],
    high: int,
    purge: int,
) -> None:
    k %= len(server)
    newest = server[k]
    client = (
        [newest, *server[k + 1 :]] if not junk else [newest, *(E(u, min(s, newest.seqno)) for u, s in junk)]
    )
    log = FailoverLog(server)
    assert log.entries == tuple(server)
    start, snap_start, snap_end = pos
    want = log.needs_rollback(start, high, newest.vbuuid, snap_start, snap_end, purge)
    assert log.rollback_point(start, high, client, snap_start, snap_end, purge) == want


@given(
    server=server_logs(),
    client=st.lists(st.tuples(st.integers(1, 2**48 - 1), seqnos), max_size=5),
    share=st.integers(0, 8),
    vbuuid=st.integers(0, 2**48 - 1),
    pos=positions(),
    high=st.integers(0, 90),
    purge=st.integers(0, 30),
    strict=st.booleans(),
)
def test_stream_rollback_is_the_stream_requests_decision(
    server: list[FailoverEntry],
    client: list[tuple[int, int]],
    share: int,
    vbuuid: int,
    pos: tuple[int, int, int],
    high: int,
    purge: int,
    strict: bool,
) -> None:
    """One decision for a stream request (the producer's and the publisher's lag check): the client's whole
    log -> the product's common-ancestor rule; no log (None or empty) -> kv_engine's rule on the request's
    vbuuid, STRICT_VBUUID included."""
    start, snap_start, snap_end = pos
    log = FailoverLog(server)
    theirs = [*server[share % len(server):][:1], *(E(u, s) for u, s in client)]  # may share the server's history
    common: dict[str, Any] = dict(log=server, start_seqno=start, high_seqno=high, vbuuid=vbuuid, snap_start=snap_start,
                  snap_end=snap_end, purge_seqno=purge, strict_vbuuid=strict)
    want_kv = needs_rollback(log=server, start_seqno=start, high_seqno=high, vbuuid=vbuuid, snap_start=snap_start,
                             snap_end=snap_end, purge_seqno=purge, strict_vbuuid=strict)
    assert stream_rollback(**common) == want_kv
    assert stream_rollback(**common, client_log=[]) == want_kv
    assert log.stream_rollback(start, high, vbuuid, snap_start, snap_end, purge, strict_vbuuid=strict) == want_kv
    want_product = rollback_point(server_log=server, client_log=theirs, start_seqno=start, high_seqno=high,
                                  snap_start=snap_start, snap_end=snap_end, purge_seqno=purge)
    assert stream_rollback(**common, client_log=theirs) == want_product
    assert log.stream_rollback(start, high, vbuuid, snap_start, snap_end, purge, client_log=theirs) == want_product


def _branch_point(server: list[FailoverEntry], high: int, client: list[FailoverEntry]) -> float | None:
    """Independent brute force: newest client entry also in the server log -> min of the two bounds."""
    for ci, ce in enumerate(client):
        for si, se in enumerate(server):
            if (se.vbuuid, se.seqno) == (ce.vbuuid, ce.seqno):
                sb = server[si - 1].seqno if si else high
                cb = client[ci - 1].seqno if ci else float("inf")
                return min(sb, cb)
    return None


@given(
    server=server_logs(),
    client=st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 5]), seqnos), max_size=6),
    share=st.integers(0, 8),
    pos=positions(),
    high=st.integers(0, 90),
    purge=st.integers(0, 30),
)
def test_rollback_point_bounded_by_start_and_branch_point(
    server: list[FailoverEntry],
    client: list[tuple[int, int]],
    share: int,
    pos: tuple[int, int, int],
    high: int,
    purge: int,
) -> None:
    # a client log that may share an older part of the server's log, with arbitrary entries in front
    cl = sorted((E(u, s) for u, s in client), key=lambda e: -e.seqno) + server[len(server) - share :]
    start, snap_start, snap_end = pos
    got = FailoverLog(server).rollback_point(start, high, cl, snap_start, snap_end, purge)
    if got is None:
        return
    assert got <= start
    bp = _branch_point(server, high, cl)
    if bp is not None:
        assert got <= bp
    else:
        assert got == 0


# ---- a random tree of history branches ----------------------------------------------------------------


@dataclass(frozen=True)
class Branch:
    uuid: int
    parent: int  # index; the root is its own parent
    fork: int  # shares the parent's history up to and including this seqno
    high: int
    log: tuple[FailoverEntry, ...]


@st.composite
def history_trees(draw: st.DrawFn) -> list[Branch]:
    n = draw(st.integers(1, 7))
    uuids = draw(st.lists(st.integers(1, 2**48 - 1), min_size=n, max_size=n, unique=True))
    root_high = draw(st.integers(0, 30))
    tree = [Branch(uuids[0], 0, 0, root_high, (E(uuids[0], 0),))]
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        fork = draw(st.integers(0, tree[p].high))
        high = draw(st.integers(fork, fork + 15))
        # kv_engine createEntry(fork) on a copy of the parent's log
        log = (E(uuids[i], fork), *(e for e in tree[p].log if e.seqno <= fork))
        tree.append(Branch(uuids[i], p, fork, high, log))
    return tree


def _owner(tree: list[Branch], b: int, seqno: int) -> int:
    """The branch that wrote ``seqno`` in branch ``b``'s history."""
    while b != 0 and seqno <= tree[b].fork:
        b = tree[b].parent
    return b


def _shared_through(tree: list[Branch], c: int, cn: int, s: int, sn: int) -> int:
    """Newest seqno p such that client history (branch c up to cn) and server history (branch s up to sn)
    agree on every seqno 1..p."""
    p = 0
    while p < min(cn, sn) and _owner(tree, c, p + 1) == _owner(tree, s, p + 1):
        p += 1
    return p


@st.composite
def tree_scenarios(draw: st.DrawFn) -> tuple[list[Branch], int, int, int, int, int, int]:
    tree = draw(history_trees())
    c = draw(st.integers(0, len(tree) - 1))
    s = draw(st.integers(0, len(tree) - 1))
    t = draw(st.integers(0, tree[c].high))
    snap_start = draw(st.integers(0, t))
    snap_end = draw(st.integers(t, tree[c].high))  # the marker came from the client's branch
    server_high = draw(st.integers(tree[s].fork, tree[s].high))  # the server may be behind its branch
    return tree, c, s, t, snap_start, snap_end, server_high


@settings(max_examples=400)
@given(scenario=tree_scenarios())
def test_rollback_point_against_a_tree_of_branches(
    scenario: tuple[list[Branch], int, int, int, int, int, int],
) -> None:
    tree, c, s, t, snap_start, snap_end, server_high = scenario
    server = FailoverLog(tree[s].log)
    assert server.entries == tree[s].log  # createEntry-built logs need no sanitising
    got = server.rollback_point(t, server_high, list(tree[c].log), snap_start, snap_end, 0)
    if t == 0:
        assert got is None
        return
    # The client must hold only shared history, including the snapshot it is inside (kv rule 6: if it is
    # at the snapshot's start it holds nothing of it).
    effective_end = t if t == snap_start else snap_end
    shared_t = _shared_through(tree, c, t, s, server_high)
    if got is None:
        assert _shared_through(tree, c, effective_end, s, server_high) == effective_end
    else:
        # the rollback point never lies above the newest seqno both histories share
        assert got <= shared_t
        assert _shared_through(tree, c, effective_end, s, server_high) < effective_end
    # and its vbuuid_at agrees with the tree about who wrote each seqno
    for q in range(1, server_high + 1):
        assert server.vbuuid_at(q) == tree[_owner(tree, s, q)].uuid


@settings(max_examples=200)
@given(scenario=tree_scenarios(), cap=st.integers(1, 3))
def test_rollback_point_is_safe_with_trimmed_logs(
    scenario: tuple[list[Branch], int, int, int, int, int, int], cap: int
) -> None:
    tree, c, s, t, snap_start, snap_end, server_high = scenario
    server = FailoverLog(tree[s].log, max_entries=cap)
    got = server.rollback_point(t, server_high, list(tree[c].log[:cap]), snap_start, snap_end, 0)
    effective_end = t if t == snap_start else snap_end
    if got is None:
        assert t == 0 or _shared_through(tree, c, effective_end, s, server_high) == effective_end
    else:
        assert got <= _shared_through(tree, c, t, s, server_high)


@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)), max_size=30))
def test_from_pairs_sanitises_and_round_trips(raw: list[tuple[int, int]]) -> None:
    log = FailoverLog.from_pairs(raw, max_entries=25, rng=random.Random(0))
    got = log.to_pairs()
    assert 1 <= len(got) <= 25
    assert all(u != 0 for u, _ in got)
    assert all(got[i][1] >= got[i + 1][1] for i in range(len(got) - 1))
    assert FailoverLog.from_pairs(got) == log  # a sanitised log loads unchanged


@given(ops=st.lists(st.tuples(st.sampled_from(["create", "prune"]), st.integers(0, 50)), max_size=40))
def test_create_and_prune_keep_the_log_sane(ops: list[tuple[str, int]]) -> None:
    log = FailoverLog.new(max_entries=5, rng=random.Random(0))
    for op, s in ops:
        if op == "create":
            e = log.create_entry(s)
            assert log.latest == e and all(x.seqno <= s for x in log)
        else:
            log.prune_above(s)
            assert all(x.seqno <= s for x in log)
        seqs = [x.seqno for x in log]
        assert seqs == sorted(seqs, reverse=True)
        assert 1 <= len(log) <= 5
        assert len({x.vbuuid for x in log}) == len(log) and all(x.vbuuid for x in log)


# ---------------------------------------------------------------------------------------------------- pure rule
_entries = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 60)), max_size=6).map(
    lambda ps: [FailoverEntry(u, s) for u, s in ps])


@settings(max_examples=300, deadline=None)
@given(server=_entries, client=_entries, start=st.integers(0, 80), high=st.integers(0, 80),
       snap=st.tuples(st.integers(0, 80), st.integers(0, 80)), purge=st.integers(0, 10))
def test_the_pure_rule_is_the_logs_rule(server: list[FailoverEntry], client: list[FailoverEntry], start: int,
                                        high: int, snap: tuple[int, int], purge: int) -> None:
    # The rule is a pure function of named arguments; a FailoverLog answers with it on its own (sanitised)
    # entries, so both agree on every input -- and the pure rule never draws a random vbuuid.
    log = FailoverLog(server, rng=random.Random(0), high_seqno=high)
    if not sanitized(server):
        return  # the log invented an entry (a random vbuuid) that no client holds
    s_start, s_end = min(snap[0], start), max(snap[1], start)
    assert rollback_point(server_log=sanitized(server), client_log=client, start_seqno=start, high_seqno=high,
                          snap_start=s_start, snap_end=s_end, purge_seqno=purge) == log.rollback_point(
        start, high, client, s_start, s_end, purge)
    for e in client[:1]:
        assert needs_rollback(log=sanitized(server), start_seqno=start, high_seqno=high, vbuuid=e.vbuuid,
                              snap_start=s_start, snap_end=s_end, purge_seqno=purge) == log.needs_rollback(
            start, high, e.vbuuid, s_start, s_end, purge)


def test_the_pure_rule_takes_named_arguments_only() -> None:
    with pytest.raises(TypeError):
        rollback_point([E(1, 0)], [E(1, 0)], 5, 5, 5, 5, 0)  # type: ignore[call-arg]
    assert rollback_point(server_log=[E(1, 0)], client_log=[E(1, 0)], start_seqno=5, high_seqno=5, snap_start=5,
                          snap_end=5, purge_seqno=0) is None
    assert sanitized([E(0, 3), E(2, 4), E(1, 9)]) == [E(2, 4)]


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["create", "prune", "replace"]), st.integers(0, 50)), max_size=20))
def test_vbuuid_attribute_is_always_the_newest_entrys(steps: list[tuple[str, int]]) -> None:
    """``FailoverLog.vbuuid`` (a plain attribute the ingest path reads) follows every change of the entries."""
    log = FailoverLog.new(max_entries=3, rng=random.Random(7))
    assert log.vbuuid == log.latest.vbuuid
    for kind, seqno in steps:
        if kind == "create":
            log.create_entry(seqno)
        elif kind == "prune":
            log.prune_above(seqno)
        else:
            log.replace([E(seqno + 1, seqno), E(A, 0)])
        assert log.vbuuid == log.latest.vbuuid
    assert flog((C, 20), (B, 10)).vbuuid == C
