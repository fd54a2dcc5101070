"""The cluster config the KV port serves (CCCP: GET_CLUSTER_CONFIG, and the body of NOT_MY_VBUCKET;
docs/kv-protocol.md "Cluster config").

The front end asks an injected :class:`ClusterConfigProvider` for the JSON and for the bucket that serves a
vbucket; :class:`SingleNodeConfig` is the one-node provider (every vbucket active here, no replicas). A cluster
provider (``dcpgw up --nodes N``) answers its vbucket map, bumps ``rev`` on failover / rebalance and raises
NotMyVBucket for vbuckets another node serves.

The JSON is ns_server's bucket config as the SDKs parse it (couchbase-cxx-client ``configuration_json.hxx``):
``rev`` / ``revEpoch``, ``name``, ``uuid``, ``nodeLocator: vbucket``, ``nodesExt`` (``hostname``, ``services``
with ``kv`` or, on a TLS port, ``kvSSL``, ``thisNode``), ``vBucketServerMap`` (``hashAlgorithm: CRC``,
``numReplicas``, ``serverList``, ``vBucketMap``), ``bucketCapabilities`` and ``conflictResolutionType`` (the
bucket's XDCR conflict resolution, ``seqno`` or ``lww``: an XDCR source checks it). Without a selected bucket
(GCCCP) the same minus the bucket fields. ns_server writes ``$HOST`` where kv_engine substitutes the address the
client connected to; here the provider is given that address directly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Final, Protocol

from engine.bucket import Bucket
from engine.exceptions import NotMyVBucket, TemporaryFailure

#: what the port supports of ns_server's bucket capabilities (no collections, no xattrs)
BUCKET_CAPABILITIES: Final = ["cccp", "nodesExt", "durableWrite", "touch", "dcp", "cbhello"]


class ClusterConfigProvider(Protocol):
    """What the front end needs to know about the cluster (injected)."""

    @property
    def bucket_name(self) -> str: ...

    @property
    def rev(self) -> int: ...

    def config(self, host: str, *, bucket: bool) -> dict[str, Any]:
        """The config for a client connected to ``host`` (this node's address as the client sees it); with
        ``bucket`` the bucket's (CCCP), else the cluster's (GCCCP)."""
        ...

    def bucket_for(self, vbucket: int) -> Bucket:
        """The engine bucket that serves ``vbucket`` as active on this node; NotMyVBucket otherwise."""
        ...


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SingleNodeConfig:
    """One node, every vbucket active on it, no replicas (``dcpgw up`` without ``--nodes``)."""

    def __init__(self, bucket: Callable[[], Bucket | None], name: str, port: Callable[[], int], *,
                 tls: bool = False, rev: int = 1, rev_epoch: int = 1) -> None:
        self._bucket = bucket
        self._name = name
        self._port = port
        self.tls = tls
        self._rev = rev
        self.rev_epoch = rev_epoch
        self.uuid = hashlib.sha256(f"dcpgw:{name}".encode()).hexdigest()[:32]

    @property
    def bucket_name(self) -> str:
        return self._name

    @property
    def rev(self) -> int:
        return self._rev

    def bucket_for(self, vbucket: int) -> Bucket:
        b = self._bucket()
        if b is None or b.closed:
            raise TemporaryFailure(f"bucket {self._name!r} is not open")
        if not 0 <= vbucket < b.num_vbuckets:
            raise NotMyVBucket(f"unknown vbucket {vbucket} (bucket has {b.num_vbuckets})")
        return b

    def config(self, host: str, *, bucket: bool) -> dict[str, Any]:
        port = self._port()
        services = {"kvSSL": port} if self.tls else {"kv": port}
        out: dict[str, Any] = {
            "rev": self._rev,
            "revEpoch": self.rev_epoch,
            "nodesExt": [{"services": services, "hostname": host, "thisNode": True}],
            "clusterCapabilitiesVer": [1, 0],
            "clusterCapabilities": {},
        }
        if not bucket:
            return out
        b = self._bucket()
        nvb = b.num_vbuckets if b is not None else 0
        out.update({
            "name": self._name,
            "uuid": self.uuid,
            "nodeLocator": "vbucket",
            "bucketCapabilitiesVer": "",
            "bucketCapabilities": BUCKET_CAPABILITIES,
            **({"conflictResolutionType": str(b.conflict_resolution.value)} if b is not None else {}),
            "vBucketServerMap": {
                "hashAlgorithm": "CRC",
                "numReplicas": 0,
                "serverList": [host_port(host, port)],
                "vBucketMap": [[0] for _ in range(nvb)],
            },
        })
        return out
