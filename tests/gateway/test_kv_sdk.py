"""The KV port proven with a client nobody here wrote: the official Couchbase Python SDK (``couchbase`` 4.x,
the C++ core) against ``dcpgw up`` (docs/kv-protocol.md).

One ``dcpgw up`` process and as few SDK bootstraps as possible (each costs a handshake): one connection does
every document operation; others prove what only they can (a wrong password, a role without writes, an
impossible durability, TLS). Every SDK call runs with short timeouts so a failure cannot hang the suite.

Durability on one node (no replicas): a vbucket's chain is the active alone, so a majority is 1 and every level
is possible (kv_engine's rule): ``majority`` commits at once, ``majorityAndPersistToActive`` and
``persistToMajority`` once the write is on disk. DURABILITY_IMPOSSIBLE needs a chain with an empty replica slot;
the engine gets one here through its own API (a single node has no other way to lack a replica).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import trustme
from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.collection import Collection
from couchbase.durability import DurabilityLevel, ServerDurability
from couchbase.exceptions import (
    AuthenticationException,
    CasMismatchException,
    DocumentExistsException,
    DocumentLockedException,
    DocumentNotFoundException,
    DocumentNotLockedException,
    DurabilityImpossibleException,
)
from couchbase.options import (
    ClusterOptions,
    ClusterTimeoutOptions,
    DecrementOptions,
    GetOptions,
    IncrementOptions,
    InsertOptions,
    RemoveOptions,
    ReplaceOptions,
    UpsertOptions,
)
from couchbase.transcoder import RawStringTranscoder

from engine.kv.vbucket import vbucket_of
from engine.security.roles import Role
from engine.security.users import UserStore
from gateway.broker import Broker
from schemas.records import RecordType
from tests.engine.network.kv.harness import KVNode
from tests.gateway.kafka_util import read_topic
from tests.gateway.processes import CLEAN_ENV, GatewayProc, dcpgw_background, request, verify

PASSWORD = "sdk-secret-pw"
NVB = 16
#: this module's gateway publishes into `<TOPIC_PREFIX>.default` (see the gateway fixture)
TOPIC_PREFIX = f"kvsdk{uuid.uuid4().hex[:8]}"
LEVELS = [DurabilityLevel.MAJORITY, DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
          DurabilityLevel.PERSIST_TO_MAJORITY]


def sdk_options(user: str, password: str = PASSWORD, timeout_s: float = 10, **auth: Any) -> ClusterOptions:
    timeouts = ClusterTimeoutOptions(kv_timeout=timedelta(seconds=5), kv_durable_timeout=timedelta(seconds=8),
                                     connect_timeout=timedelta(seconds=timeout_s),
                                     bootstrap_timeout=timedelta(seconds=timeout_s))
    return ClusterOptions(PasswordAuthenticator(user, password, **auth), timeout_options=timeouts)


def connect(port: int, user: str, password: str = PASSWORD, *, scheme: str = "couchbase", timeout_s: float = 10,
            **auth: Any) -> Cluster:
    return Cluster(f"{scheme}://127.0.0.1:{port}", sdk_options(user, password, timeout_s, **auth))


@pytest.fixture(scope="module")
def gateway(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    data = tmp_path_factory.mktemp("kvsdk") / "data"
    data.mkdir()
    # the SDK needs the bucket `default`: a topic prefix of its own keeps this gateway's topic apart from other
    # tests' `default` buckets on the same broker
    gw = GatewayProc(kafka_broker, data, "default", nvb=NVB, DCPGW_KV_PORT="0", DCPGW_TOPIC_PREFIX=TOPIC_PREFIX)
    gw.start()
    # users of the store `dcpgw up` created (with Administrator): the running gateway reloads the file
    users = UserStore.open(data)
    users.add("app", PASSWORD, [Role.DATA_READER, Role.DATA_WRITER])
    users.add("reader", PASSWORD, [Role.DATA_READER])
    try:
        yield gw
    finally:
        gw.close()


@pytest.fixture(scope="module")
def kv_port(gateway: GatewayProc) -> int:
    port = gateway.get("/health")["kv_port"]
    assert isinstance(port, int) and port > 0
    return port


@pytest.fixture(scope="module")
def collection(kv_port: int) -> Iterator[Collection]:
    cluster = connect(kv_port, "app")
    try:
        yield cluster.bucket("default").default_collection()
    finally:
        cluster.close()


def test_document_operations(collection: Collection) -> None:
    c = collection
    r = c.upsert("doc-1", {"name": "one", "n": 1})
    token = r.mutation_token()
    assert token is not None and token.partition_id == vbucket_of(b"doc-1", NVB) and token.sequence_number >= 1
    g = c.get("doc-1")
    assert g.content_as[dict] == {"name": "one", "n": 1} and g.cas == r.cas
    with pytest.raises(DocumentExistsException):
        c.insert("doc-1", {"again": True})
    c.insert("doc-2", {"n": 2})
    with pytest.raises(CasMismatchException):
        c.replace("doc-1", {"n": 10}, ReplaceOptions(cas=g.cas + 1))
    rep = c.replace("doc-1", {"n": 10}, ReplaceOptions(cas=g.cas))
    assert rep.cas != g.cas and c.get("doc-1").content_as[dict] == {"n": 10}
    with pytest.raises(DocumentNotFoundException):
        c.replace("nope", {"n": 0})
    c.remove("doc-2")
    with pytest.raises(DocumentNotFoundException):
        c.get("doc-2")
    with pytest.raises(DocumentNotFoundException):
        c.remove("doc-2")
    assert c.exists("doc-1").exists and not c.exists("doc-2").exists
    # expiry: touch and get-and-touch
    t = c.touch("doc-1", timedelta(hours=1))
    assert t.cas != rep.cas
    assert c.get_and_touch("doc-1", timedelta(hours=2)).content_as[dict] == {"n": 10}
    # locks
    locked = c.get_and_lock("doc-1", timedelta(seconds=10))
    with pytest.raises(DocumentLockedException):
        c.get_and_lock("doc-1", timedelta(seconds=10))
    with pytest.raises(CasMismatchException):
        c.unlock("doc-1", locked.cas + 1)
    with pytest.raises(DocumentLockedException):  # the SDK retries LOCKED until its timeout
        c.upsert("doc-1", {"n": 0}, UpsertOptions(timeout=timedelta(seconds=1)))
    assert c.get("doc-1").cas == 0xFFFF_FFFF_FFFF_FFFF  # readers do not get the lock's CAS
    c.unlock("doc-1", locked.cas)
    with pytest.raises(DocumentNotLockedException):
        c.unlock("doc-1", locked.cas)
    again = c.get_and_lock("doc-1", timedelta(seconds=10))
    c.replace("doc-1", {"n": 11}, ReplaceOptions(cas=again.cas))  # the lock's CAS writes and unlocks
    c.upsert("doc-1", {"n": 12})
    # counters
    b = c.binary()
    from couchbase.options import DeltaValue, SignedInt64

    assert b.increment("ctr", IncrementOptions(initial=SignedInt64(10))).content == 10
    assert b.increment("ctr", IncrementOptions(delta=DeltaValue(5))).content == 15
    assert b.decrement("ctr", DecrementOptions(delta=DeltaValue(20))).content == 0
    # append / prepend (raw strings)
    raw = RawStringTranscoder()
    c.upsert("str", "mid", UpsertOptions(transcoder=raw))
    b.append("str", "-end")
    b.prepend("str", "start-")
    assert c.get("str", GetOptions(transcoder=raw)).content_as[str] == "start-mid-end"
    with pytest.raises(DocumentNotFoundException):
        b.append("missing", "x")


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
def test_durable_writes_at_each_level(collection: Collection, level: DurabilityLevel) -> None:
    c = collection
    dur = ServerDurability(level)
    key = f"durable-{level.name}"
    r = c.upsert(key, {"level": level.name}, UpsertOptions(durability=dur))
    assert r.mutation_token() is not None
    c.replace(key, {"level": level.name, "v": 2}, ReplaceOptions(durability=dur, cas=r.cas))
    c.insert(key + "-new", {"v": 1}, InsertOptions(durability=dur))
    assert c.get(key).content_as[dict] == {"level": level.name, "v": 2}
    c.remove(key + "-new", RemoveOptions(durability=dur))
    with pytest.raises(DocumentNotFoundException):
        c.get(key + "-new")


def test_sdk_writes_reach_kafka_as_http_writes_do(kafka_broker: Broker, gateway: GatewayProc,
                                                   collection: Collection) -> None:
    body = {"same": "value", "n": 7}
    collection.upsert("via-sdk", body)
    # the SDK's JSON transcoder sets the common flags 0x02000000 (JSON): give the HTTP write the same
    request(gateway.url + "/docs/via-http?flags=33554432", "PUT", json.dumps(body).encode())
    gateway.wait_caught_up()
    recs = {r.key: r for _p, _o, r in read_topic(kafka_broker.bootstrap_servers, f"{TOPIC_PREFIX}.default")
            if r.type is RecordType.MUTATION and r.key in (b"via-sdk", b"via-http")}
    sdk, http = recs[b"via-sdk"], recs[b"via-http"]
    assert json.loads(sdk.value or b"") == json.loads(http.value or b"") == body
    for f in ("type", "flags", "expiry", "datatype", "value_format", "rev_seqno"):
        assert getattr(sdk, f) == getattr(http, f), f


def test_wrong_password_and_missing_role(kv_port: int, collection: Collection) -> None:
    with pytest.raises(AuthenticationException):
        connect(kv_port, "app", "not-the-password")
    with pytest.raises(AuthenticationException):
        connect(kv_port, "nobody", PASSWORD)
    collection.upsert("readable", {"r": 1})
    reader = connect(kv_port, "reader")
    try:
        rc = reader.bucket("default").default_collection()
        assert rc.get("readable").content_as[dict] == {"r": 1}
        with pytest.raises(AuthenticationException) as e:  # EACCESS: the SDK raises its authentication error
            rc.upsert("readable", {"r": 2})
        assert "'status_code': 36" in str(e.value)
    finally:
        reader.close()
    assert collection.get("readable").content_as[dict] == {"r": 1}


def test_everything_acknowledged_is_in_kafka_after_stop(kafka_broker: Broker, gateway: GatewayProc,
                                                        collection: Collection) -> None:
    for i in range(20):
        collection.upsert(f"final-{i}", {"i": i})
    gateway.wait_caught_up()
    gateway.stop()
    verify(kafka_broker, gateway.data_dir, "default", NVB, topic=f"{TOPIC_PREFIX}.default")


# ------------------------------------------------------------------------------ in-process nodes
def test_durability_impossible_with_an_empty_replica_slot(tmp_path: Path) -> None:
    node = KVNode(tmp_path / "data", num_vbuckets=NVB)
    try:
        from tests.engine.network.kv.harness import PASSWORD as NODE_PW

        vb = vbucket_of(b"needs-replica", NVB)
        node.call(lambda: node.bucket.set_replication_topology(vb, ["self", None]))
        cluster = connect(node.port, "app", NODE_PW)
        try:
            c = cluster.bucket("default").default_collection()
            for level in LEVELS:
                with pytest.raises(DurabilityImpossibleException):
                    c.upsert("needs-replica", {"x": 1}, UpsertOptions(durability=ServerDurability(level)))
            c.upsert("needs-replica", {"x": 1})  # without durability it is a plain write
        finally:
            cluster.close()
    finally:
        node.close()


def test_dcpgw_up_with_tls_serves_couchbases(kafka_broker: Broker, tmp_path: Path) -> None:
    """``dcpgw up --tls-cert --tls-key``: the KV port serves TLS, the SDK connects with ``couchbases://``."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    data = tmp_path / "data"
    env = {**CLEAN_ENV, "KAFKA_BOOTSTRAP_SERVERS": kafka_broker.bootstrap_servers, "DCPGW_DATA_DIR": str(data),
           "DCPGW_NUM_VBUCKETS": str(NVB), "DCPGW_HTTP_PORT": "0"}
    proc = dcpgw_background("up", "--no-progress", "--kv-port", "0", "--tls-cert", str(tmp_path / "cert.pem"),
                            "--tls-key", str(tmp_path / "key.pem"), env=env)
    try:
        assert proc.stderr is not None
        port = 0
        deadline = time.monotonic() + 90
        while not port and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "dcpgw up exited"
            m = re.search(r"KV port (\d+) \(bucket default\): couchbases://", line)
            if m:
                port = int(m.group(1))
        assert port, "no KV port line"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining its log
        UserStore.open(data).add("app", PASSWORD, [Role.DATA_READER, Role.DATA_WRITER])
        with pytest.raises(Exception):  # noqa: B017 - plain text on the TLS port: the SDK cannot bootstrap
            connect(port, "app", timeout_s=3)
        cluster = connect(port, "app", scheme="couchbases", cert_path=str(tmp_path / "ca.pem"))
        try:
            c = cluster.bucket("default").default_collection()
            c.upsert("tls-doc", {"secure": True})
            assert c.get("tls-doc").content_as[dict] == {"secure": True}
        finally:
            cluster.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
