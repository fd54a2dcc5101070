"""Consistent search queries: ``not_bounded``, ``at_plus`` (mutation tokens) and ``request_plus``
(docs/search.md "Consistency"; N1QL's scan consistency, the barrier of the DCP design).

The index *covers* a seqno ``s`` of vbucket ``vb`` when it reflects the source's history up to ``s``: its
position's branch (vbuuid) is in the source's failover log and ``s`` is at or below both the position's seqno
and the end of that branch in the source's log (a position above the end of its branch holds a lost tail that a
rollback will take back: it covers only up to the branch point). A token whose write the source no longer has --
its vbuuid is not in the source's log, or its seqno is above the end of its branch -- is *rolled back*: the
query is answered 409 with the rollback point instead of waiting.

The source's positions come from the gateway's ``GET /vbuckets`` (:class:`GatewaySource`), read at request time.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import aiohttp

from connectors.exceptions import ConnectorError
from connectors.search.backend import Checkpoint, Position
from schemas.failover_log import FailoverEntry, rollback_point

__all__ = ["CONSISTENCY_LEVELS", "GatewaySource", "MutationToken", "SourcePositions", "SourceUnavailable", "SourceVBucket",
           "covered_seqno", "index_token_rollback", "lag_seqnos", "missing", "missing_tokens", "token_rollback"]

CONSISTENCY_LEVELS: Final = ("not_bounded", "at_plus", "request_plus")


@dataclass(frozen=True, slots=True)
class MutationToken:
    vbucket: int
    vbuuid: int
    seqno: int

    @classmethod
    def parse(cls, d: Any, i: int) -> MutationToken:
        """A token of a request body (``ValueError`` with a message naming it when malformed)."""
        if not isinstance(d, dict) or set(d) - {"vbucket", "vbuuid", "seqno"}:
            raise ValueError(f"tokens[{i}] must be an object {{\"vbucket\", \"vbuuid\", \"seqno\"}}")
        vals = []
        for f in ("vbucket", "vbuuid", "seqno"):
            v = d.get(f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**64:
                raise ValueError(f"tokens[{i}].{f} must be an unsigned integer, got {v!r}")
            vals.append(v)
        return cls(*vals)


@dataclass(frozen=True, slots=True)
class SourceVBucket:
    """One vbucket of the source at request time (``GET /vbuckets`` of the gateway)."""

    vbucket: int
    high_seqno: int
    failover_log: tuple[FailoverEntry, ...]


def _branch_end(log: Sequence[FailoverEntry], vbuuid: int) -> float | None:
    """The last seqno of branch ``vbuuid`` in ``log`` (newest first): the next newer entry's seqno, unbounded
    for the newest entry; None when the log does not know the branch."""
    for i, e in enumerate(log):
        if e.vbuuid == vbuuid:
            return math.inf if i == 0 else log[i - 1].seqno
    return None


def covered_seqno(pos: Position | None, source_log: Sequence[FailoverEntry]) -> int:
    """Up to which seqno the index position ``pos`` reflects the source's history with ``source_log``."""
    if pos is None or pos.seqno == 0:
        return 0
    end = _branch_end(source_log, pos.vbuuid)
    if end is None:
        return 0
    return int(min(pos.seqno, end))


def lag_seqnos(pos: Position | None, source: SourceVBucket) -> int:
    """How far the index is from the source in one vbucket (docs/search.md "Lag"): the source's seqnos the
    index does not reflect yet plus the seqnos the index holds beyond the source's history (a branch the source
    lost: their rollback is still to come). 0 only when the index ends at the source's own history."""
    covered = min(covered_seqno(pos, source.failover_log), source.high_seqno)
    held = 0 if pos is None else pos.seqno
    return source.high_seqno - covered + held - covered


def token_rollback(token: MutationToken, source: SourceVBucket,
                   index_log: Sequence[FailoverEntry] = ()) -> int | None:
    """None when the source still has the token's write; else the rollback point (the last seqno the source
    shares with the token's branch)."""
    end = _branch_end(source.failover_log, token.vbuuid)
    if end is not None:
        return None if token.seqno <= end else int(end)
    # the branch is unknown to the source: the common point of the branch's history as the index knew it
    for i, e in enumerate(index_log):
        if e.vbuuid == token.vbuuid:
            client = list(index_log[i:])
            p = rollback_point(server_log=list(source.failover_log), client_log=client, start_seqno=token.seqno,
                               high_seqno=source.high_seqno, snap_start=token.seqno, snap_end=token.seqno,
                               purge_seqno=0)
            return 0 if p is None else min(p, token.seqno)
    return 0


def index_token_rollback(token: MutationToken, index_log: Sequence[FailoverEntry]) -> int | None:
    """Without the source (no ``--source-url``): the rollback point when the indexer's own failover log of the
    token's vbucket proves its write lost -- the log has the token's branch ending below its seqno --, else None
    (a vbuuid the log does not have may be a branch the indexer has not consumed yet: waited for)."""
    end = _branch_end(index_log, token.vbuuid)
    return int(end) if end is not None and token.seqno > end else None


def missing_tokens(visible: Checkpoint, tokens: Sequence[MutationToken],
                   index_logs: Mapping[int, Sequence[FailoverEntry]]) -> list[dict[str, int]]:
    """Without the source: the tokens the ``visible`` checkpoint does not cover yet by the indexer's own failover
    logs -- a token is covered when its vbuuid is a branch of the index's log of its vbucket that reaches its
    seqno, and the index's position there is at or above that seqno."""
    out = []
    for t in sorted(tokens, key=lambda t: (t.vbucket, t.seqno)):
        if t.seqno <= 0:
            continue
        log = index_logs.get(t.vbucket, ())
        end = _branch_end(log, t.vbuuid)
        got = covered_seqno(visible.positions.get(t.vbucket), log)
        if end is None or t.seqno > end or got < t.seqno:
            out.append({"vbucket": t.vbucket, "vbuuid": t.vbuuid, "wanted_seqno": t.seqno,
                        "indexed_seqno": got if end is not None else 0})
    return out


def missing(visible: Checkpoint, wanted: Mapping[int, int],
            source_logs: Mapping[int, Sequence[FailoverEntry]]) -> list[dict[str, int]]:
    """The vbuckets whose ``wanted`` seqno the ``visible`` checkpoint does not cover yet."""
    out = []
    for vb, s in sorted(wanted.items()):
        if s <= 0:
            continue
        got = covered_seqno(visible.positions.get(vb), source_logs.get(vb, ()))
        if got < s:
            out.append({"vbucket": vb, "wanted_seqno": s, "indexed_seqno": got})
    return out


class SourcePositions(Protocol):
    """Where request_plus / at_plus read the source's positions at request time."""

    async def vbuckets(self) -> dict[int, SourceVBucket]: ...

    async def close(self) -> None: ...


class SourceUnavailable(ConnectorError):
    """The gateway's HTTP API did not answer ``GET /vbuckets`` (request_plus / at_plus need it)."""


class GatewaySource:
    """Reads the source's per-vbucket positions from the gateway's HTTP API (``GET {url}/vbuckets``), with
    HTTP Basic credentials when given."""

    def __init__(self, url: str, user: str | None = None, password: str | None = None,
                 timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.headers: dict[str, str] = {}
        if user is not None:
            cred = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
            self.headers["Authorization"] = f"Basic {cred}"
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def vbuckets(self) -> dict[int, SourceVBucket]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        try:
            async with self._session.get(f"{self.url}/vbuckets") as r:
                if r.status != 200:
                    text = (await r.text())[:300]
                    raise SourceUnavailable(f"{self.url}/vbuckets answered {r.status}: {text}")
                body = await r.json()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise SourceUnavailable(f"cannot read {self.url}/vbuckets: {e or type(e).__name__}") from e
        out = {}
        for v in body["vbuckets"]:
            if v.get("available") is False:
                continue
            out[int(v["vbucket"])] = SourceVBucket(
                int(v["vbucket"]), int(v["high_seqno"]),
                tuple(FailoverEntry(int(e["vbuuid"]), int(e["seqno"])) for e in v["failover_log"]))
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
