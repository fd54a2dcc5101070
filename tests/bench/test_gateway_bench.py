"""``python -m bench.gateway`` smoke run: paired rounds end in one JSON line per figure (issue 17 names)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[2]
KEYS = ["figure", "value", "unit", "baseline", "ratio", "target", "better"]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.gateway", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_tiny_run_prints_every_figure_from_paired_rounds() -> None:
    proc = run_bench("--docs", "300", "--rounds", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()]
    rounds = [x for x in lines if x.get("info") == "round"]
    assert len(rounds) == 2 and all(r["on"]["records"] >= 300 for r in rounds)
    figs = {x["figure"]: x for x in lines if "figure" in x}
    assert list(figs) == ["gateway.publish", "gateway.publish_unpersisted", "gateway.wall_s", "gateway.cpu_s",
                          "gateway.rss_mib", "gateway.rss_mib.storage_writer"]
    assert all(list(f) == KEYS for f in figs.values())
    assert figs["gateway.publish"]["target"] == 0.8
    assert figs["gateway.wall_s"]["target"] is None  # 8 s is the target of the 1,001,006-docs run only
    assert figs["gateway.rss_mib"]["target"] == pytest.approx(381.47, abs=0.01)  # 400 MB in MiB
    # the storage's writer process (the background flush of rollback mitigation), reported apart
    writer = figs["gateway.rss_mib.storage_writer"]
    assert writer["target"] is None and 5 < writer["value"] < 200
    assert all(r["on"]["writer_cpu_s"] > 0 for r in rounds)
    # the ratio is one round's own ratio (the median of the paired rounds)
    ratios = sorted(r["on"]["rate"] / r["raw"]["rate"] for r in rounds)
    assert figs["gateway.publish"]["ratio"] == pytest.approx(ratios[0], abs=1e-3)


@pytest.mark.parametrize("bad", [["--docs", "0"], ["--rounds", "0"], ["--gateways", "0"], ["--docs", "x"]])
def test_bad_arguments_exit_2_with_one_line(bad: list[str]) -> None:
    proc = run_bench(*bad)
    assert proc.returncode == 2
    assert "error:" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_two_gateway_processes_print_the_scaleout_figure() -> None:
    proc = run_bench("--docs", "500", "--rounds", "1", "--gateways", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()]
    (fig,) = [x for x in lines if x.get("figure") == "gateway.scaleout"]
    assert list(fig) == KEYS and fig["target"] == 1.6 and fig["value"] > 0 and fig["baseline"] > 0
    (rnd,) = [x for x in lines if x.get("info") == "round"]
    assert rnd["scaleout"]["many"]["gateways"] == 2 and rnd["scaleout"]["one"]["gateways"] == 1
    rss = {x["figure"]: x for x in lines if x.get("figure", "").startswith("gateway.rss_mib.")}
    assert set(rss) == {"gateway.rss_mib.engine", "gateway.rss_mib.gateway0", "gateway.rss_mib.gateway1",
                        "gateway.rss_mib.storage_writer"}
    # each gateway process against the 400 MB, the engine node's resident data reported apart
    assert rss["gateway.rss_mib.engine"]["target"] is None
    assert all(rss[f"gateway.rss_mib.gateway{j}"]["target"] == pytest.approx(381.47, abs=0.01) for j in (0, 1))
