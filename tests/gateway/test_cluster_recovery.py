"""Delta recovery behind the gateway (docs/cluster.md "Delta recovery", "Rollback repair"): the Kafka topic's
replay and the rollback-aware Replicator (connectors/) converge to the actives whatever the recovery repaired
(hypothesis over the schedules of tests/engine/cluster/recovery_schedules.py, publishing from memory so
unreplicated writes reach Kafka, are rolled back at failover and come back as ordinary mutations); the admin
route ``POST /cluster/recover`` with a 4xx JSON error for every bad request, and ``dcpgw cluster recover``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import aiohttp
from hypothesis import HealthCheck, given, note, settings

from gateway.broker import Broker
from gateway.service import GatewayService
from schemas.records import RecordType
from tests.engine.cluster.recovery_schedules import run_recovery_schedule, schedule
from tests.gateway.api_harness import caught_up, expect_error
from tests.gateway.api_harness import run_cluster as run
from tests.gateway.test_cluster_api import cli
from tests.harness import ClusterHarness

#: DELTA_RECOVERY_KAFKA_EXAMPLES=N for more schedules (-s prints the counts)
EXAMPLES = int(os.environ.get("DELTA_RECOVERY_KAFKA_EXAMPLES", "6"))
STATS = {"histories": 0, "writes_at_risk": 0, "repaired": 0, "superseded": 0, "lost": 0, "rollback_records": 0}


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sched=schedule)
def test_delta_recovery_topic_replay_and_replicator_converge_to_the_actives(cluster_harness, sched) -> None:
    note(repr(sched))
    h: ClusterHarness = cluster_harness(rollback_mitigation=False)
    out = run_recovery_schedule(h.cluster, sched, publish=h.publish)
    h.settle()
    recs = h.check()  # every partition's invariants; the reference replay equals the actives
    with h.replicate() as rep:
        assert rep.docs() == h.actives()
    STATS["histories"] += 1
    STATS["writes_at_risk"] += out.at_risk
    STATS["repaired"] += out.repaired
    STATS["superseded"] += out.superseded
    STATS["lost"] += out.lost
    STATS["rollback_records"] += sum(1 for _p, _o, r in recs if r.type is RecordType.ROLLBACK)


def test_report_kafka_campaign_counts() -> None:
    print(f"\ndelta recovery + Kafka campaign: {STATS} at {time.strftime('%H:%M:%S')}")


def test_recover_route_cli_and_bad_input(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        body = [{"key": f"doc{i}", "value": {"n": i}} for i in range(100)]
        r = await http.post(f"{url}/docs/_bulk", data=json.dumps(body))
        assert r.status == 200
        await caught_up(http, url)
        # bad input: 4xx JSON, nothing changes
        for data, code in [(b"{", "invalid_json"), (b"[1]", "invalid_argument"), (b"{}", "invalid_argument"),
                           (b'{"node": 3}', "invalid_argument"), (b'{"node": ""}', "invalid_argument"),
                           (b'{"node": "n1", "mode": "partial"}', "invalid_argument"),
                           (b'{"node": "n1", "force": true}', "invalid_argument"),
                           (b'{"node": "n9"}', "invalid_argument"),  # unknown node
                           (b'{"node": "n1"}', "invalid_argument")]:  # never failed over
            await expect_error(await http.post(f"{url}/cluster/recover", data=data), 400, code)
        err = await expect_error(await http.post(f"{url}/cluster/recover", json={"node": "n1"}), 400)
        assert "never failed over" in err["message"]
        await expect_error(await http.get(f"{url}/cluster/recover"), 405)
        # unreplicated writes on n1's actives, a hard failover in the same loop turn (replication cannot run),
        # then the new actives overwrite one of those keys
        c = svc.cluster
        assert c is not None
        mine = set(c.vbucket_map().vbuckets_of("n1", slot=0))
        keys = [f"doc{i}" for i in range(100) if c.vbucket_of(f"doc{i}") in mine]
        for k in keys:
            c.write(k, f'{{"lost": "{k}"}}'.encode())
        svc.failover("n1", False)
        r = await http.put(f"{url}/docs/{keys[0]}", data=b'{"new": 1}')
        assert r.status == 200
        rc, out, errout = await cli("cluster", "recover", "n1", "--delta", "--url", url)
        assert rc == 0, errout
        rep = json.loads(out.strip().splitlines()[-1])
        assert rep["node"] == "n1" and rep["mode"] == "delta" and rep["rollback_repair"]
        assert rep["repaired"] == len(keys) - 1 and rep["superseded"] == 1 and rep["replicas"]
        await expect_error(await http.post(f"{url}/cluster/recover", json={"node": "n1"}), 400)  # again
        await caught_up(http, url)
        for k in keys[1:]:
            got = await http.get(f"{url}/docs/{k}")
            assert got.status == 200 and json.loads(await got.read()) == {"lost": k}
        got = await http.get(f"{url}/docs/{keys[0]}")
        assert json.loads(await got.read()) == {"new": 1}
        metrics = await (await http.get(f"{url}/metrics")).text()
        assert f"dcpgw_rollback_repaired_documents {float(len(keys) - 1)}" in metrics
        # a full recovery through the CLI; --delta and --full together are refused
        svc.failover("n2", False)
        rc, out, errout = await cli("cluster", "recover", "n2", "--delta", "--full", "--url", url)
        assert rc != 0 and "exclude" in errout
        rc, out, errout = await cli("cluster", "recover", "n2", "--full", "--url", url)
        assert rc == 0, errout
        assert json.loads(out.strip().splitlines()[-1])["mode"] == "full"
        rc, out, errout = await cli("cluster", "recover", "nope", "--url", url)
        assert rc == 2 and "400" in errout and "unknown node" in errout
        await caught_up(http, url)

    run(kafka_broker, tmp_path, scenario)


def test_recover_route_on_a_single_bucket_answers_404(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        await expect_error(await http.post(f"{url}/cluster/recover", json={"node": "n0"}), 404, "not_a_cluster")

    run(kafka_broker, tmp_path, scenario, cluster_nodes=1)
