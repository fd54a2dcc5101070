"""Property on real processes (slow): kill -9 of the gateway (``dcpgw up`` publishing the topic) and of the
replicator (``dcpgw xdcr``) at random points of random histories, ending with ``dcpgw xdcr --until-caught-up``:
the target's documents and metadata equal the source's for every key (docs/xdcr.md "Proof").

The gateway publishes from memory (``DCPGW_ROLLBACK_MITIGATION=false``) and flushes rarely, so a kill -9 loses
writes already in Kafka: at its restart it writes rollback records, and the replicator restores the target.
Prints the counts (histories, gateway kills, replicator kills, rollbacks crossed, documents restored)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.xdcr.replicator import read_status
from engine import Bucket, BucketConfig, vbucket_of
from gateway.broker import Broker
from tests.connectors.xdcr.harness import diverging, source_docs, target_docs, target_node
from tests.gateway.processes import CLI, ROOT, GatewayProc, call, dcpgw

NVB = 8
KEYS = 30

op = st.one_of(
    st.tuples(st.just("write"), st.lists(st.tuples(st.integers(0, KEYS - 1), st.integers(0, 3), st.booleans()),
                                         min_size=1, max_size=25)),
    st.tuples(st.just("delete"), st.integers(0, KEYS - 1)),
    st.tuples(st.just("kill_gateway")),
    st.tuples(st.just("replicator"), st.floats(0.2, 2.0)),
)


class ProcessRun:
    def __init__(self, broker: Broker, tmp: Path, target: Any) -> None:
        self.bucket = f"xk{uuid.uuid4().hex[:8]}"
        self.data = tmp / self.bucket / "data"
        self.data.mkdir(parents=True)
        self.broker = broker
        self.target = target
        self.gw = GatewayProc(broker, self.data, self.bucket, nvb=NVB, DCPGW_ROLLBACK_MITIGATION="false",
                              DCPGW_FLUSH_INTERVAL_S="5")
        self.gw.start()
        self.state = tmp / self.bucket / "xdcr"
        self.args = ["xdcr", "--topic", f"dcp.{self.bucket}", "--target", f"couchbase://127.0.0.1:{target.port}",
                     "--state-dir", str(self.state), "--bootstrap", broker.bootstrap_servers, "--batch-docs", "20"]
        self.n = 0
        self.gateway_kills = 0
        self.replicator_kills = 0

    def key(self, i: int) -> str:
        return f"{self.bucket}-{i}"

    def apply(self, o: tuple[Any, ...]) -> None:
        kind = o[0]
        if kind == "write":
            docs = []
            for i, flags, expiring in o[1]:
                self.n += 1
                docs.append({"key": self.key(i), "value": {"n": self.n, "pad": "x" * (self.n % 3 * 150)},
                             "flags": flags, **({"expiry": int(time.time()) + 900} if expiring else {})})
            call(self.gw.url + "/docs/_bulk", "POST", json.dumps(docs).encode(), timeout=30)
        elif kind == "delete":
            try:
                call(f"{self.gw.url}/docs/{self.key(o[1])}", "DELETE")
            except urllib.error.HTTPError as e:
                assert e.code == 404, e
        elif kind == "kill_gateway":
            time.sleep(0.3)  # published from memory, not flushed yet (flush interval 5 s)
            self.gw.kill9()
            self.gateway_kills += 1
            self.gw.start()
        elif kind == "replicator":
            log = self.state.parent / "xdcr.log"
            with open(log, "ab") as err:
                p = subprocess.Popen([*CLI, *self.args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
            time.sleep(o[1])
            assert p.poll() is None, log.read_text()[-3000:]  # it runs until stopped: a kill -9 ends it
            p.send_signal(signal.SIGKILL)
            p.wait(30)
            self.replicator_kills += 1

    def converge(self) -> dict[str, int]:
        self.gw.wait_caught_up()
        proc = dcpgw(*self.args, "--until-caught-up", timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        self.gw.stop()
        b = Bucket(BucketConfig(data_dir=self.data, name=self.bucket, num_vbuckets=NVB))
        try:
            src = source_docs(b)
        finally:
            b.close()
        keys = {self.key(i).encode(): vbucket_of(self.key(i).encode(), NVB) for i in range(KEYS)}
        bad = diverging(src, target_docs(self.target, keys))
        assert not bad, sorted(bad.items())[:4]
        c = read_status(self.state)["counters"]
        return {"rollbacks": int(c["rollbacks"]), "restored": int(c["restored"])}

    def close(self) -> None:
        self.gw.close()


@pytest.mark.slow
def test_kill_9_of_gateway_and_replicator_processes_converges(kafka_broker: Broker, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    target = target_node(tmp_path / "target-node", nvb=NVB)
    totals = {"histories": 0, "gateway_kills": 0, "replicator_kills": 0, "rollbacks": 0, "restored": 0}

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(op, min_size=3, max_size=8))
    def history(ops: list[tuple[Any, ...]]) -> None:
        run = ProcessRun(kafka_broker, tmp_path, target)
        try:
            # a kill of the gateway right after writes, then more writes: the lost branch is in Kafka
            for o in [("write", [(i, 1, False) for i in range(10)]), *ops, ("kill_gateway",)]:
                run.apply(o)
            counts = run.converge()
        finally:
            run.close()
        totals["histories"] += 1
        totals["gateway_kills"] += run.gateway_kills
        totals["replicator_kills"] += run.replicator_kills
        totals["rollbacks"] += counts["rollbacks"]
        totals["restored"] += counts["restored"]

    t0 = time.monotonic()
    try:
        history()
    finally:
        target.kill()
    with capsys.disabled():
        print(f"\nxdcr process kills: {totals['histories']} histories, {totals['gateway_kills']} gateway kills, "
              f"{totals['replicator_kills']} replicator kills, {totals['rollbacks']} rollbacks crossed, "
              f"{totals['restored']} documents restored ({time.monotonic() - t0:.0f} s)")
    assert totals["histories"] >= 4
