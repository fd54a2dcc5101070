"""The official Couchbase Python SDK against ``dcpgw up --nodes 3 --replicas 1`` (docs/kv-protocol.md "Several
nodes"): one KV port per node, the SDK bootstrapping from one of them and routing by the map; durable writes
(majority), a hard failover through the HTTP API and a rebalance adding a node while the SDK keeps writing; the SDK
follows the new maps, every acknowledged durable write is still readable through it with its CAS, and what the SDK
wrote is in Kafka exactly as an HTTP write of the same document.

One ``dcpgw up`` on the session's broker (bucket ``kvcluster``, its own topic); SDK timeouts are short so a
failure cannot hang the suite.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import timedelta
from pathlib import Path

from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.durability import DurabilityLevel, ServerDurability
from couchbase.exceptions import DurabilityImpossibleException, DurabilitySyncWriteInProgressException
from couchbase.options import ClusterOptions, ClusterTimeoutOptions, UpsertOptions

from engine.kv.vbucket import vbucket_of
from engine.security.roles import Role
from engine.security.users import UserStore
from gateway.broker import Broker
from schemas.records import RecordType
from tests.credentials import ADMIN_PASSWORD
from tests.gateway.kafka_util import read_topic
from tests.gateway.processes import GatewayProc, call, request

PASSWORD = "sdk-cluster-pw"
NVB = 16
BUCKET = "kvcluster"


def _chains(gw: GatewayProc) -> list[list[str | None]]:
    return list(gw.get("/cluster/map")["chains"])


def test_sdk_follows_failover_and_rebalance_and_reaches_kafka(kafka_broker: Broker, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    users = UserStore.open(data)
    users.ensure_admin(ADMIN_PASSWORD)  # what the first start would do; the API calls below are the admin's
    users.add("app", PASSWORD, [Role.DATA_READER, Role.DATA_WRITER])
    gw = GatewayProc(kafka_broker, data, BUCKET, nvb=NVB, DCPGW_KV_PORT="0", DCPGW_CLUSTER_NODES="3",
                     DCPGW_CLUSTER_REPLICAS="1")
    gw.start()
    cluster: Cluster | None = None
    try:
        health = gw.get("/health")
        ports = health["kv_ports"]
        assert sorted(ports) == ["n0", "n1", "n2"] and health["kv_port"] == ports["n0"]
        timeouts = ClusterTimeoutOptions(kv_timeout=timedelta(seconds=5), kv_durable_timeout=timedelta(seconds=10),
                                         connect_timeout=timedelta(seconds=10),
                                         bootstrap_timeout=timedelta(seconds=10))
        cluster = Cluster(f"couchbase://127.0.0.1:{ports['n0']}",
                          ClusterOptions(PasswordAuthenticator("app", PASSWORD), timeout_options=timeouts))
        coll = cluster.bucket(BUCKET).default_collection()
        durably = UpsertOptions(durability=ServerDurability(DurabilityLevel.MAJORITY))
        acked: dict[str, tuple[int, dict]] = {}  # key -> (cas, body) of every durable write the SDK got an OK for

        def durable(key: str, body: dict) -> None:
            acked[key] = (coll.upsert(key, body, durably).cas, body)

        for i in range(40):
            durable(f"d{i}", {"i": i, "phase": "before"})
            coll.upsert(f"p{i}", {"i": i})
        replicas = list(coll.get_all_replicas("d3"))  # GET from the active, GET_REPLICA from the replica node
        assert sorted(r.is_replica for r in replicas) == [False, True]

        # hard failover of n1 (the HTTP API): the SDK gets the new map (NOT_MY_VBUCKET body, push, polling)
        report = call(gw.url + "/cluster/failover", "POST", json.dumps({"node": "n1"}).encode())
        assert report["node"] == "n1"
        chains = _chains(gw)
        impossible = 0
        for i in range(40, 80):
            key = f"d{i}"
            full = None not in chains[vbucket_of(key.encode(), NVB)]
            try:
                durable(key, {"i": i, "phase": "failed-over"})
                assert full, key
            except DurabilityImpossibleException:  # a chain that lost its replica: no majority until a rebalance
                assert not full, key
                impossible += 1
            coll.upsert(f"p{i}", {"i": i})
        assert impossible > 0
        for key, (cas, body) in acked.items():  # every acknowledged durable write survived the failover
            g = coll.get(key)
            assert (g.cas, g.content_as[dict]) == (cas, body), key

        # rebalance a new node in while the SDK keeps writing
        started = call(gw.url + "/cluster/rebalance", "POST", json.dumps({"add": ["n3"]}).encode())
        assert started["status"] in ("running", "done"), started
        i = 80
        deadline = time.monotonic() + 120
        while call(gw.url + "/cluster/rebalance")["status"] == "running":
            assert time.monotonic() < deadline, "rebalance did not finish"
            with contextlib.suppress(DurabilityImpossibleException, DurabilitySyncWriteInProgressException):
                durable(f"d{i}", {"i": i, "phase": "rebalancing"})
            i += 1
        assert call(gw.url + "/cluster/rebalance")["status"] == "done"
        assert all(None not in c for c in _chains(gw))
        for j in range(i, i + 30):  # every vbucket has its replica again: durable writes everywhere
            durable(f"d{j}", {"i": j, "phase": "rebalanced"})
        deadline = time.monotonic() + 10
        while "n3" not in gw.get("/health")["kv_ports"]:
            assert time.monotonic() < deadline, "no KV port for the new node"
            time.sleep(0.05)
        for key, (cas, body) in acked.items():
            g = coll.get(key)
            assert (g.cas, g.content_as[dict]) == (cas, body), key

        # what the SDK wrote is in Kafka as an HTTP write of the same document is
        sdk_body = {"same": "value", "n": 7}
        coll.upsert("via-sdk", sdk_body)
        request(gw.url + "/docs/via-http?flags=33554432", "PUT", json.dumps(sdk_body).encode())
        gw.wait_caught_up()
        latest: dict[bytes, object] = {}
        for _p, _o, r in read_topic(kafka_broker.bootstrap_servers, f"dcp.{BUCKET}"):
            if r.type is RecordType.MUTATION and r.key is not None:
                latest[r.key] = r
        sdk, http = latest[b"via-sdk"], latest[b"via-http"]
        assert json.loads(sdk.value or b"") == json.loads(http.value or b"") == sdk_body  # type: ignore[attr-defined]
        for f in ("type", "flags", "expiry", "datatype", "value_format", "rev_seqno"):
            assert getattr(sdk, f) == getattr(http, f), f
        for key, (cas, body) in acked.items():
            rec = latest[key.encode()]
            assert json.loads(rec.value or b"") == body and rec.cas == cas, key  # type: ignore[attr-defined]
    finally:
        if cluster is not None:
            cluster.close()
        gw.close()
