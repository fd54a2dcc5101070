"""Writing one batch with meta to the target, shared by the replicator (its writer process or thread,
``writer_process.py``) and the Spark job (docs/xdcr.md "How a change travels", steps 3 and 5).

Two halves, so the requests can be made in one process and the answers counted in another:

* :func:`send_batch` -- what a batch needs from the target, returned as plain values (:class:`Outcome`):
  **optimistic replication** (goxdcr ``optimisticReplicationThreshold``, :func:`precheck`): a document whose body
  is larger than the threshold is first asked about with GET_META (pipelined for the batch) and not sent when
  the target's version is identical or wins (``document.compare``); a key the target has never seen goes as
  ADD_WITH_META. Forced writes (the undo of a rolled-back branch) are never asked about. Temporary failures,
  NOT_MY_VBUCKET after re-routing and an ADD that met a document are retried with backoff; still refused after
  ``RETRY_ROUNDS`` rounds, the batch raises :class:`TargetUnreachable`.
* :func:`account` -- the **answers**: what the pre-check kept back is counted ``skipped`` by why (``behind``,
  ``identical``: never sent, so never counted by the target); SUCCESS is written (``on_written`` gets the mutation token); KEY_EEXISTS a
  conflict loss counted by the reason in the error context; E2BIG and any other permanent status are
  dead-lettered and the batch goes on; UNKNOWN_COMMAND / NOT_SUPPORTED / EACCESS stop replication
  (:class:`XdcrError`).

:func:`write_batch` is both in one process (the Spark job).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from connectors.xdcr.document import ConflictMode, compare
from connectors.xdcr.errors import TargetUnreachable, XdcrError
from connectors.xdcr.mcbp import RETRYABLE, SKIP_CONFLICT_RESOLUTION_FLAG, Status
from connectors.xdcr.metrics import Metrics
from connectors.xdcr.target import TargetCluster, WriteOp, WriteResult

__all__ = ["Outcome", "account", "precheck", "send_batch", "status_name", "write_batch"]

#: rounds of re-sending writes refused with a temporary status before the batch raises TargetUnreachable
RETRY_ROUNDS = 20


def status_name(st: int) -> str:
    try:
        return Status(st).name.lower()
    except ValueError:
        return f"0x{st:02x}"


@dataclass(slots=True)
class Outcome:
    """A batch's answers: ``results`` (op index, status, mutation token, error-context reason, target vbucket)
    for every request sent, ``skipped`` (op index, ``"behind"`` / ``"identical"``) for those the GET_META
    pre-check kept back; ``map_refreshes``: how often the writing connection re-read the target's map meanwhile
    (a failover or rebalance on the target: the replicator checks the target positions it knows)."""

    results: list[tuple[int, int, tuple[int, int] | None, str, int]]
    skipped: list[tuple[int, str]]
    get_meta: int
    retries: int
    not_my_vbucket: int
    seconds: float
    map_refreshes: int = 0


def precheck(target: TargetCluster, ops: Sequence[WriteOp], threshold: int,
             mode: ConflictMode) -> tuple[list[tuple[int, str]], int]:
    """The GET_META pre-check: ``(skipped, asked)`` -- the ops not to send (index, why the target would reject
    it) and how many were asked about. Those the target has never seen are marked ``add``."""
    check = [i for i, o in enumerate(ops) if not o.options & SKIP_CONFLICT_RESOLUTION_FLAG
             and len(o.version.value or b"") > threshold]
    skipped: list[tuple[int, str]] = []
    if check:
        metas = target.get_meta([(ops[i].vbucket, ops[i].version.key) for i in check])
        for i, meta in zip(check, metas, strict=True):
            why = compare(ops[i].version, meta, mode)
            if why is not None:
                skipped.append((i, why))
            else:
                ops[i].add = meta is None
    return skipped, len(check)


def send_batch(target: TargetCluster, ops: Sequence[WriteOp], mode: ConflictMode, threshold: int,
               sleep: Callable[[float], None] = time.sleep, out: Outcome | None = None) -> Outcome:
    """Pre-check and write one batch, with retries (module docstring); the final answer of every request sent.
    Raises ``TargetUnreachable`` when requests are still refused after ``RETRY_ROUNDS`` (or the target went
    away): what was answered before is in ``out`` when the caller passed one (an empty :class:`Outcome`)."""
    t0 = time.monotonic()
    refreshes = target.map_refreshes
    if out is None:
        out = Outcome([], [], 0, 0, 0, 0.0)
    skipped, out.get_meta = precheck(target, ops, threshold, mode)
    out.skipped = skipped
    held = {i for i, _ in skipped}
    send = [i for i in range(len(ops)) if i not in held]
    results = out.results
    for attempt in range(RETRY_ROUNDS):
        if not send:
            break
        again: list[int] = []
        for i, r in zip(send, target.write([ops[i] for i in send]), strict=True):
            st = r.status
            if st == Status.KEY_EEXISTS and ops[i].add:
                ops[i].add = False  # created meanwhile: conflict resolution decides
                again.append(i)
            elif st in RETRYABLE or st == Status.NOT_MY_VBUCKET:
                again.append(i)
            else:
                results.append((i, st, r.token, r.reason, r.vbucket))
        send = again
        if send:
            out.retries += 1
            sleep(min(0.01 * 2 ** attempt, 2.0))
    if send:
        raise TargetUnreachable(f"{len(send)} write(s) still refused with temporary failures after retries")
    out.not_my_vbucket = target.not_my_vbucket
    out.seconds = time.monotonic() - t0
    out.map_refreshes = target.map_refreshes - refreshes
    return out


def account(ops: Sequence[WriteOp], out: Outcome, metrics: Metrics, *,
            dead_letter: Callable[[dict[str, Any]], None],
            on_written: Callable[[WriteOp, WriteResult], None]) -> None:
    """Count a sent batch's answers (module docstring); dead-letter what the target refused for good."""
    m = metrics
    m.get_meta += out.get_meta
    for _i, why in out.skipped:
        m.skip(why)  # never sent: counted apart from the target's own rejections
    for i, st, token, reason, tvb in out.results:
        o = ops[i]
        if st == Status.SUCCESS:
            m.written += 1
            on_written(o, WriteResult(st, token, reason, tvb))
        elif st == Status.KEY_EEXISTS:
            # the target's conflict resolution kept its version (reason from its error context)
            m.reject(reason or "rejected_conflict")
        elif st in (Status.UNKNOWN_COMMAND, Status.NOT_SUPPORTED, Status.EACCESS):
            why = ("the user may not write with meta (it needs the replication_target role)"
                   if st == Status.EACCESS else "the target does not support writes with meta")
            raise XdcrError(f"{why}: {status_name(st)} for {o.version.key!r}")
        elif st == Status.E2BIG:
            m.reject("too_big")
            dead_letter({"reason": "too_big", "vbucket": o.vbucket,
                         "key": o.version.key.decode("utf-8", "replace"), "size": len(o.version.value or b"")})
        else:
            name = status_name(st)
            m.reject(f"target_{name}")
            dead_letter({"reason": f"target_{name}", "vbucket": o.vbucket,
                         "key": o.version.key.decode("utf-8", "replace")})
    m.retries += out.retries
    m.not_my_vbucket = out.not_my_vbucket
    m.batch(out.seconds)


def write_batch(target: TargetCluster, ops: Sequence[WriteOp], *, threshold: int, mode: ConflictMode,
                metrics: Metrics, dead_letter: Callable[[dict[str, Any]], None],
                on_written: Callable[[WriteOp, WriteResult], None],
                sleep: Callable[[float], None] = time.sleep) -> None:
    """Send and account one batch in this process (:func:`send_batch`, then :func:`account`). A batch the
    target stopped answering is accounted as far as it was answered (its written documents are recorded as
    written) before the error is raised."""
    out = Outcome([], [], 0, 0, 0, 0.0)
    try:
        send_batch(target, ops, mode, threshold, sleep, out)
    except TargetUnreachable:
        out.not_my_vbucket = target.not_my_vbucket
        account(ops, out, metrics, dead_letter=dead_letter, on_written=on_written)
        raise
    account(ops, out, metrics, dead_letter=dead_letter, on_written=on_written)
