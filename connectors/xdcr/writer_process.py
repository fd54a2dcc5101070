"""The replicator's target writes in a process of their own (docs/xdcr.md "Performance").

The replication thread's work (the client's decoding, the changelog, batching) and the writes' (request
encoding, the target's answers) are both CPU work under one interpreter lock when they share a process. With
:class:`WriterProcess` the with-meta requests are encoded, sent and their answers parsed in a child process
(started through a ``forkserver``: no thread of the replicator is forked), which holds its own
:class:`~connectors.xdcr.target.TargetCluster` (the same URL and credentials, following the target's map
itself). The replicator's writer thread keeps everything else -- the GET_META comparison, counters, retries,
dead letters, target positions -- and hands each batch over a pipe as plain tuples; it waits for the answers
without holding the lock.

Errors come back as the same typed exceptions (``TargetUnreachable``, ``TargetAuthError``, ``KvError``, ...);
after one of them the child drops its connections and connects again at the next request. The child ends when
the pipe closes (the replicator closed or died).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from connectors.xdcr import errors
from connectors.xdcr.connection import Credentials
from connectors.xdcr.document import DocVersion
from connectors.xdcr.errors import TargetAuthError, TargetUnreachable, XdcrError
from connectors.xdcr.target import TargetCluster, TargetSpec, WriteOp, WriteResult

__all__ = ["WriterProcess"]

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload([__name__])

#: seconds the replicator waits for the child to end before killing it
_STOP_TIMEOUT = 5.0


def _op_tuple(o: WriteOp) -> tuple[Any, ...]:
    v = o.version
    return (o.vbucket, v.key, v.cas, v.rev_seqno, v.flags, v.expiry, v.deleted, v.datatype, v.value, o.options,
            o.add, o.expiration)


def _op(t: tuple[Any, ...]) -> WriteOp:
    vb, key, cas, rev, flags, expiry, deleted, dt, value, options, add, expiration = t
    return WriteOp(vb, DocVersion(key, cas, rev, flags, expiry, deleted, dt, value), options, add, expiration)


def _error(e: BaseException) -> tuple[str, str, int | None]:
    return type(e).__name__, str(e), getattr(e, "status", None)


def _raise(name: str, message: str, status: int | None) -> None:
    cls = getattr(errors, name, None)
    if cls is errors.KvError:
        raise errors.KvError(message, status or 0)
    if isinstance(cls, type) and issubclass(cls, XdcrError):
        raise cls(message)
    raise XdcrError(f"the target writer process failed: {name}: {message}")


def _serve(conn: Connection, url: str, user: str | None, password: str | None, timeout: float) -> None:
    """The child: answer requests until the pipe closes."""
    target = TargetCluster(TargetSpec.parse(url), Credentials(user, password), timeout=timeout)
    connected = False
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            cmd, arg = msg
            try:
                if not connected:
                    target.connect()
                    connected = True
                out: Any
                if cmd == "write":
                    out = [(r.status, r.token, r.reason, r.vbucket) for r in target.write([_op(t) for t in arg])]
                else:  # "get_meta"
                    out = target.get_meta(arg)
                reply: tuple[Any, ...] = ("ok", out, target.not_my_vbucket)
            except Exception as e:
                if isinstance(e, TargetUnreachable | TargetAuthError):
                    target.close()
                    connected = False
                reply = ("error", _error(e), target.not_my_vbucket)
            try:
                conn.send(reply)
            except (EOFError, OSError):
                return
    finally:
        target.close()
        conn.close()


def _shutdown(conn: Connection, proc: Any) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send(None)
    conn.close()
    proc.join(_STOP_TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join(_STOP_TIMEOUT)


class WriterProcess:
    """``write`` and ``get_meta`` of a :class:`TargetCluster` living in a child process (one caller thread
    at a time: the replicator's writer thread)."""

    def __init__(self, url: str, creds: Credentials, timeout: float = 30.0) -> None:
        self._conn, child = _CTX.Pipe()
        self._proc = _CTX.Process(target=_serve, args=(child, url, creds.user, creds.password, timeout),
                                  name="xdcr-writer", daemon=True)
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _shutdown, self._conn, self._proc)
        #: NOT_MY_VBUCKET answers the child followed
        self.not_my_vbucket = 0

    def _call(self, cmd: str, arg: Any) -> Any:
        try:
            self._conn.send((cmd, arg))
            kind, out, nmvb = self._conn.recv()
        except (EOFError, OSError) as e:
            raise XdcrError(f"the target writer process ended (exit code {self._proc.exitcode}): {e}") from e
        self.not_my_vbucket = nmvb
        if kind == "error":
            _raise(*out)
        return out

    def write(self, ops: Sequence[WriteOp]) -> list[WriteResult]:
        return [WriteResult(*r) for r in self._call("write", [_op_tuple(o) for o in ops])]

    def get_meta(self, keys: Sequence[tuple[int, bytes]]) -> list[DocVersion | None]:
        out: list[DocVersion | None] = self._call("get_meta", list(keys))
        return out

    def close(self) -> None:
        self._finalizer()
