"""``python -m bench.engine`` smoke run: every figure one JSON line, ``engine.ingest`` the median of paired
rounds (issue 17 "Proof": alternate the baseline and the engine, report the median ratio of paired rounds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import compiled

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["figure", "value", "unit", "baseline", "ratio", "target", "better"]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.engine", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_tiny_run_prints_every_figure_and_ingest_from_paired_rounds() -> None:
    proc = run_bench("--docs", "2000", "--rounds", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()]
    figs = {x["figure"]: x for x in lines if "figure" in x}
    assert set(figs) == {"engine.ingest", "engine.stream_memory", "engine.resident_bytes", "engine.flush",
                         "engine.backfill", "engine.peak_rss", "engine.checkpoint_quota"}
    assert all(list(f) == KEYS for f in figs.values())
    assert figs["engine.ingest"]["target"] == 0.15 and figs["engine.peak_rss"]["target"] is None
    rounds = [x for x in lines if x.get("info") == "ingest_round"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    # which engine build the figures are of (docs/performance.md "Compiled modules")
    (build,) = [x for x in lines if x.get("info") == "engine_build"]
    assert build["mode"] == compiled.mode
    # the figure is the round with the median ratio, with that round's own baseline
    ratios = sorted(r["engine"] / r["baseline"] for r in rounds)
    ingest = figs["engine.ingest"]
    assert ingest["ratio"] == pytest.approx(ratios[1], abs=1e-3)
    (median,) = [r for r in rounds if r["engine"] / r["baseline"] == ratios[1]]
    assert ingest["baseline"] == pytest.approx(median["baseline"], rel=1e-3)


@pytest.mark.parametrize("bad", [["--docs", "10"], ["--rounds", "0"], ["--docs", "x"]])
def test_bad_arguments_exit_2_with_one_line(bad: list[str]) -> None:
    proc = run_bench(*bad)
    assert proc.returncode == 2
    assert "error:" in proc.stderr.strip().splitlines()[-1]
