"""Writing one batch with meta to the target, shared by the replicator and the Spark job (docs/xdcr.md
"How a change travels", steps 3 and 5).

* **Optimistic replication** (goxdcr ``optimisticReplicationThreshold``): a document whose body is larger than
  the threshold is first asked about with GET_META (pipelined for the batch) and not sent when the target's
  version is identical or wins (``document.compare``); a key the target has never seen goes as ADD_WITH_META.
  Forced writes (the undo of a rolled-back branch) are never asked about.
* **Answers**: SUCCESS is written (``on_written`` gets the mutation token); KEY_EEXISTS a conflict loss counted
  by the reason in the error context; temporary failures and NOT_MY_VBUCKET after re-routing are retried with
  backoff; E2BIG and any other permanent status are dead-lettered and the batch goes on; UNKNOWN_COMMAND /
  NOT_SUPPORTED / EACCESS stop replication (:class:`XdcrError`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from connectors.xdcr.document import ConflictMode, compare
from connectors.xdcr.errors import TargetUnreachable, XdcrError
from connectors.xdcr.mcbp import RETRYABLE, SKIP_CONFLICT_RESOLUTION_FLAG, Status
from connectors.xdcr.metrics import Metrics
from connectors.xdcr.target import TargetCluster, WriteOp, WriteResult

__all__ = ["precheck", "status_name", "write_batch"]

#: rounds of re-sending writes refused with a temporary status before the batch raises TargetUnreachable
RETRY_ROUNDS = 20


def status_name(st: int) -> str:
    try:
        return Status(st).name.lower()
    except ValueError:
        return f"0x{st:02x}"


def precheck(target: TargetCluster, ops: Sequence[WriteOp], threshold: int, mode: ConflictMode,
             metrics: Metrics) -> list[WriteOp]:
    """The ops to send: those up to ``threshold`` bytes and forced ones as they are; larger ones only when
    GET_META shows the target would not reject them (each skip counted ``rejected_<why>``)."""
    check = [o for o in ops if not o.options & SKIP_CONFLICT_RESOLUTION_FLAG
             and len(o.version.value or b"") > threshold]
    if not check:
        return list(ops)
    metrics.get_meta += len(check)
    skip: set[int] = set()
    for o, meta in zip(check, target.get_meta([(o.vbucket, o.version.key) for o in check]), strict=True):
        why = compare(o.version, meta, mode)
        if why is not None:
            metrics.reject(f"rejected_{why}")
            skip.add(id(o))
        else:
            o.add = meta is None
    return [o for o in ops if id(o) not in skip]


def write_batch(target: TargetCluster, ops: Sequence[WriteOp], *, threshold: int, mode: ConflictMode,
                metrics: Metrics, dead_letter: Callable[[dict[str, Any]], None],
                on_written: Callable[[WriteOp, WriteResult], None],
                sleep: Callable[[float], None] = time.sleep,
                after_write: Callable[[], None] | None = None) -> None:
    """Pre-check, send and account one batch (see the module docstring). ``after_write`` runs after every
    round of writes, before their answers are accounted (the replicator's check of a changed target map)."""
    t0 = time.monotonic()
    m = metrics
    send = precheck(target, ops, threshold, mode, m)
    for attempt in range(RETRY_ROUNDS):
        if not send:
            break
        again: list[WriteOp] = []
        results = target.write(send)
        if after_write is not None:
            after_write()
        for o, r in zip(send, results, strict=True):
            st = r.status
            if st == Status.SUCCESS:
                m.written += 1
                on_written(o, r)
            elif st == Status.KEY_EEXISTS and o.add:
                o.add = False  # created meanwhile: conflict resolution decides
                again.append(o)
            elif st == Status.KEY_EEXISTS:
                # the target's conflict resolution kept its version (reason from its error context)
                m.reject(r.reason or "rejected_conflict")
            elif st in RETRYABLE or st == Status.NOT_MY_VBUCKET:
                again.append(o)
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
        send = again
        if send:
            m.retries += 1
            sleep(min(0.01 * 2 ** attempt, 2.0))
    if send:
        raise TargetUnreachable(f"{len(send)} write(s) still refused with temporary failures after retries")
    m.not_my_vbucket = target.not_my_vbucket
    m.batch(time.monotonic() - t0)
