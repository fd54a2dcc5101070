"""Which parts of a JSON document the index holds (docs/search.md "Mapping").

A mapping file (JSON, or TOML when its name ends in ``.toml``) lists document *types*, each selected by a key
prefix or a key regex, with its fields: a JSON pointer (RFC 6901) into the document and a field type. Documents
matching no type get the ``default`` type, which by default is *dynamic*: the whole document is indexed as one
JSON field (``name:alice`` queries its member ``name``) and returned as the hit's fields.

An invalid mapping raises :class:`MappingError` naming the file and the offending entry (``dcpgw index`` exits
with it before consuming anything). A document whose value at a pointer has the wrong type for its field is
indexed without that field and counted (:attr:`Extracted.rejected`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from connectors.exceptions import ConnectorError

__all__ = ["FIELD_TYPES", "DocType", "DocumentMapping", "Extracted", "FieldSpec", "MappingError", "parse_date"]

#: the field types of a mapping: ``text`` (tokenized), ``keyword`` (one exact term), ``numeric`` (float),
#: ``date`` (RFC 3339 string or epoch seconds), ``stored`` (returned with hits, not searchable)
FIELD_TYPES: Final = ("text", "keyword", "numeric", "date", "stored")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
#: names the backends use for their own fields
RESERVED: Final = frozenset({"doc"})


class MappingError(ConnectorError):
    """The mapping file is invalid (the message names the file and the entry)."""


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    pointer: str
    type: str
    stored: bool = True
    #: the pointer split into reference tokens (RFC 6901, ``~1`` and ``~0`` unescaped)
    tokens: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DocType:
    name: str
    key_prefix: str | None
    key_regex: re.Pattern[str] | None
    fields: tuple[FieldSpec, ...]
    dynamic: bool

    def matches(self, key: str) -> bool:
        if self.key_prefix is not None and not key.startswith(self.key_prefix):
            return False
        return not (self.key_regex is not None and self.key_regex.search(key) is None)


@dataclass(slots=True)
class Extracted:
    """One document through the mapping."""

    doc_type: str
    #: field name -> typed values (str for text/keyword, float for numeric, aware datetime for date, any JSON for
    #: stored)
    fields: dict[str, list[Any]] = field(default_factory=dict)
    #: the whole document when its type is dynamic (a JSON object; other JSON values as {"value": v})
    dynamic: dict[str, Any] | None = None
    #: names of the fields left out because the document's value had the wrong type
    rejected: list[str] = field(default_factory=list)
    #: what a hit returns as its ``fields``: the members of a dynamic document, then the stored mapped fields
    #: with their JSON values as in the document
    stored: dict[str, Any] = field(default_factory=dict)


def parse_date(v: Any) -> datetime.datetime | None:
    """An RFC 3339 / ISO 8601 string (naive: UTC) or epoch seconds; None when ``v`` is neither."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        try:
            return datetime.datetime.fromtimestamp(v, datetime.UTC)
        except (OverflowError, OSError, ValueError):
            return None
    if isinstance(v, str):
        try:
            d = datetime.datetime.fromisoformat(v.replace("Z", "+00:00") if v.endswith("Z") else v)
        except ValueError:
            return None
        return d if d.tzinfo is not None else d.replace(tzinfo=datetime.UTC)
    return None


_MISSING = object()


def _resolve(doc: Any, tokens: tuple[str, ...]) -> Any:
    cur = doc
    for t in tokens:
        if isinstance(cur, dict):
            if t not in cur:
                return _MISSING
            cur = cur[t]
        elif isinstance(cur, list):
            if not t.isdigit() or int(t) >= len(cur):
                return _MISSING
            cur = cur[int(t)]
        else:
            return _MISSING
    return cur


def _typed(ftype: str, v: Any) -> list[Any] | None:
    """The values of one field, or None when ``v`` has the wrong type (an array gives one value per element)."""
    items = v if isinstance(v, list) and ftype != "stored" else [v]
    out: list[Any] = []
    for x in items:
        if ftype in ("text", "keyword"):
            if not isinstance(x, str):
                return None
            out.append(x)
        elif ftype == "numeric":
            if isinstance(x, bool) or not isinstance(x, int | float):
                return None
            out.append(float(x))
        elif ftype == "date":
            d = parse_date(x)
            if d is None:
                return None
            out.append(d)
        else:
            out.append(x)
    return out


class DocumentMapping:
    """A validated mapping. :meth:`load` reads a file; :meth:`dynamic_default` is the mapping without one."""

    def __init__(self, types: list[DocType], default: DocType, source: Mapping[str, Any]) -> None:
        self.types = types
        self.default = default
        #: every field of every type, by name (one type per name: checked when loading)
        self.fields: dict[str, FieldSpec] = {}
        for t in [*types, default]:
            for f in t.fields:
                self.fields.setdefault(f.name, f)
        self.dynamic = any(t.dynamic for t in [*types, default])
        self.id = hashlib.sha256(json.dumps(source, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def dynamic_default(cls) -> DocumentMapping:
        return cls.from_dict({}, "<default mapping>")

    @classmethod
    def load(cls, path: str | Path | None) -> DocumentMapping:
        if path is None:
            return cls.dynamic_default()
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise MappingError(f"mapping {p}: cannot read it: {e.strerror or e}") from e
        try:
            data = tomllib.loads(raw.decode()) if p.suffix == ".toml" else json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            raise MappingError(f"mapping {p}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from e
        return cls.from_dict(data, str(p))

    @classmethod
    def from_dict(cls, data: Any, where: str = "<mapping>") -> DocumentMapping:
        def bad(path: str, msg: str) -> MappingError:
            return MappingError(f"mapping {where}: {path}: {msg}")

        if not isinstance(data, dict):
            raise bad("top level", "must be an object with \"types\" and/or \"default\"")
        unknown = set(data) - {"types", "default"}
        if unknown:
            raise bad("top level", f"unknown member(s) {sorted(unknown)} (allowed: types, default)")
        types_raw = data.get("types", [])
        if not isinstance(types_raw, list):
            raise bad("types", "must be an array of document types")
        seen: dict[str, tuple[str, str]] = {}
        names: set[str] = set()
        types = [cls._doc_type(t, f"types[{i}]", bad, seen, names, selector=True) for i, t in enumerate(types_raw)]
        default_raw = data.get("default", {"dynamic": True})
        default = cls._doc_type(default_raw, "default", bad, seen, names, selector=False)
        return cls(types, default, data)

    @staticmethod
    def _doc_type(t: Any, path: str, bad: Any, seen: dict[str, tuple[str, str]], names: set[str], *,
                  selector: bool) -> DocType:
        if not isinstance(t, dict):
            raise bad(path, "must be an object")
        allowed = {"name", "key_prefix", "key_regex", "fields", "dynamic"} if selector else {"fields", "dynamic"}
        unknown = set(t) - allowed
        if unknown:
            raise bad(path, f"unknown member(s) {sorted(unknown)} (allowed: {', '.join(sorted(allowed))})")
        name = t.get("name", "default" if not selector else None)
        if not isinstance(name, str) or not name:
            raise bad(path, "needs a \"name\" (a non-empty string)")
        if name in names:
            raise bad(path, f"document type {name!r} is defined twice")
        names.add(name)
        prefix = t.get("key_prefix")
        regex_raw = t.get("key_regex")
        regex = None
        if selector:
            if prefix is None and regex_raw is None:
                raise bad(path, "needs \"key_prefix\" or \"key_regex\" (which documents are of this type)")
            if prefix is not None and not isinstance(prefix, str):
                raise bad(f"{path}.key_prefix", "must be a string")
            if regex_raw is not None:
                if not isinstance(regex_raw, str):
                    raise bad(f"{path}.key_regex", "must be a string")
                try:
                    regex = re.compile(regex_raw)
                except re.error as e:
                    raise bad(f"{path}.key_regex", f"invalid regular expression: {e}") from e
        dynamic = t.get("dynamic", not t.get("fields"))
        if not isinstance(dynamic, bool):
            raise bad(f"{path}.dynamic", "must be true or false")
        fields_raw = t.get("fields", {})
        if not isinstance(fields_raw, dict):
            raise bad(f"{path}.fields", "must be an object: field name -> {\"pointer\", \"type\"}")
        fields = []
        for fname, spec in fields_raw.items():
            fp = f"{path}.fields.{fname}"
            if not _NAME.match(fname) or fname in RESERVED:
                raise bad(fp, "field names are letters, digits and _ starting with a letter"
                          + (f" ({fname!r} is reserved)" if fname in RESERVED else ""))
            if isinstance(spec, str):
                spec = {"type": spec}
            if not isinstance(spec, dict):
                raise bad(fp, "must be an object {\"pointer\", \"type\", \"stored\"} or a type name")
            unknown = set(spec) - {"pointer", "type", "stored"}
            if unknown:
                raise bad(fp, f"unknown member(s) {sorted(unknown)} (allowed: pointer, type, stored)")
            ftype = spec.get("type")
            if ftype not in FIELD_TYPES:
                raise bad(f"{fp}.type", f"{ftype!r} is not one of {', '.join(FIELD_TYPES)}")
            pointer = spec.get("pointer", f"/{fname}")
            if not isinstance(pointer, str) or (pointer and not pointer.startswith("/")):
                raise bad(f"{fp}.pointer", f"{pointer!r} is not a JSON pointer (\"/a/b\", RFC 6901)")
            if re.search(r"~[^01]|~\Z", pointer):
                raise bad(f"{fp}.pointer", f"{pointer!r}: '~' must be followed by 0 or 1 (RFC 6901)")
            stored = spec.get("stored", True)
            if not isinstance(stored, bool):
                raise bad(f"{fp}.stored", "must be true or false")
            prev = seen.get(fname)
            if prev is not None and prev[0] != ftype:
                raise bad(f"{fp}.type", f"field {fname!r} is {prev[0]!r} in {prev[1]}: one type per field name")
            seen.setdefault(fname, (ftype, path))
            tokens = tuple(s.replace("~1", "/").replace("~0", "~") for s in pointer.split("/")[1:])
            fields.append(FieldSpec(fname, pointer, ftype, stored or ftype == "stored", tokens))
        return DocType(name, prefix, regex, tuple(fields), dynamic)

    # -------------------------------------------------------------------------------------- extracting
    def doc_type(self, key: str) -> DocType:
        for t in self.types:
            if t.matches(key):
                return t
        return self.default

    def extract(self, key: str, doc: Any) -> Extracted:
        """Apply the mapping to ``doc`` (the parsed JSON body of ``key``)."""
        t = self.doc_type(key)
        out = Extracted(t.name)
        for f in t.fields:
            v = _resolve(doc, f.tokens)
            if v is _MISSING or v is None:
                continue
            vals = _typed(f.type, v)
            if vals is None:
                out.rejected.append(f.name)
                continue
            if vals:
                out.fields[f.name] = vals
            if f.stored:
                out.stored[f.name] = v
        if t.dynamic:
            out.dynamic = doc if isinstance(doc, dict) else {"value": doc}
            out.stored = {**out.dynamic, **out.stored}
        return out
