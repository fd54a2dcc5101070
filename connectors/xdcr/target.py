"""The target cluster: its address, the vbucket map it serves and the with-meta writes routed by it
(docs/xdcr.md "Target client").

``couchbase://HOST:KVPORT[/BUCKET]`` (``couchbases://`` for TLS) names one node's KV port. The map comes from
GET_CLUSTER_CONFIG (Couchbase's ``vBucketServerMap``); a target without one (a bare node process) serves every
vbucket on that node. A NOT_MY_VBUCKET answer (failover or rebalance on the target) refreshes the map -- from
the answer's body when it carries a config, as kv_engine's does, else by asking again -- and the refused
writes go again to the new owner, as goxdcr's xmem nozzle does.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from connectors.xdcr.checkpoints import history_holds
from connectors.xdcr.connection import Credentials, KvConnection
from connectors.xdcr.document import ConflictMode, DocVersion
from connectors.xdcr.errors import KvError, TargetError, TargetUnreachable, XdcrError
from connectors.xdcr.mcbp import (
    GET_META_EXTRAS,
    GET_META_ITEM_DELETED_FLAG,
    GET_META_VERSION_2,
    IS_EXPIRATION,
    OBSERVE_SEQNO_0,
    OBSERVE_SEQNO_1,
    PAIR,
    TOKEN_EXTRAS,
    WITH_META_EXTRAS,
    Op,
    Response,
    Status,
)

__all__ = ["TargetCluster", "TargetSpec", "WriteOp", "WriteResult"]

#: how many times a write refused with NOT_MY_VBUCKET is routed again in one call
MAX_REROUTES = 10


@dataclass(frozen=True)
class TargetSpec:
    host: str
    port: int
    bucket: str
    tls: bool
    ca_file: str | None = None

    @classmethod
    def parse(cls, url: str) -> TargetSpec:
        """``couchbase://HOST:KVPORT[/BUCKET][?ca=FILE]``; :class:`XdcrError` for anything else."""
        u = urlsplit(url)
        if u.scheme not in ("couchbase", "couchbases") or not u.hostname:
            raise XdcrError(f"--target must be couchbase://HOST:KVPORT[/BUCKET] (or couchbases:// for TLS), "
                            f"got {url!r}")
        try:
            port = u.port or (11207 if u.scheme == "couchbases" else 11210)
        except ValueError as e:
            raise XdcrError(f"--target {url!r}: bad port: {e}") from e
        bucket = u.path.strip("/") or "default"
        ca = parse_qs(u.query).get("ca", [None])[0]
        return cls(u.hostname, port, bucket, u.scheme == "couchbases", ca)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        return ssl.create_default_context(cafile=self.ca_file)


@dataclass(slots=True)
class WriteOp:
    """One with-meta write: ``version`` (with the source's metadata) to ``vbucket``; ``options`` are the
    with-meta option bits (forced acceptance for undo writes); ``add`` uses ADD_WITH_META."""

    vbucket: int
    version: DocVersion
    options: int = 0
    add: bool = False
    expiration: bool = False

    def request(self, vbucket: int) -> tuple[int, dict[str, Any]]:
        v = self.version
        opts = self.options | (IS_EXPIRATION if v.deleted and self.expiration else 0)
        extras = WITH_META_EXTRAS.pack(v.flags, v.expiry, v.rev_seqno, v.cas, opts)
        if v.deleted:
            return Op.DEL_WITH_META, {"key": v.key, "extras": extras, "vbucket": vbucket,
                                      "datatype": 0}
        op = Op.ADD_WITH_META if self.add else Op.SET_WITH_META
        return op, {"key": v.key, "extras": extras, "value": v.value or b"", "vbucket": vbucket,
                    "datatype": v.datatype}

    @property
    def size(self) -> int:
        return len(self.version.key) + len(self.version.value or b"") + 52


@dataclass(frozen=True, slots=True)
class WriteResult:
    status: int
    #: the target vbucket's (vbuuid, seqno) after the write (HELLO MutationSeqno), or None
    token: tuple[int, int] | None = None
    #: a refusal's reason from the error context (``rejected_behind`` / ``rejected_identical`` for a conflict
    #: loss on this engine), or ""
    reason: str = ""
    #: the target vbucket written
    vbucket: int = -1


@dataclass
class _Map:
    servers: list[str]
    #: vbucket -> index in ``servers`` of its active (-1: none)
    active: list[int]
    rev: int = 0
    conflict_mode: str | None = None
    bucket_uuid: str | None = None


@dataclass
class TargetCluster:
    """Connections to the target's nodes and the vbucket map (see the module docstring)."""

    spec: TargetSpec
    creds: Credentials
    timeout: float = 30.0
    sleep: Callable[[float], None] = time.sleep
    conns: dict[str, KvConnection] = field(default_factory=dict)
    map: _Map | None = None
    #: NOT_MY_VBUCKET answers followed, map refreshes
    not_my_vbucket: int = 0
    map_refreshes: int = 0

    def connect(self) -> None:
        """Bootstrap on the node of the URL (raises TargetUnreachable / TargetAuthError) and read the map."""
        self._conn(f"{self.spec.host}:{self.spec.port}")
        self.refresh_map()

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        self.conns.clear()

    def _conn(self, server: str) -> KvConnection:
        c = self.conns.get(server)
        if c is None:
            host, _, port = server.rpartition(":")
            c = KvConnection(host, int(port), Credentials(self.creds.user, self.creds.password, self.spec.bucket),
                             tls=self.spec.ssl_context(), timeout=self.timeout)
            self.conns[server] = c
        return c

    def _drop(self, server: str) -> None:
        c = self.conns.pop(server, None)
        if c is not None:
            c.close()

    # -------------------------------------------------------------------------------------------- the map
    def refresh_map(self, config: dict[str, Any] | None = None) -> None:
        home = f"{self.spec.host}:{self.spec.port}"
        if config is None:
            for server in [home, *(s for s in (self.map.servers if self.map else []) if s != home)]:
                try:
                    config = self._conn(server).cluster_config()
                    break
                except TargetUnreachable:
                    self._drop(server)
            else:
                raise TargetUnreachable(f"no node of the target answers ({home})")
        self.map_refreshes += 1
        if config is None or "vBucketServerMap" not in config:
            self.map = _Map([home], [], 0, (config or {}).get("conflictResolutionType"))
            return
        sm = config["vBucketServerMap"]
        try:
            servers = [str(s) for s in sm["serverList"]]
            active = [int(chain[0]) if chain else -1 for chain in sm["vBucketMap"]]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise TargetError(f"the target's cluster config has no usable vBucketServerMap: {e}") from e
        rev = int(config.get("rev", 0))
        if self.map is not None and self.map.servers and rev and rev < self.map.rev:
            return  # an older config than the one in use
        self.map = _Map(servers, active, rev, config.get("conflictResolutionType"), config.get("uuid"))

    def server_of(self, vbucket: int) -> str:
        m = self.map
        if m is None:
            raise TargetError("the target's vbucket map is not known yet (connect() first)")
        if not m.active:
            return m.servers[0]
        if vbucket >= len(m.active) or m.active[vbucket] < 0:
            raise TargetError(f"the target has no active node for vbucket {vbucket} ({len(m.active)} vbuckets)")
        return m.servers[m.active[vbucket]]

    def vbucket_of(self, key: bytes, source_vbucket: int) -> int:
        """The key's vbucket on the target: Couchbase's CRC32 hash over the target's vbucket count when the map
        is known (the clusters may have different counts), else the source's."""
        n = self.num_vbuckets
        return source_vbucket if n is None else ((zlib.crc32(key) >> 16) & 0x7FFF) % n

    @property
    def num_vbuckets(self) -> int | None:
        return len(self.map.active) if self.map is not None and self.map.active else None

    # ---------------------------------------------------------------------------------------- requests
    def _routed(self, reqs: Sequence[tuple[int, tuple[int, dict[str, Any]]]]) -> list[Response]:
        """Send ``(vbucket, request)`` pairs to their vbuckets' active nodes (one pipeline per node),
        following NOT_MY_VBUCKET; answers in the order of ``reqs``."""
        out: list[Response | None] = [None] * len(reqs)
        pending = list(range(len(reqs)))
        for attempt in range(MAX_REROUTES + 1):
            by_server: dict[str, list[int]] = {}
            for i in pending:
                by_server.setdefault(self.server_of(reqs[i][0]), []).append(i)
            again: list[int] = []
            nmvb_config: dict[str, Any] | None = None
            for server, idx in by_server.items():
                try:
                    answers = self._conn(server).pipeline([reqs[i][1] for i in idx])
                except TargetUnreachable:
                    self._drop(server)
                    raise
                for i, r in zip(idx, answers, strict=True):
                    if r.status == Status.NOT_MY_VBUCKET:
                        again.append(i)
                        self.not_my_vbucket += 1
                        if r.value[:1] == b"{":
                            with contextlib.suppress(ValueError):
                                nmvb_config = json.loads(r.value.replace(b"$HOST", server.rpartition(":")[0]
                                                                         .encode()))
                    else:
                        out[i] = r
            if not again:
                break
            if attempt == MAX_REROUTES:
                for i in again:
                    out[i] = Response(0x81, reqs[i][1][0], Status.NOT_MY_VBUCKET, 0, 0, 0, b"", b"", b"")
                break
            self.sleep(min(0.05 * 2 ** attempt, 1.0))
            self.refresh_map(nmvb_config)
            pending = again
        return [r for r in out if r is not None]

    def write(self, ops: Sequence[WriteOp]) -> list[WriteResult]:
        tvbs = [self.vbucket_of(o.version.key, o.vbucket) for o in ops]
        answers = self._routed([(vb, o.request(vb)) for vb, o in zip(tvbs, ops, strict=True)])
        res = []
        for vb, r in zip(tvbs, answers, strict=True):
            tok = TOKEN_EXTRAS.unpack(r.extras) if r.ok and len(r.extras) == TOKEN_EXTRAS.size else None
            reason = ""
            if not r.ok and r.value[:1] == b"{":
                with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                    reason = str(json.loads(r.value)["error"].get("reason", ""))
            res.append(WriteResult(r.status, tok, reason, vb))
        return res

    def get_meta(self, keys: Sequence[tuple[int, bytes]]) -> list[DocVersion | None]:
        """The target's metadata of each ``(vbucket, key)`` (None: no document and no tombstone)."""
        keys = [(self.vbucket_of(k, vb), k) for vb, k in keys]
        answers = self._routed([(vb, (Op.GET_META, {"key": k, "vbucket": vb, "extras": GET_META_VERSION_2}))
                                for vb, k in keys])
        out: list[DocVersion | None] = []
        for (_vb, k), r in zip(keys, answers, strict=True):
            if r.status == Status.KEY_ENOENT:
                out.append(None)
                continue
            if not r.ok or len(r.extras) < GET_META_EXTRAS.size:
                raise KvError(f"GET_META {k!r}: {r.status_name()}", r.status)
            deleted, flags, expiry, rev = GET_META_EXTRAS.unpack_from(r.extras)
            dt = r.extras[GET_META_EXTRAS.size] if len(r.extras) > GET_META_EXTRAS.size else 0
            out.append(DocVersion(k, r.cas, rev, flags, expiry, bool(deleted & GET_META_ITEM_DELETED_FLAG), dt))
        return out

    def failover_log(self, vbucket: int) -> list[tuple[int, int]]:
        """The target vbucket's failover log, newest first: ``[(vbuuid, seqno), ...]``."""
        r = self._routed([(vbucket, (Op.DCP_GET_FAILOVER_LOG, {"vbucket": vbucket}))])[0]
        if not r.ok or len(r.value) % PAIR.size:
            raise KvError(f"DCP_GET_FAILOVER_LOG of vbucket {vbucket}: {r.status_name()}", r.status)
        return [(u, s) for u, s in PAIR.iter_unpack(r.value)]

    def holds(self, vbucket: int, vbuuid: int, seqno: int) -> bool | None:
        """Does the target's active copy of ``vbucket`` still hold the history up to ``seqno`` written on branch
        ``vbuuid`` (a target position answered by an earlier write)? OBSERVE_SEQNO with that vbuuid (kv_engine:
        format 0 when it is the current branch, format 1 with the last seqno of an older one, 0 when unknown),
        else the failover log (``checkpoints.history_holds``); None when the target tells neither."""
        if vbuuid == 0:
            return True  # the target gave no position (no MutationSeqno): nothing to check
        req = (Op.OBSERVE_SEQNO, {"vbucket": vbucket, "value": vbuuid.to_bytes(8, "big")})
        r = self._routed([(vbucket, req)])[0]
        if r.ok and len(r.value) >= OBSERVE_SEQNO_0.size:
            if r.value[0] == 0:
                current = int(OBSERVE_SEQNO_0.unpack_from(r.value)[4])
                return seqno <= current
            if r.value[0] == 1 and len(r.value) >= OBSERVE_SEQNO_1.size:
                _f, _vb, _u, _p, _c, old, last = OBSERVE_SEQNO_1.unpack_from(r.value)
                return bool(old == vbuuid and seqno <= last)
        try:
            return history_holds(self.failover_log(vbucket), vbuuid, seqno)
        except KvError:
            return None

    def stats(self, group: str = "") -> dict[str, str]:
        """STAT ``group`` of the bootstrap node (its answers until the empty terminator)."""
        c = self._conn(f"{self.spec.host}:{self.spec.port}")
        op = (Op.STAT, {"key": group.encode()})
        first = c.pipeline([op])[0]
        out: dict[str, str] = {}
        r = first
        while r.ok and r.key:
            out[r.key.decode(errors="replace")] = r.value.decode(errors="replace")
            r = c._read()
        if not r.ok and r.status not in (Status.UNKNOWN_COMMAND, Status.KEY_ENOENT, Status.EINVAL):
            raise KvError(f"STAT {group!r}: {r.status_name()}", r.status)
        return out

    def conflict_mode(self) -> ConflictMode | None:
        """The bucket's conflict-resolution mode: the cluster config's ``conflictResolutionType`` or the
        engine stat ``ep_conflict_resolution_type`` (None: the target does not tell)."""
        name = self.map.conflict_mode if self.map is not None else None
        if name is None:
            try:
                st = self.stats()
            except KvError:
                st = {}
            for k in ("ep_conflict_resolution_type", "conflict_resolution_mode", "conflict_resolution"):
                if k in st:
                    name = st[k]
                    break
        if name is None:
            return None
        name = {"lww": "lww", "seqno": "seqno", "revid": "seqno", "revision": "seqno"}.get(name.lower(), name)
        try:
            return ConflictMode(name)
        except ValueError as e:
            raise TargetError(f"the target reports an unknown conflict-resolution mode {name!r}") from e
