"""``python -m bench.kv`` runs end to end on a tiny load (memcached + memcslap baseline, the SDK, the ingest
pipeline) and prints one well-formed JSON line per figure; no figure is asserted (timing targets are never test
assertions). Skipped where Debian's memcached / libmemcached-tools are missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ["kv.memcslap_set", "kv.memcslap_get", "kv.sdk_upsert", "kv.sdk_get", "kv.ingest", "kv.ingest_cpu"]


@pytest.mark.skipif(shutil.which("memcached") is None or shutil.which("memcslap") is None,
                    reason="Debian's memcached and libmemcached-tools (memcslap) are not installed")
def test_kv_bench_smoke() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.kv", "--docs", "200"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()]
    assert [x["figure"] for x in lines] == FIGURES
    for x in lines:
        assert set(x) == {"figure", "value", "unit", "baseline", "ratio", "target", "better"}
        assert x["value"] > 0 and x["baseline"] > 0 and x["better"] == "higher"
    assert lines[-1]["target"] == lines[-2]["target"] == 0.5


def test_kv_bench_bad_arguments() -> None:
    for args in (["--docs", "3"], ["--concurrency", "0"], ["--docs", "x"], ["--repeat", "0"]):
        proc = subprocess.run([sys.executable, "-m", "bench.kv", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and "error" in proc.stderr, (args, proc.stderr)
