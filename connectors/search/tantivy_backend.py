"""The embedded index backend: a tantivy index on local disk (docs/search.md "The tantivy backend").

One tantivy document per source document, keyed by the raw term ``_key``; the checkpoint (generation and
per-vbucket positions) is one more document, ``_kind:meta``, replaced in every commit -- tantivy commits are
atomic, so the index and the positions it reflects are always read together (a searcher sees both from the
same commit). Mapped fields become tantivy fields of their type; a dynamic document type is indexed as the JSON
field ``doc`` (a default field of the query parser, so ``name:alice`` finds ``{"name": "alice"}``; fast, so
ranges work on its numbers) and its string values once more in the text field ``_all`` (the catch-all of
unqualified terms: tantivy's parser searches only the root path of a JSON default field, so ``alice`` alone
would find nothing in ``doc``); what a hit returns is kept as JSON in the stored bytes field ``_stored``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import tantivy

from connectors.search.backend import (
    ApplyStats,
    Checkpoint,
    Delete,
    Hit,
    IndexOp,
    SearchError,
    SearchResult,
    Upsert,
)
from connectors.search.mapping import DocumentMapping

__all__ = ["META_KEY", "TantivyBackend"]

log = logging.getLogger(__name__)

#: ``_key`` of the checkpoint document (source keys never contain a NUL byte... and if one did, its _kind is doc)
META_KEY: Final = "\x00dcpgw:checkpoint"
#: the writer's memory budget (tantivy flushes a segment when it is reached; commits are the indexer's)
WRITER_HEAP: Final = 64 * 1024 * 1024
#: the JSON field of dynamic types, and the text field holding their string values (unqualified terms)
DYNAMIC_FIELD: Final = "doc"
ALL_FIELD: Final = "_all"
_NO_FIELD = re.compile(r"Field does not exist: '([^']+)'")
#: a quoted phrase (left alone when a query is rewritten) or a field name before ':'
_FIELD_REF = r'"(?:[^"\\]|\\.)*"|(?<![\w.\\])({})(?=:)'


def _strings(doc: Any) -> list[str]:
    """Every string value of a JSON document (object members and array elements, at any depth; not the keys)."""
    out: list[str] = []
    stack = [doc]
    while stack:
        x = stack.pop()
        t = type(x)
        if t is str:
            out.append(x)
        elif t is dict:
            stack.extend(x.values())
        elif t is list:
            stack.extend(x)
    return out


def _schema(mapping: DocumentMapping) -> Any:
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("_key", stored=True, tokenizer_name="raw")
    sb.add_text_field("_kind", stored=False, tokenizer_name="raw")
    sb.add_text_field("_type", stored=True, tokenizer_name="raw")
    sb.add_unsigned_field("_vb", stored=True, indexed=True, fast=True)
    sb.add_unsigned_field("_seq", stored=True, indexed=True, fast=True)
    sb.add_bytes_field("_stored", stored=True)
    sb.add_bytes_field("_meta", stored=True)
    for f in mapping.fields.values():
        if f.type == "text":
            sb.add_text_field(f.name, stored=False)
        elif f.type == "keyword":
            sb.add_text_field(f.name, stored=False, tokenizer_name="raw", fast=True)
        elif f.type == "numeric":
            sb.add_float_field(f.name, stored=False, indexed=True, fast=True)
        elif f.type == "date":
            sb.add_date_field(f.name, stored=False, indexed=True, fast=True)
    if mapping.dynamic:
        # fast: range queries on its numbers (``doc.age:[30 TO 40]``; tantivy refuses them on a JSON field that is
        # not); ``_all``: its string values, for unqualified terms (an index built before either is rebuilt: its
        # schema no longer matches)
        sb.add_json_field(DYNAMIC_FIELD, stored=False, fast=True)
        sb.add_text_field(ALL_FIELD, stored=False)
    return sb.build()


class TantivyBackend:
    """:class:`~connectors.search.backend.IndexBackend` on a tantivy index in ``path``.

    An index built with another mapping (its checkpoint names another mapping id) is removed and created
    anew: the indexer then rebuilds it from its document store.
    """

    def __init__(self, path: str | Path, mapping: DocumentMapping, *, heap: int = WRITER_HEAP,
                 writer: bool = True) -> None:
        self.path = Path(path)
        self.mapping = mapping
        self.heap = heap
        #: False: a reader only (searches, checkpoint, keys) of an index another process writes
        #: (connectors/search/tantivy_writer.py), which reloads it with :meth:`reload` after each commit
        self.writable = writer
        self._lock = threading.Lock()  # the writer (apply runs in the indexer's thread; commit, reset, close)
        self._open()
        cp = self.checkpoint()
        if writer and cp is not None and cp.mapping_id != mapping.id:
            log.warning("search index %s was built with another mapping (%s, now %s): rebuilding it",
                        self.path, cp.mapping_id, mapping.id)
            self.reset()
        self.default_fields = [f.name for f in mapping.fields.values() if f.type in ("text", "keyword")]
        #: the schema's field names (a query naming another one means a member of a dynamic document)
        self.schema_fields = {"_key", "_kind", "_type", "_vb", "_seq", "_stored", "_meta", *mapping.fields}
        if mapping.dynamic:
            self.schema_fields |= {DYNAMIC_FIELD, ALL_FIELD}
            # "doc": ``name:alice`` (a field the schema does not have is a path of the JSON default field);
            # "_all": unqualified terms (tantivy would look for them only at the root path of "doc")
            self.default_fields += [DYNAMIC_FIELD, ALL_FIELD]

    def _open(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.schema = _schema(self.mapping)
        exists = tantivy.Index.exists(str(self.path))
        if not self.writable:
            self.index = tantivy.Index(self.schema, path=str(self.path), reuse=True)
            self.index.config_reader(reload_policy="Manual")
            self._meta_query = tantivy.Query.term_query(self.schema, "_kind", "meta")
            return
        try:
            self.index = tantivy.Index(self.schema, path=str(self.path), reuse=True)
        except (OSError, ValueError) as e:
            if not exists:
                raise
            # an index with another schema (another mapping) or from an older build
            log.warning("search index %s cannot be opened with the current mapping (%s): rebuilding it", self.path, e)
            shutil.rmtree(self.path)
            self.path.mkdir(parents=True)
            self.index = tantivy.Index(self.schema, path=str(self.path), reuse=False)
        self.index.config_reader(reload_policy="Manual")
        self.writer = self.index.writer(self.heap, 1)
        self._meta_query = tantivy.Query.term_query(self.schema, "_kind", "meta")

    # ----------------------------------------------------------------------------------------- writing
    def apply(self, ops: Sequence[IndexOp], *, present: set[str] | None = None) -> ApplyStats:
        """``present`` (None: unknown): a superset of the keys the index holds (committed or applied), kept up
        to date here -- a key not in it is known to be absent, and its delete (costly at commit) is skipped."""
        st = ApplyStats()
        w = self.writer
        mapping = self.mapping
        fields = mapping.fields
        fast_dynamic = mapping.default.dynamic and not mapping.default.fields
        for op in ops:
            if present is None or op.key in present:
                w.delete_documents_by_term("_key", op.key)
            if isinstance(op, Delete):
                if present is not None:
                    present.discard(op.key)
                st.deleted += 1
                continue
            if present is not None:
                present.add(op.key)
            if fast_dynamic and mapping.doc_type(op.key) is mapping.default:
                # the dynamic default type: tantivy parses the JSON object itself, the body is what hits return
                try:
                    text = op.value.decode()
                    body = json.loads(text)
                    if type(body) is not dict:
                        raise ValueError("not a JSON object")
                    d = self._base(op, mapping.default.name, op.value)
                    d.add_json(DYNAMIC_FIELD, text)
                except ValueError:  # not UTF-8 or not a JSON object: the general path below decides
                    pass
                else:
                    for v in _strings(body):
                        d.add_text(ALL_FIELD, v)
                    w.add_document(d)
                    st.indexed += 1
                    continue
            try:
                body = json.loads(op.value)
            except (ValueError, UnicodeDecodeError):
                st.binary_skipped += 1  # a binary document is never indexed (its previous version is gone)
                continue
            ex = mapping.extract(op.key, body)
            if ex.rejected:
                st.field_rejected += 1
            d = self._base(op, ex.doc_type, json.dumps(ex.stored, separators=(",", ":")).encode())
            for name, vals in ex.fields.items():
                ftype = fields[name].type
                for v in vals:
                    if ftype == "text" or ftype == "keyword":
                        d.add_text(name, v)
                    elif ftype == "numeric":
                        d.add_float(name, v)
                    elif ftype == "date":
                        d.add_date(name, v)
            if ex.dynamic is not None:
                d.add_json(DYNAMIC_FIELD, json.dumps(ex.dynamic))
                for v in _strings(ex.dynamic):
                    d.add_text(ALL_FIELD, v)
            w.add_document(d)
            st.indexed += 1
        return st

    @staticmethod
    def _base(op: Upsert, doc_type: str, stored: bytes) -> Any:
        d = tantivy.Document()
        d.add_text("_key", op.key)
        d.add_text("_kind", "doc")
        d.add_text("_type", doc_type)
        d.add_unsigned("_vb", op.vbucket)
        d.add_unsigned("_seq", op.seqno)
        d.add_bytes("_stored", stored)
        return d

    def commit(self, checkpoint: Checkpoint) -> None:
        cp = Checkpoint(checkpoint.generation, checkpoint.positions, self.mapping.id)
        d = tantivy.Document()
        d.add_text("_key", META_KEY)
        d.add_text("_kind", "meta")
        d.add_bytes("_meta", json.dumps(cp.to_json()).encode())
        with self._lock:
            self.writer.delete_documents_by_term("_key", META_KEY)
            self.writer.add_document(d)
            self.writer.commit()
            self.index.reload()

    def documents(self) -> int:
        """Documents in the last commit (the checkpoint not counted)."""
        s = self._searcher()
        return int(s.num_docs) - (0 if self._checkpoint_of(s) is None else 1)

    def reload(self) -> None:
        """See the last commit (of this process's writer or another's)."""
        self.index.reload()

    def checkpoint(self) -> Checkpoint | None:
        return self._checkpoint_of(self._searcher())

    def _checkpoint_of(self, searcher: Any) -> Checkpoint | None:
        r = searcher.search(self._meta_query, 1, count=False)
        if not r.hits:
            return None
        raw = searcher.doc(r.hits[0][1]).to_dict()["_meta"][0]
        return Checkpoint.from_json(json.loads(bytes(raw)))

    def reset(self) -> None:
        with self._lock:
            self.writer.delete_all_documents()
            self.writer.commit()
            self.index.reload()

    def _searcher(self) -> Any:
        # no lock: a searcher is a consistent view of one commit (documents and checkpoint together), taken
        # without waiting for a commit in progress
        return self.index.searcher()

    # ----------------------------------------------------------------------------------------- reading
    def search(self, query: str, limit: int = 10, offset: int = 0) -> SearchResult:
        """tantivy's query syntax (``field:value``, ``AND``/``OR``/``-``, phrases, ranges ``price:[1 TO 5]``);
        unqualified terms search the text and keyword fields and, for dynamic types, every string value of the
        document; ``age:[30 TO 40]`` on a member of a dynamic document means ``doc.age:[30 TO 40]``."""
        q = self._parse(query) if query.strip() else tantivy.Query.all_query()
        q = tantivy.Query.boolean_query([(tantivy.Occur.Must, q), (tantivy.Occur.MustNot, self._meta_query)])
        s = self._searcher()
        try:
            # limit 0 (only the total): tantivy's top-docs collector needs a limit of at least 1
            r = s.search(q, max(limit, 1), count=True, offset=offset)
        except ValueError as e:
            raise SearchError(str(e)) from e
        hits = []
        for score, addr in r.hits[:limit]:
            doc = s.doc(addr).to_dict()
            hits.append(Hit(doc["_key"][0], float(score), json.loads(bytes(doc["_stored"][0]))))
        return SearchResult(hits, int(r.count or 0), self._checkpoint_of(s))

    def _parse(self, query: str) -> Any:
        try:
            return self.index.parse_query(query, self.default_fields)
        except ValueError as e:
            first = e
        # tantivy's parser reads ``name:x`` as a path of the JSON default field when the schema has no field
        # ``name``, but not a range (``age:[30 TO 40]``, ``age:>30``): it says the field does not exist. Such a
        # member of a dynamic document is ``doc.age``: that spelling is tried (quoted phrases left alone).
        text, seen, last = query, set(), first
        while self.mapping.dynamic:
            m = _NO_FIELD.search(str(last))
            if m is None or m.group(1) in seen or m.group(1).split(".")[0] in self.schema_fields:
                break
            seen.add(m.group(1))
            pat = re.compile(_FIELD_REF.format(re.escape(m.group(1))))
            text = pat.sub(lambda x: f"{DYNAMIC_FIELD}.{x.group(1)}" if x.group(1) else x.group(0), text)
            try:
                return self.index.parse_query(text, self.default_fields)
            except ValueError as e:
                last = e
        raise SearchError(str(last)) from last

    def keys(self) -> dict[str, tuple[int, int, dict[str, Any]]]:
        """Every indexed document: key -> (vbucket, seqno, stored fields) (tests, ``dcpgw index`` checks)."""
        s = self._searcher()
        q = tantivy.Query.boolean_query([(tantivy.Occur.Must, tantivy.Query.all_query()),
                                         (tantivy.Occur.MustNot, self._meta_query)])
        n = s.num_docs
        out = {}
        if n:
            for _, addr in s.search(q, n, count=False).hits:
                d = s.doc(addr).to_dict()
                out[d["_key"][0]] = (int(d["_vb"][0]), int(d["_seq"][0]), json.loads(bytes(d["_stored"][0])))
        return out

    def close(self) -> None:
        if not self.writable:
            return
        with self._lock:
            self.writer.rollback()
            self.writer.wait_merging_threads()
