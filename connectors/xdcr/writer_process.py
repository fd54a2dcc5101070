"""The replicator's target writes (docs/xdcr.md "How a change travels", "Performance"): one batch's transport
(:func:`transport`) and a process that runs it (:class:`WriterProcess`).

:func:`transport` is what a batch needs from the target (``batch.send_batch``, the one implementation the Spark
job uses too): the GET_META pre-check of documents above the optimistic threshold, the with-meta writes, and
their retries, with backoff. It returns the final answer of every request as plain tuples (:class:`Outcome`,
with the count of target-map refreshes its connection made); the replicator counts them with
``batch.account``, dead-letters, raises, and checks the target positions when the map changed.

:class:`WriterProcess` runs it in a child process (``python -m connectors.xdcr.writer_process FD
PARENT_PID``: a fresh interpreter, nothing of the replicator forked or re-imported; URL and credentials come over
the socket pair, not the command line) with a :class:`~connectors.xdcr.target.TargetCluster` of its own
(following the target's map itself): the client's decoding and the changelog (the replication thread) no longer
share one interpreter lock with the requests' encoding and the answers' parsing. Batches are
handed over a pipe as plain tuples and *pipelined*: the replicator sends the next ones while the child writes
the current one, so the child goes from one batch to the next without waiting for the replicator. The child
runs them strictly in order, each to its end (retries included) before the next: a key's versions reach the
target in order, forced restores too.

A batch the child could not write (the target unreachable, refused credentials) is answered with the error and
every batch after it with :class:`Skipped` until :meth:`WriterProcess.reset`: the replicator writes them again,
in order, with its backoff. The child drops its connections after such an error and connects again at the next
request; it ends when the pipe closes (the replicator closed or died).

A replicator killed with batches still queued in the pipe must not be outlived by its writes: the child checks
that its parent is still the replicator before each batch and between the retries of one, and stops at once when
it is not. Otherwise the orphan would go on writing its queue -- behind the back of the next replicator, which
restores from its checkpoint, possibly with forced writes after a source rollback that an orphan's stale batch
would then overwrite (docs/xdcr.md "How a change travels").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from connectors.xdcr import errors
from connectors.xdcr.batch import Outcome, send_batch
from connectors.xdcr.connection import Credentials
from connectors.xdcr.document import ConflictMode, DocVersion
from connectors.xdcr.errors import TargetAuthError, TargetUnreachable, XdcrError
from connectors.xdcr.target import TargetCluster, TargetSpec, WriteOp

__all__ = ["Outcome", "Skipped", "WriterProcess", "transport"]

#: seconds the replicator waits for the child to end before killing it
_STOP_TIMEOUT = 5.0

#: one batch's requests: the pre-check, the writes and their retries (``batch.send_batch``, shared with the
#: Spark job; the replicator counts the :class:`Outcome` with ``batch.account``)
transport = send_batch


class Skipped(XdcrError):
    """The writer process did not write this batch: an earlier one failed (written again, in order)."""


# -------------------------------------------------------------------------------------------- the process
def _op_tuple(o: WriteOp) -> tuple[Any, ...]:
    v = o.version
    return (o.vbucket, v.key, v.cas, v.rev_seqno, v.flags, v.expiry, v.deleted, v.datatype, v.value, o.options,
            o.add, o.expiration)


def _op(t: tuple[Any, ...]) -> WriteOp:
    vb, key, cas, rev, flags, expiry, deleted, dt, value, options, add, expiration = t
    return WriteOp(vb, DocVersion(key, cas, rev, flags, expiry, deleted, dt, value), options, add, expiration)


def _error(e: BaseException) -> tuple[str, str, int | None]:
    return type(e).__name__, str(e), getattr(e, "status", None)


def _rebuild(name: str, message: str, status: int | None) -> XdcrError:
    cls = getattr(errors, name, None)
    if cls is errors.KvError:
        return errors.KvError(message, status or 0)
    if isinstance(cls, type) and issubclass(cls, XdcrError):
        return cls(message)
    return XdcrError(f"the target writer process failed: {name}: {message}")


class _ReplicatorGone(Exception):
    """The child's parent is no longer the replicator that started it (it died): stop writing."""


def _orphaned(parent: int) -> bool:
    """The replicator that started this child died (the child was given to another parent)."""
    return os.getppid() != parent


def _retry_sleep(parent: int) -> Callable[[float], None]:
    """The backoff between a batch's retries, ending the batch once the replicator died."""

    def sleep(seconds: float) -> None:
        time.sleep(seconds)
        if _orphaned(parent):
            raise _ReplicatorGone

    return sleep


def _serve(conn: Connection, url: str, user: str | None, password: str | None, timeout: float, mode: str,
           threshold: int, parent: int) -> None:
    """The child: answer every message, in order, until the pipe closes or the replicator (``parent``) died."""
    target = TargetCluster(TargetSpec.parse(url), Credentials(user, password), timeout=timeout)
    sleep = _retry_sleep(parent)
    connected = failed = False
    seen = -1  # the map refreshes reported to the replicator (-1: not connected yet)
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None or _orphaned(parent):
                return  # closed; or the replicator died with this batch still queued: not written
            cmd, arg = msg
            reply: tuple[Any, ...]
            if cmd == "reset":
                failed = False
                reply = ("ok", None)
            elif failed:
                reply = ("skipped", None)
            else:
                try:
                    if not connected:
                        target.connect()
                        connected = True
                        if seen < 0:  # the first map is no change
                            seen = target.map_refreshes
                    out = transport(target, [_op(t) for t in arg], ConflictMode(mode), threshold, sleep)
                    # every map refresh since the last answer: reconnections after a failed batch included
                    out.map_refreshes = target.map_refreshes - seen
                    seen = target.map_refreshes
                    reply = ("ok", out)
                except _ReplicatorGone:
                    return
                except Exception as e:
                    if isinstance(e, TargetUnreachable | TargetAuthError):
                        target.close()
                        connected = False
                    failed = True
                    reply = ("error", _error(e))
            try:
                conn.send(reply)
            except (EOFError, OSError):
                return
    finally:
        target.close()
        conn.close()


def main() -> None:
    """``python -m connectors.xdcr.writer_process FD PARENT_PID``: the child, on the inherited socket ``FD``,
    started by the replicator ``PARENT_PID``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the replicator decides when it ends (it closes the socket)
    conn = Connection(int(sys.argv[1]))
    parent = int(sys.argv[2])  # the replicator's pid (it may be dead already: then this is not our parent)
    try:
        settings = conn.recv()
    except (EOFError, OSError):
        return
    url, user, password, timeout, mode, threshold = settings
    _serve(conn, url, user, password, timeout, mode, threshold, parent)


def _shutdown(conn: Connection, proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send(None)
    try:
        proc.wait(_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(_STOP_TIMEOUT)
    conn.close()


class WriterProcess:
    """Batches written by a child process, pipelined (module docstring). :meth:`submit` is called by one
    thread (the replication thread); the answers are read by a thread of this object."""

    def __init__(self, url: str, creds: Credentials, *, timeout: float = 30.0,
                 mode: ConflictMode = ConflictMode.SEQNO, threshold: int = 256) -> None:
        mine, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's packages
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno()), str(os.getpid())],
                                          pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env)
        finally:
            child.close()
        self._conn = Connection(mine.detach())
        self._conn.send((url, creds.user, creds.password, timeout, mode.value, threshold))
        self._waiting: deque[concurrent.futures.Future[Any]] = deque()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="xdcr-writer-answers", daemon=True)
        self._reader.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._conn, self._proc)

    def _post(self, cmd: str, arg: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._waiting.append(fut)
        try:
            self._conn.send((cmd, arg))
        except (OSError, ValueError) as e:
            with self._lock:
                self._waiting.remove(fut)
            raise XdcrError(f"the target writer process ended (exit code {self._proc.poll()}): {e}") from e
        return fut

    def submit(self, ops: Sequence[WriteOp]) -> concurrent.futures.Future[Outcome]:
        """Queue a batch; the future's result is its :class:`Outcome`, or its error (:class:`Skipped` when an
        earlier batch failed)."""
        return self._post("write", [_op_tuple(o) for o in ops])

    def reset(self) -> None:
        """Let the child write again after a failed batch (the batches before this call stay skipped)."""
        self._post("reset", None).result()

    def _read(self) -> None:
        while True:
            try:
                kind, out = self._conn.recv()
            except Exception:  # closed, or an answer that does not unpickle: the futures fail below
                break
            with self._lock:
                fut = self._waiting.popleft()
            if kind == "ok":
                fut.set_result(out)
            elif kind == "skipped":
                fut.set_exception(Skipped("an earlier batch failed"))
            else:
                fut.set_exception(_rebuild(*out))
        with self._lock:
            left = list(self._waiting)
            self._waiting.clear()
        for fut in left:
            fut.set_exception(XdcrError(f"the target writer process ended (exit code {self._proc.poll()})"))

    def close(self) -> None:
        self._finalizer()


if __name__ == "__main__":
    # run as the module itself (not ``__main__``): what it sends back unpickles as connectors.xdcr.writer_process
    from connectors.xdcr.writer_process import main as _main

    _main()
