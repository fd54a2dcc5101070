"""The XDCR target behind the gateway (docs/xdcr.md "Target side"): an accepted write with meta reaches Kafka
with the source's CAS, rev seqno, flags and expiry; rejected ones never do; the mode and the counters are on
/stats and /metrics; ``dcpgw up --conflict-resolution`` / DCPGW_CONFLICT_RESOLUTION; a mode mismatch is a
one-line error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.kv.conflict_resolution import ConflictRejected, ItemMeta
from gateway.broker import Broker
from gateway.config import load_settings
from gateway.exceptions import ConfigError
from schemas.records import RecordType
from tests.gateway.api_harness import run, run_cluster
from tests.gateway.kafka_util import read_topic

CAS = 0x1600_0000_0000_0000


def test_accepted_writes_with_meta_reach_kafka_with_the_source_meta(harness) -> None:
    h = harness()
    b = h.bucket
    b.set_with_meta("doc1", b'{"n": 1}', ItemMeta(CAS + 1, 7, flags=0x02000006, expiry=4_000_000_000))
    b.set_with_meta("doc2", b"raw", ItemMeta(CAS + 2, 3, flags=1))
    b.del_with_meta("doc3", None, ItemMeta(CAS + 3, 9, expiry=1_700_000_123))
    with pytest.raises(ConflictRejected):
        b.set_with_meta("doc1", b"behind", ItemMeta(CAS + 99, 6))  # seqno mode: rev 6 < 7
    h.settle()
    data = {r.key: r for _p, _o, r in read_topic(h.broker.bootstrap_servers, h.topic) if r.is_data}
    assert set(data) == {b"doc1", b"doc2", b"doc3"}
    d1, d2, d3 = data[b"doc1"], data[b"doc2"], data[b"doc3"]
    assert (d1.cas, d1.rev_seqno, d1.flags, d1.expiry, d1.value) == (CAS + 1, 7, 0x02000006, 4_000_000_000,
                                                                     b'{"n": 1}')
    assert (d2.cas, d2.rev_seqno, d2.flags) == (CAS + 2, 3, 1)
    assert (d3.type, d3.cas, d3.rev_seqno, d3.expiry) == (RecordType.DELETION, CAS + 3, 9, 1_700_000_123)


def test_settings_and_cli_flag() -> None:
    assert load_settings(None).conflict_resolution == "seqno"
    s = load_settings(None, conflict_resolution="lww")
    assert s.engine_config().conflict_resolution == "lww"
    with pytest.raises(ConfigError):
        load_settings(None, conflict_resolution="newest")


def test_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPGW_CONFLICT_RESOLUTION", "lww")
    assert load_settings(None).conflict_resolution == "lww"


def test_stats_and_metrics_show_mode_and_counters(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: Any, url: str, http: Any) -> None:
        b = svc.bucket
        b.set_with_meta("a", b"v", ItemMeta(CAS, 5))
        with pytest.raises(ConflictRejected):
            b.set_with_meta("a", b"v", ItemMeta(CAS, 5))
        with pytest.raises(ConflictRejected):
            b.set_with_meta("a", b"v", ItemMeta(CAS - 1, 5))
        async with http.get(f"{url}/stats") as r:
            body = await r.json()
        assert (body["conflict_resolution"], body["accepted"], body["rejected_behind"],
                body["rejected_identical"]) == ("lww", 1, 1, 1)
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert 'dcpgw_xdcr_target_writes{result="accepted"} 1.0' in text
        assert 'dcpgw_xdcr_target_writes{result="rejected_identical"} 1.0' in text
        assert 'dcpgw_conflict_resolution_mode{mode="lww"} 1.0' in text

    run(kafka_broker, tmp_path, scenario, conflict_resolution="lww")


def test_cluster_stats_sum_the_nodes(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: Any, url: str, http: Any) -> None:
        for i in range(10):
            svc.cluster.set_with_meta(f"k{i}", b"v", ItemMeta(CAS + i, 2))
        async with http.get(f"{url}/stats") as r:
            body = await r.json()
        assert (body["conflict_resolution"], body["accepted"]) == ("seqno", 10)

    run_cluster(kafka_broker, tmp_path, scenario)


def test_up_refuses_a_different_mode(kafka_broker: Broker, tmp_path: Path) -> None:
    from engine import Bucket, BucketConfig

    data = tmp_path / "data"
    Bucket(BucketConfig(data_dir=data, num_vbuckets=8, conflict_resolution="lww")).close()
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "up", "--data-dir", str(data), "--num-vbuckets", "8",
         "--http-port", "0", "--conflict-resolution", "seqno", "--no-progress"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "DCPGW_KAFKA__BOOTSTRAP_SERVERS": kafka_broker.bootstrap_servers})
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert any("created with conflict resolution 'lww'" in line for line in err), proc.stderr
