"""The cluster admin API and CLI on a running GatewayService in cluster mode (real broker): ``GET /cluster``,
``GET /cluster/map``, ``POST /cluster/failover`` with a 4xx JSON error for every bad request, documents routed
through the map, the gateway following a failover, and ``dcpgw cluster ...`` against it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

import aiohttp

from gateway.broker import Broker
from gateway.service import GatewayService
from tests.gateway.api_harness import NVB, caught_up, expect_error
from tests.gateway.api_harness import run_cluster as run

ROOT = Path(__file__).resolve().parents[2]


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_cluster_routes_failover_and_bad_input(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        body = [{"key": f"doc{i}", "value": {"n": i}} for i in range(200)]
        r = await http.post(f"{url}/docs/_bulk", data=json.dumps(body))
        assert r.status == 200 and (await r.json())["written"] == 200
        r = await http.put(f"{url}/docs/one", data=b'{"a": 1}')
        assert r.status == 200
        st = await caught_up(http, url)
        assert st["revision"] == 1 and st["replicas"] == 1
        assert [n["name"] for n in st["nodes"]] == ["n0", "n1", "n2"]
        assert all(n["up"] and n["status"] == "up" for n in st["nodes"])
        assert sum(n["active_vbuckets"] for n in st["nodes"]) == NVB
        assert sum(n["replica_vbuckets"] for n in st["nodes"]) == NVB
        m = await (await http.get(f"{url}/cluster/map")).json()
        assert m["revision"] == 1 and len(m["chains"]) == NVB and m["nodes"] == ["n0", "n1", "n2"]

        # bad admin input: 4xx JSON, nothing changes
        for data, code in [(b"{", "invalid_json"), (b"[1]", "invalid_argument"), (b"{}", "invalid_argument"),
                           (b'{"node": 3}', "invalid_argument"), (b'{"node": ""}', "invalid_argument"),
                           (b'{"node": "n1", "graceful": "yes"}', "invalid_argument"),
                           (b'{"node": "n1", "force": true}', "invalid_argument"),
                           (b'{"node": "n9"}', "invalid_argument")]:
            await expect_error(await http.post(f"{url}/cluster/failover", data=data), 400, code)
        await expect_error(await http.get(f"{url}/cluster/failover"), 405)
        assert (await (await http.get(f"{url}/cluster/map")).json())["revision"] == 1

        # graceful failover of n1 through the API: a takeover, then the gateway follows the new map
        r = await http.post(f"{url}/cluster/failover", json={"node": "n1", "graceful": True})
        assert r.status == 200, await r.text()
        rep = await r.json()
        assert rep["node"] == "n1" and rep["graceful"] and rep["revision"] == 2
        assert rep["promoted"] and all(e is None for e in rep["entries"].values()) and rep["lost"] == []
        await expect_error(await http.post(f"{url}/cluster/failover", json={"node": "n1"}), 400)  # again
        r = await http.put(f"{url}/docs/after", data=b'{"b": 2}')
        assert r.status == 200
        st = await caught_up(http, url)
        n1 = next(n for n in st["nodes"] if n["name"] == "n1")
        assert n1["status"] == "failed_over" and not n1["in_map"] and n1["active_vbuckets"] == 0
        assert st["gateway"]["rollbacks"] == 0 and st["gateway"]["restreams"] >= len(rep["promoted"])
        r = await http.get(f"{url}/docs/after")
        assert r.status == 200 and await r.read() == b'{"b": 2}'

        # hard failover of n0 (a replica-less chain loses its vbuckets' active), then n2 is the last node
        r = await http.post(f"{url}/cluster/failover", json={"node": "n0", "graceful": False})
        assert r.status == 200, await r.text()
        assert (await r.json())["revision"] == 3
        await expect_error(await http.post(f"{url}/cluster/failover", json={"node": "n2"}), 400,
                           "invalid_argument")
        st = await caught_up(http, url)
        assert [n["name"] for n in st["nodes"] if n["in_map"]] == ["n2"]
        h = await http.get(f"{url}/health")
        assert h.status == 200

    run(kafka_broker, tmp_path, scenario)


def test_cluster_cli_status_map_and_failover(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        await http.post(f"{url}/docs/_bulk", data=json.dumps([{"key": f"d{i}", "value": i} for i in range(50)]))
        await caught_up(http, url)
        rc, out, err = await cli("cluster", "status", "--url", url, "--json")
        assert rc == 0, err
        assert json.loads(out)["revision"] == 1
        rc, out, err = await cli("cluster", "map", "--url", url)
        assert rc == 0, err
        assert out.splitlines()[0].startswith("revision 1") and len(out.splitlines()) == NVB + 1
        rc, out, err = await cli("cluster", "failover", "n2", "--graceful", "--url", url)
        assert rc == 0, err
        res = json.loads(out.strip().splitlines()[-1])
        assert res["node"] == "n2" and res["revision"] == 2 and res["gateway_rollbacks"] == 0
        assert res["new_branches"] == 0 and res["promoted"] > 0
        rc, out, err = await cli("cluster", "failover", "nope", "--url", url)
        assert rc == 2 and "400" in err and "unknown node" in err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), err  # no leftover progress line

    run(kafka_broker, tmp_path, scenario)


def test_cluster_routes_on_a_single_bucket_answer_404(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        await expect_error(await http.get(f"{url}/cluster"), 404, "not_a_cluster")
        await expect_error(await http.get(f"{url}/cluster/map"), 404, "not_a_cluster")
        await expect_error(await http.post(f"{url}/cluster/failover", json={"node": "n0"}), 404, "not_a_cluster")

    run(kafka_broker, tmp_path, scenario, cluster_nodes=1)


def test_cluster_rebalance_route_cli_and_bad_input(kafka_broker: Broker, tmp_path: Path) -> None:
    """POST /cluster/rebalance (4xx JSON for bad input), the rebalance running inside the pump loop while
    documents are written and published, GET /cluster/rebalance progress, and `dcpgw cluster rebalance`."""

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        await http.post(f"{url}/docs/_bulk", data=json.dumps([{"key": f"d{i}", "value": i} for i in range(100)]))
        await caught_up(http, url)
        await expect_error(await http.get(f"{url}/cluster/rebalance"), 404, "no_rebalance")
        for data, code in [(b"{", "invalid_json"), (b"[1]", "invalid_argument"),
                           (b'{"add": "n3"}', "invalid_argument"), (b'{"add": [3]}', "invalid_argument"),
                           (b'{"add": [""]}', "invalid_argument"), (b'{"nodes": ["n3"]}', "invalid_argument"),
                           (b'{"remove": ["n9"]}', "invalid_argument"),
                           (b'{"remove": ["n0", "n1", "n2"]}', "invalid_argument"),
                           (b'{"remove": ["n0", "n1"]}', "invalid_argument"),  # 1 node cannot hold a replica
                           (b'{"add": ["n1"]}', "invalid_argument"),
                           (b'{"add": ["n3"], "remove": ["n3"]}', "invalid_argument")]:
            await expect_error(await http.post(f"{url}/cluster/rebalance", data=data), 400, code)
        assert (await (await http.get(f"{url}/cluster/map")).json())["revision"] == 1

        # rebalance n3 in through the API while documents keep coming
        r = await http.post(f"{url}/cluster/rebalance", json={"add": ["n3"]})
        assert r.status == 202, await r.text()
        p = await r.json()
        assert p["status"] == "running" and p["total"] > 0 and "n3" in p["nodes"]
        written = 0
        for _ in range(2000):
            # a write first: the API retries a NOT_MY_VBUCKET met during a takeover until the map names the
            # new active, so writes succeed throughout (503 only if a move outlasts its wait)
            r = await http.put(f"{url}/docs/w{written % 40}", data=json.dumps({"w": written}).encode())
            assert r.status in (200, 503), await r.text()
            if r.status == 200:
                written += 1
            p = await (await http.get(f"{url}/cluster/rebalance")).json()
            if p["status"] != "running":
                break
            await asyncio.sleep(0.005)
        assert p["status"] == "done" and p["moved"] == p["total"], p
        assert written > 0
        st = await caught_up(http, url)
        assert st["rebalance"]["status"] == "done"
        n3 = next(n for n in st["nodes"] if n["name"] == "n3")
        assert n3["in_map"] and n3["active_vbuckets"] > 0
        assert st["gateway"]["rollbacks"] == 0

        # and n0 out with the CLI (progress bars on stderr, one JSON line on stdout)
        rc, out, err = await cli("cluster", "rebalance", "--remove", "n0", "--url", url)
        assert rc == 0, err
        res = json.loads(out.strip().splitlines()[-1])
        assert res["status"] == "done" and res["moved"] == res["total"] > 0 and "n0" not in res["nodes"]
        assert res["gateway_rollbacks"] == 0
        assert "rebalance -n0: done" in err and "gateway streaming from the new actives" in err
        rc, out, err = await cli("cluster", "rebalance", "--remove", "n9", "--url", url)
        assert rc == 2 and "400" in err and "unknown node" in err
        st = await caught_up(http, url)
        assert [n["name"] for n in st["nodes"] if n["in_map"]] == ["n1", "n2", "n3"]
        for i in range(100):
            r = await http.get(f"{url}/docs/d{i}")
            assert r.status == 200 and json.loads(await r.read()) == i

    run(kafka_broker, tmp_path, scenario)


def test_a_second_rebalance_while_one_runs_answers_409(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        await caught_up(http, url)
        pump = next(t for t in svc._tasks if t.get_name() == "dcpgw-pump")
        pump.cancel()  # nothing steps the rebalance: it stays running (deterministic)
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        r = await http.post(f"{url}/cluster/rebalance", json={"add": ["n3"]})
        assert r.status == 202
        await expect_error(await http.post(f"{url}/cluster/rebalance", json={"add": ["n4"]}), 409,
                           "rebalance_running")
        p = await (await http.get(f"{url}/cluster/rebalance")).json()
        assert p["status"] == "running" and p["moved"] == 0
        # a node of the map going down stops it; a new one is refused until that node is failed over
        assert svc.cluster is not None
        svc.cluster.kill("n2")
        p = await (await http.get(f"{url}/cluster/rebalance")).json()
        assert p["status"] == "failed" and "n2" in p["error"]
        await expect_error(await http.post(f"{url}/cluster/rebalance", json={"add": ["n4"]}), 503,
                           "temporary_failure")

    run(kafka_broker, tmp_path, scenario)


def test_cli_load_retries_entries_a_down_node_refuses_and_reports_what_stays_refused(
        kafka_broker: Broker, tmp_path: Path) -> None:
    """`dcpgw load` against a cluster with a node down: the `_bulk` entries of that node's vbuckets fail alone
    (503 temporary_failure); load sends them again until --max-wait, so a node back in time loses nothing, and
    one that stays down ends the load with exit 1 and a line saying what was refused (it said "wrote N")."""
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        c = svc.cluster
        assert c is not None
        c.kill("n2")
        rc, _out, err = await cli("load", "--docs", "60", "--batch", "30", "--url", url, "--max-wait", "1",
                                  "--prefix", "gone::")
        assert rc == 1, err
        assert "still refused" in err and "acknowledged" in err, err
        load = asyncio.create_task(cli("load", "--docs", "60", "--batch", "30", "--url", url, "--max-wait", "60",
                                       "--prefix", "back::"))
        await asyncio.sleep(1.5)
        c.restart("n2")
        rc, _out, err = await load
        assert rc == 0, err
        for i in range(60):
            r = await http.get(f"{url}/docs/back::{i:07d}")
            assert r.status == 200, (i, await r.text())

    run(kafka_broker, tmp_path, scenario, cluster_replicas=0)


def test_cli_load_during_a_rebalance_retries_what_met_not_my_vbucket(kafka_broker: Broker, tmp_path: Path) -> None:
    """`dcpgw load` while vbuckets move: an entry routed to a vbucket's old active just before its takeover is
    answered 404 not_my_vbucket alone; load sends it again (as a 503) instead of ending with "refused" (an
    audit saw 38 of 30,000 refused). Every document is there afterwards."""
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        load = asyncio.create_task(cli("load", "--docs", "3000", "--batch", "50", "--url", url, "--max-wait",
                                       "60", "--prefix", "mv-"))
        await asyncio.sleep(0.3)
        r = await http.post(f"{url}/cluster/rebalance", json={"add": ["n3"], "remove": ["n0"]})
        assert r.status in (200, 202), await r.text()
        rc, out, err = await load
        assert rc == 0, err
        assert "wrote 3000 documents" in out
        for i in range(0, 3000, 97):
            got = await http.get(f"{url}/docs/mv-{i:07d}")
            assert got.status == 200, (i, await got.text())

    run(kafka_broker, tmp_path, scenario)
