"""The replicator's target client against ``dcpgw up``'s KV port (docs/kv-protocol.md): HELLO, SASL SCRAM,
SELECT_BUCKET and GET_CLUSTER_CONFIG (the vbucket map) with a replication-target user, and a wrong password
as a clear error retried with backoff (``dcpgw xdcr`` exits 3 after ``--give-up-after``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.xdcr.connection import Credentials
from connectors.xdcr.errors import TargetAuthError
from connectors.xdcr.target import TargetCluster, TargetSpec
from engine.security.roles import Role
from engine.security.users import UserStore
from gateway.broker import Broker
from tests.gateway.processes import GatewayProc, dcpgw

pytestmark = pytest.mark.slow

PASSWORD = "xdcr-secret-pw"
NVB = 16


#: the gateway of this module publishes into `<TOPIC_PREFIX>.default`
TOPIC_PREFIX = f"xdcrkv{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def kv_port(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    data = tmp_path_factory.mktemp("xdcrkv") / "data"
    data.mkdir()
    gw = GatewayProc(kafka_broker, data, "default", nvb=NVB, DCPGW_KV_PORT="0",
                     DCPGW_TOPIC_PREFIX=TOPIC_PREFIX)  # apart from other tests' `default` buckets
    gw.start()
    UserStore.open(data).add("xdcr", PASSWORD, [Role.REPLICATION_TARGET, Role.DATA_READER])
    try:
        port = gw.get("/health")["kv_port"]
        assert isinstance(port, int) and port > 0
        yield port
    finally:
        gw.close()


def test_handshake_with_scram_and_the_vbucket_map(kv_port: int) -> None:
    t = TargetCluster(TargetSpec.parse(f"couchbase://127.0.0.1:{kv_port}/default"), Credentials("xdcr", PASSWORD))
    try:
        t.connect()
        c = next(iter(t.conns.values()))
        assert c.authenticated_as == "xdcr" and c.bucket_selected == "default"
        assert any(m.startswith("SCRAM-SHA") for m in c.mechanisms)
        assert t.num_vbuckets == NVB
        assert t.get_meta([(0, b"no-such-key")]) == [None]
    finally:
        t.close()


def test_wrong_password_is_refused(kv_port: int) -> None:
    t = TargetCluster(TargetSpec.parse(f"couchbase://127.0.0.1:{kv_port}"), Credentials("xdcr", "wrong"))
    with pytest.raises(TargetAuthError, match="refused the credentials"):
        t.connect()


def test_cli_wrong_password_is_one_clear_line_after_retries(kv_port: int, kafka_broker: Broker,
                                                            tmp_path: Path) -> None:
    proc = dcpgw("xdcr", "--topic", f"{TOPIC_PREFIX}.default", "--target", f"couchbase://127.0.0.1:{kv_port}",
                 "--user", "xdcr", "--password", "wrong", "--state-dir", str(tmp_path / "s"), "--bootstrap",
                 kafka_broker.bootstrap_servers, "--give-up-after", "1", timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "refused the credentials of user 'xdcr'" in proc.stderr.strip().splitlines()[-1]
    st = dcpgw("xdcr", "status", "--state-dir", str(tmp_path / "s"))
    assert '"state": "auth_failed"' in st.stdout


def test_dcpgw_xdcr_into_the_kv_port_of_dcpgw_up(kv_port: int, kafka_broker: Broker, tmp_path: Path) -> None:
    """`dcpgw xdcr --target couchbase://HOST:KVPORT --user U --password P` end to end: a topic of 8 vbuckets
    into a 16-vbucket `dcpgw up` (keys routed by the target's map), with a replication-target user; the
    target's metadata equals the source's for every key."""
    import json

    from tests.connectors.xdcr.harness import source_docs
    from tests.harness import Harness, write

    h = Harness(kafka_broker, tmp_path / "h", rollback_mitigation=False)
    try:
        write(h.bucket, 120, prefix="xk")
        h.bucket.flush_all()
        h.settle()
        proc = dcpgw("xdcr", "--topic", h.topic, "--target", f"couchbase://127.0.0.1:{kv_port}/default",
                     "--user", "xdcr", "--password", PASSWORD, "--state-dir", str(tmp_path / "s"),
                     "--bootstrap", kafka_broker.bootstrap_servers, "--until-caught-up", timeout=120)
        assert proc.returncode == 0, proc.stderr
        src = source_docs(h.bucket)
        assert json.loads(proc.stdout.strip().splitlines()[-1])["written"] == len(src)
        t = TargetCluster(TargetSpec.parse(f"couchbase://127.0.0.1:{kv_port}"), Credentials("xdcr", PASSWORD))
        try:
            t.connect()
            keys = sorted(src)
            metas = t.get_meta([(0, k) for k in keys])  # routed by the target's map
        finally:
            t.close()
        for k, m in zip(keys, metas, strict=True):
            _v, cas, rev, flags, expiry, deleted = src[k]
            assert m is not None and (m.cas, m.rev_seqno, m.flags, m.deleted) == (cas, rev, flags, deleted), k
            if not deleted:
                assert m.expiry == expiry
    finally:
        h.close()
