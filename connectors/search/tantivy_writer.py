"""The tantivy backend with its writer in a process of its own (docs/search.md "Performance").

The indexer's consumer thread (decoding, the document store) and the building of tantivy documents both need
CPython's GIL: in one process they run one after the other. :class:`TantivyWriterProcess` keeps the same
:class:`~connectors.search.backend.IndexBackend` behaviour as :class:`~connectors.search.tantivy_backend.
TantivyBackend` but runs the writer -- ``TantivyBackend.apply`` and ``commit`` -- in a child process
(a fresh interpreter running this module's :func:`main`, without ``site`` and on the parent's import path:
never a fork of a process running librdkafka's threads), fed over a pipe (pickled tuples): the indexer's commit thread streams each store commit's
rows to it without waiting (:meth:`TantivyWriterProcess.stream_rows`), then the generation's commit. Searches, :meth:`checkpoint` and :meth:`keys` read the same index directory in the
indexer's process (a reader reloaded after every commit the child acknowledged): a commit's documents and its
checkpoint are still seen together.

Crash semantics: the child reads its requests from its stdin and exits at end of file -- when the indexer
closes it or dies (even killed -9), dropping whatever it applied and did not commit, and its writer lock with it.
A child that starts while an older one still holds the writer lock waits for it (``LOCK_WAIT`` seconds). When the
child dies under a running indexer (killed, out of memory), the request in progress fails with
:class:`WriterProcessDied` -- a backend failure: the indexer reports it, keeps the changes in its document store
and retries with backoff -- and the next request starts a new child, which resumes from the last commit.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Final, NamedTuple

from connectors.exceptions import ConnectorError
from connectors.search.backend import ApplyStats, Checkpoint, Delete, IndexOp, SearchResult
from connectors.search.mapping import DocumentMapping
from connectors.search.tantivy_backend import WRITER_HEAP, TantivyBackend

__all__ = ["LOCK_WAIT", "MAX_UNANSWERED", "TantivyWriterProcess", "WriterProcessDied"]

log = logging.getLogger(__name__)

#: seconds a new writer process waits for the writer lock an older one (still exiting) holds
LOCK_WAIT: Final = 30.0
#: seconds the indexer waits for the writer process to exit when closing it
CLOSE_WAIT: Final = 30.0
#: at most this many keys are tracked to skip the deletes of keys never indexed (some 150 MB); above it every
#: upsert deletes the key's previous version first
MAX_TRACKED_KEYS: Final = 1_000_000
#: streamed applies (:meth:`TantivyWriterProcess.stream_rows`) sent and not answered yet, at most: the next one
#: waits for the oldest answer (the child always has the next chunk in its pipe, and its answers never fill theirs)
MAX_UNANSWERED: Final = 2
_LEN = struct.Struct(">Q")
#: the head of a changelog segment's entry: :data:`connectors.client.changelog.ENTRY_HEAD` (not imported: it
#: would add the client's modules to the child's start-up)
ENTRY_HEAD: Final = struct.Struct(">QHI")


class _UpsertRow(NamedTuple):
    """An :class:`~connectors.search.backend.Upsert`'s fields (what ``TantivyBackend.apply`` reads)."""

    key: str
    vbucket: int
    seqno: int
    value: bytes


class WriterProcessDied(ConnectorError):
    """The tantivy writer process exited under a request (what it applied and did not commit is lost)."""


#: the child's command line: ``-S`` -- no ``site`` (its start-up, and the editable install's import hook, are a
#: third of the child's start before it is ready, which the indexer's constructor waits for); the import path
#: is the parent's instead, headed by the directory of this very ``connectors`` package -- not the working
#: directory's -- so the child always runs the parent's code
_CHILD_CODE: Final = "import sys; sys.path[0:1] = sys.argv[1:]; from connectors.search.tantivy_writer import main; main()"
_PACKAGE_ROOT: Final = str(Path(__file__).resolve().parents[2])


#: the writer process's young-generation GC threshold (:func:`main`)
WRITER_GC_YOUNG_THRESHOLD: Final = 50_000


def _child_command() -> list[str]:
    return [sys.executable, "-S", "-c", _CHILD_CODE, _PACKAGE_ROOT, *[p for p in sys.path if p and p != _PACKAGE_ROOT]]


def _send(f: IO[bytes], msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(data)))
    f.write(data)
    f.flush()


def _recv(f: IO[bytes]) -> Any:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    n = _LEN.unpack(head)[0]
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


class TantivyWriterProcess:
    """:class:`~connectors.search.backend.IndexBackend` on a tantivy index in ``path``, its writer in a child
    process (module docstring). The child starts at once; the first request waits until it is ready."""

    def __init__(self, path: str | Path, mapping: DocumentMapping, *, heap: int = WRITER_HEAP) -> None:
        self.path = Path(path)
        self.mapping = mapping
        self.heap = heap
        self._lock = threading.Lock()  # one request at a time on the pipe
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._reader: TantivyBackend | None = None
        self._closed = False
        #: streamed applies whose answer is not read yet, and what the answered ones did since :meth:`take_stats`
        self._unanswered = 0
        self._streamed = ApplyStats()
        self._start()

    # ------------------------------------------------------------------------------------ the child
    def _start(self) -> None:
        self._proc = subprocess.Popen(_child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._ready = False
        assert self._proc.stdin is not None
        _send(self._proc.stdin, (str(self.path), self.mapping, self.heap))

    @property
    def pid(self) -> int | None:
        """The writer process (None: not running)."""
        return None if self._proc is None else self._proc.pid

    def _died(self) -> WriterProcessDied:
        proc = self._proc
        code = None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(5)
            for f in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    if f is not None:
                        f.close()
        self._proc = None
        self._ready = False
        self._unanswered = 0
        return WriterProcessDied(f"the tantivy writer process of {self.path} exited (code {code}): what it applied "
                                 f"since its last commit is lost")

    def _request(self, msg: Any, *, wait: bool = True) -> Any:
        """Send ``msg`` to the child (started again if it died) and return its answer -- after the answers of
        the streamed applies before it. ``wait`` False (a streamed apply): return once sent, with at most
        ``MAX_UNANSWERED`` answers outstanding; a failed one raises from a later request."""
        with self._lock:
            if self._closed:
                raise ConnectorError(f"the tantivy writer of {self.path} is closed")
            if self._proc is None:
                self._start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            try:
                if not self._ready:
                    self._answer(_recv(proc.stdout))
                    self._ready = True
                    if self._reader is None:
                        self._reader = TantivyBackend(self.path, self.mapping, writer=False)
                    else:
                        self._reader.reload()
                if msg is None:
                    return None
                if not wait:
                    self._drain(proc.stdout, MAX_UNANSWERED - 1)
                    _send(proc.stdin, msg)
                    self._unanswered += 1
                    return None
                self._drain(proc.stdout, 0)
                _send(proc.stdin, msg)
                return self._answer(_recv(proc.stdout))
            except (EOFError, OSError) as e:
                raise self._died() from e

    def _drain(self, f: IO[bytes], limit: int) -> None:
        """Read the streamed applies' answers until at most ``limit`` are outstanding (the first failure raises)."""
        while self._unanswered > limit:
            reply = _recv(f)
            self._unanswered -= 1
            self._streamed.add(ApplyStats(*self._answer(reply)))

    @staticmethod
    def _answer(reply: tuple[str, Any]) -> Any:
        status, value = reply
        if status == "error":
            raise ConnectorError(f"tantivy writer: {value}")
        return value

    def started(self) -> bool:
        """The child answered its start (ready, or failed to open the index: the next request says which), or
        exited; False while it is still starting (never waits). The indexer decodes its first records meanwhile
        (docs/search.md "Performance")."""
        with self._lock:
            proc = self._proc
            if self._ready or proc is None or proc.stdout is None:
                return True
            return bool(select.select([proc.stdout], [], [], 0)[0])

    def _ensure_ready(self) -> TantivyBackend:
        if self._reader is None or not self._ready:
            self._request(None)
        assert self._reader is not None
        return self._reader

    # --------------------------------------------------------------------------------- IndexBackend
    def apply(self, ops: Sequence[IndexOp]) -> ApplyStats:
        return self.apply_rows([(op.key, None if isinstance(op, Delete) else op.value, op.vbucket, op.seqno)
                                for op in ops])

    def apply_rows(self, rows: Sequence[tuple[Any, ...]]) -> ApplyStats:
        """:meth:`apply` of ``(key, value, vbucket, seqno, ...)`` tuples (value None: a delete) -- the indexer's
        store rows as they are, pickled as plain tuples."""
        return ApplyStats(*self._request(("apply", rows)))

    def stream_rows(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """:meth:`apply_rows` without waiting for the child -- its items rows, or changelog segments ``(vbucket,
        data)`` (``data``: entries packed by :func:`connectors.client.changelog.pack_entry`, a version
        ``b"\x01" + body`` or ``b"\x00"`` for a deletion, as the indexer's changelog holds them), applied in
        order (docs/search.md "Performance": the indexer streams
        each store commit's rows as it happens): at most ``MAX_UNANSWERED`` chunks unanswered, then it waits for
        the oldest. A failed chunk raises from the next request -- :meth:`commit` at the latest, which therefore
        never commits a checkpoint whose rows the child did not all apply (nor a child started again after one
        died: its applies are lost with it, and the request that finds it dead raises)."""
        self._request(("apply", rows), wait=False)

    def take_stats(self) -> ApplyStats:
        """What the answered streamed applies did since the last call."""
        with self._lock:
            st, self._streamed = self._streamed, ApplyStats()
        return st

    def commit(self, checkpoint: Checkpoint) -> None:
        self._request(("commit", checkpoint.to_json()))
        assert self._reader is not None
        self._reader.reload()

    def checkpoint(self) -> Checkpoint | None:
        return self._ensure_ready().checkpoint()

    def reset(self) -> None:
        self._request(("reset", None))
        assert self._reader is not None
        self._reader.reload()

    def search(self, query: str, limit: int = 10, offset: int = 0) -> SearchResult:
        return self._ensure_ready().search(query, limit, offset)

    def keys(self) -> dict[str, tuple[int, int, dict[str, Any]]]:
        """Every indexed document: key -> (vbucket, seqno, stored fields) (tests, ``dcpgw index`` checks)."""
        return self._ensure_ready().keys()

    def kill(self) -> None:
        """Kill the writer process at once, as a crash would (tests: nothing applied since its commit stays)."""
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()

    def close(self) -> None:
        """Drop what was applied and not committed, and let the child exit (its writer lock goes with it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            proc, self._proc = self._proc, None
            if proc is None:
                return
            for f in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    if f is not None:
                        f.close()
            try:
                proc.wait(CLOSE_WAIT)
            except subprocess.TimeoutExpired:
                log.warning("the tantivy writer process %d did not exit: killing it", proc.pid)
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------------------------------- the child
def _open_writer(path: str, mapping: DocumentMapping, heap: int) -> TantivyBackend:
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            return TantivyBackend(path, mapping, heap=heap)
        except ValueError as e:
            # an older writer (a previous indexer process, still exiting) holds the lock
            if "LockBusy" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def _ops(items: Sequence[tuple[Any, ...]]) -> list[IndexOp]:
    """The operations of an apply request: rows ``(key, value -- None: a delete --, vbucket, seqno, ...)`` and
    changelog segments ``(vbucket, data)`` (:meth:`TantivyWriterProcess.stream_rows`), in order. Upserts as
    named tuples: ``TantivyBackend.apply`` reads their fields (a frozen dataclass costs more to build than the
    tantivy document)."""
    ops: list[Any] = []
    op = ops.append
    unpack, size = ENTRY_HEAD.unpack_from, ENTRY_HEAD.size
    # (a named tuple built with tuple.__new__: no call of its generated __new__ per upsert, as
    # schemas.codec.read_change builds the client's changes)
    new, upsert = tuple.__new__, _UpsertRow
    for r in items:
        if len(r) != 2:
            op(Delete(r[0], r[2], r[3]) if r[1] is None else _UpsertRow(r[0], r[2], r[3], r[1]))
            continue
        vb, data = r
        pos, end = 0, len(data)
        while pos < end:
            seqno, klen, vlen = unpack(data, pos)
            pos += size
            v = pos
            pos += vlen
            key = data[pos:pos + klen].decode("utf-8", "surrogateescape")
            pos += klen
            if data[v] == 1:  # b"\x01" + the body
                op(new(upsert, (key, vb, seqno, data[v + 1:v + vlen])))
            else:
                op(Delete(key, vb, seqno))
    return ops


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """The child's loop: requests from ``inp`` until its end, answers to ``out``."""
    path, mapping, heap = _recv(inp)
    try:
        backend = _open_writer(path, mapping, heap)
    except Exception as e:
        _send(out, ("error", f"{type(e).__name__}: {e}"))
        return
    _send(out, ("ready", None))
    # the keys the index may hold, while the writer knows them all (it started on an empty index and nothing
    # failed since): a key it never added is not in the index, its delete is skipped (docs/search.md
    # "Performance"); None once unknown
    present: set[str] | None = set() if backend.documents() == 0 else None
    try:
        while True:
            try:
                what, arg = _recv(inp)
            except EOFError:
                return  # the indexer closed the pipe or died: drop what is not committed
            try:
                if what == "apply":
                    ops = _ops(arg)
                    st = backend.apply(ops, present=present)
                    if present is not None and len(present) > MAX_TRACKED_KEYS:
                        present = None
                    value: Any = (st.indexed, st.deleted, st.binary_skipped, st.field_rejected, st.rejected)
                elif what == "commit":
                    backend.commit(Checkpoint.from_json(arg))
                    value = None
                elif what == "reset":
                    present = None
                    backend.reset()
                    present = set()
                    value = None
                else:
                    raise ValueError(f"unknown request {what!r}")
            except Exception as e:
                present = None  # what the writer holds is no longer known for sure
                _send(out, ("error", f"{type(e).__name__}: {e}"))
            else:
                _send(out, ("ok", value))
    finally:
        backend.close()


def main() -> None:
    # CPython's cyclic GC: with the default young-generation threshold (700 allocations) a request of thousands
    # of documents triggers collections that rescan its operations and documents and promote them into full
    # collections; nothing the writer allocates forms reference cycles (refcounting frees it), so it collects
    # seldom -- as the client's consumer loop does (connectors.client.consumer.GC_YOUNG_THRESHOLD). About a tenth
    # of the writer's CPU (docs/search.md "Performance").
    gc.set_threshold(WRITER_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # the pipes as raw binary files; nothing else may write to stdout
    inp = os.fdopen(sys.stdin.fileno(), "rb", buffering=1 << 20, closefd=False)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=1 << 16)
    sys.stdout = sys.stderr
    with contextlib.suppress(BrokenPipeError):
        serve(inp, out)


if __name__ == "__main__":
    main()
