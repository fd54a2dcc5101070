"""``python -m bench.latency`` and ``python -m bench.report`` smoke runs: the figure names of issue 17's latency
ask, and the three charts written as PNG files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from gateway.broker import Broker

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[2]
KEYS = ["figure", "value", "unit", "baseline", "ratio", "target", "better"]


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_latency_prints_the_lag_percentiles_against_the_raw_producer() -> None:
    proc = run("bench.latency", "--docs", "400", "--vbuckets", "16", "--cluster-docs", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()]
    figs = {x["figure"]: x for x in lines if "figure" in x}
    assert list(figs) == ["gateway.max_ingest", "gateway.lag_p50_ms", "gateway.lag_p99_ms",
                          "gateway.lag_unpersisted_p50_ms", "gateway.lag_unpersisted_p99_ms",
                          "gateway.cluster_lag_p50_ms", "gateway.cluster_lag_p99_ms"]
    assert all(list(f) == KEYS for f in figs.values())
    assert figs["gateway.lag_p99_ms"]["target"] == 100.0
    assert all(f["target"] is None for n, f in figs.items() if n != "gateway.lag_p99_ms")
    assert all(f["value"] > 0 for f in figs.values())
    assert figs["gateway.lag_p50_ms"]["value"] <= figs["gateway.lag_p99_ms"]["value"]
    info = next(x for x in lines if x.get("info") == "latency")
    # two rounds per mode at half the measured maximum rate
    assert info["writes_per_mode"] == 800
    assert info["steady_rate"] == pytest.approx(figs["gateway.max_ingest"]["value"] / 2, rel=0.01)
    # what the floor is made of: the saturation run without its start and drain, the raw producer's records per
    # ProduceRequest, the embedded broker's CPU per request (None on a broker this process did not start)
    # (None when a short run's acknowledgements all came in one batch: no middle to time)
    assert info["max_ingest_mid_run"] is None or info["max_ingest_mid_run"] > 0
    assert info["raw_records_per_produce_request"] > 0
    assert "broker_cpu_ms_per_produce_request" in info


def test_each_run_deletes_its_topic(kafka_broker: Broker, tmp_path: Path) -> None:
    """A run's topic is gone after it (the next run must not share the broker with its partitions)."""
    from bench import latency
    from gateway.config import load_settings

    conf = {**load_settings(None).producer_config(), "bootstrap.servers": kafka_broker.bootstrap_servers}
    client: dict[str, str | int | float | bool] = {"bootstrap.servers": kafka_broker.bootstrap_servers}
    admin = AdminClient(client)
    before = set(admin.list_topics(timeout=10).topics)
    raw = latency.raw_steady(conf, client, 200, 2000.0, 8)
    gw = latency.steady(conf, client, tmp_path, 200, 2000.0, 8, mitigation=True)
    assert len(raw.latencies_ms) == len(gw.latencies_ms) == 200
    assert raw.produce_requests > 0
    left = {t for t in set(admin.list_topics(timeout=10).topics) - before if t.startswith("bench-lat")}
    assert left == set()


def test_report_renders_the_three_charts(tmp_path: Path) -> None:
    proc = run("bench.report", "--docs", "300", "--lag-docs", "200", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = [Path(json.loads(x)["path"]) for x in proc.stdout.strip().splitlines()]
    assert sorted(p.name for p in paths) == ["gateway-lag.png", "gateway-rss.png", "gateway-throughput.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize(("module", "bad"), [("bench.latency", ["--docs", "10"]),
                                             ("bench.latency", ["--cluster-rate", "0"]),
                                             ("bench.report", ["--docs", "1"])])
def test_bad_arguments_exit_2_with_one_line(module: str, bad: list[str]) -> None:
    proc = run(module, *bad)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("usage:") is False
    assert "error:" in proc.stderr.strip().splitlines()[-1]
