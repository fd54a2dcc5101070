"""``python -m bench.xdcr`` and ``python -m bench.search`` smoke runs: paired rounds end in the figure lines of
issues 12 and 13 (names, targets, the median paired ratio), and bad arguments end in one usage error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[2]
KEYS = ["figure", "value", "unit", "baseline", "ratio", "target", "better"]


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def figures(proc: subprocess.CompletedProcess[str]) -> tuple[list[dict], dict[str, dict]]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines() if x.startswith("{")]
    return lines, {x["figure"]: x for x in lines if "figure" in x}


def test_xdcr_bench_prints_the_median_paired_ratio() -> None:
    lines, figs = figures(run("bench.xdcr", "--docs", "300", "--rounds", "3"))
    rounds = [x for x in lines if x.get("info") == "round"]
    assert len(rounds) == 3
    f = figs["xdcr.throughput"]
    assert list(f) == KEYS and f["target"] == 0.7 and f["value"] > 0 and f["baseline"] > 0
    ratios = sorted(r["ratio"] for r in rounds)
    assert f["ratio"] == pytest.approx(ratios[1], abs=2e-3)


def test_search_bench_prints_the_median_paired_ratio() -> None:
    _lines, figs = figures(run("bench.search", "--docs", "300", "--rounds", "1"))
    f = figs["search.index_throughput"]
    assert list(f) == KEYS and f["target"] == 0.7 and f["value"] > 0 and f["baseline"] > 0
    assert "search.index_1001006_docs_wall" not in figs  # only for the reference size


@pytest.mark.parametrize("module", ["bench.xdcr", "bench.search"])
@pytest.mark.parametrize("bad", [["--docs", "0"], ["--rounds", "0"]])
def test_bad_arguments_exit_2_with_one_line(module: str, bad: list[str]) -> None:
    proc = run(module, *bad)
    assert proc.returncode == 2
    assert "error:" in proc.stderr.strip().splitlines()[-1]
