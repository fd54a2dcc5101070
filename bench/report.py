"""The one output format of every benchmark: one JSON line per figure, with its same-run baseline."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

R = TypeVar("R")


def figure(name: str, value: float, unit: str, baseline: float, target: float | None, better: str) -> None:
    """Print ``{"figure", "value", "unit", "baseline", "ratio", "target", "better"}`` (ratio = value / baseline;
    ``target`` is the figure an issue set, ``None`` -- printed ``null`` -- for an informational figure)."""
    ratio = value / baseline if baseline else 0.0
    print(json.dumps({"figure": name, "value": round(value, 1), "unit": unit, "baseline": round(baseline, 1),
                      "ratio": round(ratio, 3), "target": target, "better": better}), flush=True)


def median_round(rounds: Sequence[R], ratio: Callable[[R], float]) -> R:
    """The paired round whose ratio is the (lower) median of every round's ratio (issue 17 "Proof": alternate
    the baseline and the measured side, report the median of the paired ratios with that round's baseline)."""
    ratios = [ratio(r) for r in rounds]
    return rounds[ratios.index(statistics.median_low(ratios))]


def paired_rate_ratio(pair: tuple[dict[str, Any], dict[str, Any]]) -> float:
    """A (measured, baseline) pair's ratio of their ``rate``."""
    return float(pair[0]["rate"] / pair[1]["rate"])


def engine_build() -> None:
    """Print ``{"info": "engine_build", "mode": ...}``: whether the engine's compiled modules ran, or its sources
    and why (engine/compiled.py; docs/performance.md "Compiled modules") -- figures of the two differ."""
    from engine import compiled

    print(json.dumps({"info": "engine_build", "mode": compiled.mode}), flush=True)


# ---------------------------------------------------------------------------------------------- the charts
# ``python -m bench.report [--docs N] [--out DIR]``: PNG charts of the gateway's runs (issue 17 "Pictures"),
# drawn with matplotlib (the `dev` extra) into docs/img/ and shown in docs/performance.md:
#   gateway-throughput.png  acknowledged docs/s over time while N documents are published (mitigation on / off)
#                           beside the raw producer's rate in the same run (bench.gateway's figure, over time)
#   gateway-lag.png         write -> delivery latency p50 / p99 per 100 ms window at half the maximum ingest
#                           rate (bench.latency): mitigation on / off and the raw producer
#   gateway-rss.png         the resident set of the publishing process over time (each run in its own process)

def child_result(module: str, args: list[str], what: str) -> dict[str, Any]:
    """Run ``python -m module *args`` (one timed run in a fresh process) and return the JSON of its last stdout
    line; a failed run ends the benchmark with one line naming ``what`` and the run's own last error line."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        raise SystemExit(f"error: {what} failed (exit status {out.returncode}): "
                         f"{lines[-1].strip() if lines else 'no output'}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


CHARTS = ("gateway-throughput.png", "gateway-lag.png", "gateway-rss.png")


def _child(kind: str, docs: int, rate: float, kafka: str, work_dir: str) -> None:
    """One run in this (fresh) process; its series as the last stdout line."""
    from bench import latency
    from bench.gateway import raw_run

    k = json.loads(kafka)
    conf, client, base = k["producer"], k["client"], Path(work_dir)
    if kind == "raw-bulk":
        out: dict[str, object] = dict(raw_run(conf, client, docs))
    elif kind in ("bulk-on", "bulk-off"):
        r = latency.bulk(conf, client, base, docs, mitigation=kind == "bulk-on")
        out = {"rate": r.rate, "series": r.series.as_json()}
    elif kind == "saturated":
        out = {"rate": latency.saturated(conf, client, base, docs).rate}
    elif kind == "raw-steady":
        r = latency.raw_steady(conf, client, docs, rate)
        out = {"rate": r.rate, "series": r.series.as_json()}
    else:
        r = latency.steady(conf, client, base, docs, rate, mitigation=kind == "steady-on")
        out = {"rate": r.rate, "series": r.series.as_json()}
    print(json.dumps(out), flush=True)


def _windows(series: dict[str, Any], p: float) -> tuple[list[float], list[float]]:
    """(t, percentile p of the latencies completed in each window) for the windows that completed any."""
    from bench.latency import pct

    ts, vs = [], []
    for t, lat in zip(series["t"], series["latencies_ms"], strict=True):
        if lat:
            ts.append(t)
            vs.append(pct(lat, p))
    return ts, vs


def _save(plt: Any, fig: Any, ax: Any, path: Path, **legend: Any) -> Path:
    """The common end of every chart: legend, grid, tight layout, the PNG written, the figure closed."""
    ax.legend(**legend)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(results: dict[str, Any], out_dir: Path, docs: int) -> list[Path]:
    """Render the three charts from the runs' results; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    colors = {"on": "tab:blue", "off": "tab:orange", "raw": "tab:gray"}

    fig, ax = plt.subplots(figsize=(8, 4))
    for mode in ("on", "off"):
        s = results[f"bulk-{mode}"]["series"]
        ax.plot(s["t"], s["docs_per_s"], color=colors[mode],
                label=f"gateway, rollback mitigation {mode} ({results[f'bulk-{mode}']['rate']:,.0f} docs/s)")
    ax.axhline(results["raw-bulk"]["rate"], color=colors["raw"], linestyle="--",
               label=f"raw producer, same records ({results['raw-bulk']['rate']:,.0f} records/s)")
    ax.set(xlabel="seconds", ylabel="acknowledged docs/s (100 ms windows)",
           title=f"Publishing {docs:,} documents over 1024 vbuckets")
    written.append(_save(plt, fig, ax, out_dir / CHARTS[0], fontsize=8))

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, key in (("on", "steady-on"), ("off", "steady-off"), ("raw", "raw-steady")):
        s = results[key]["series"]
        label = {"on": "gateway, mitigation on", "off": "gateway, mitigation off", "raw": "raw producer"}[name]
        for p, style in ((50, "-"), (99, ":")):
            t, v = _windows(s, p)
            ax.plot(t, v, color=colors[name], linestyle=style, label=f"{label} p{p}")
    ax.axhline(100, color="tab:red", linewidth=0.8, label="target p99 100 ms")
    ax.set(xlabel="seconds", ylabel="write -> Kafka delivery (ms)", yscale="log",
           title=f"Lag at half the maximum ingest rate ({results['rate']:,.0f} writes/s)")
    written.append(_save(plt, fig, ax, out_dir / CHARTS[1], fontsize=7, ncol=2))

    fig, ax = plt.subplots(figsize=(8, 4))
    for mode in ("on", "off"):
        s = results[f"bulk-{mode}"]["series"]
        ax.plot(s["t"], s["rss_mib"], color=colors[mode], label=f"gateway process, mitigation {mode}")
    ax.axhline(results["raw-bulk"]["rss_mib"], color=colors["raw"], linestyle="--",
               label="raw producer process (peak)")
    ax.set(xlabel="seconds", ylabel="RSS (MiB)", title=f"Resident memory while publishing {docs:,} documents "
           "(engine in the process)")
    written.append(_save(plt, fig, ax, out_dir / CHARTS[2], fontsize=8))
    return written


def main() -> None:
    import argparse
    import subprocess
    import sys
    import tempfile

    ap = argparse.ArgumentParser(description="Render the gateway's charts (PNG) into docs/img/.")
    ap.add_argument("--docs", type=int, default=200_000, help="documents of the publishing runs")
    ap.add_argument("--lag-docs", type=int, default=20_000, help="writes of each steady-state lag run")
    ap.add_argument("--out", default="docs/img", help="directory of the PNG files")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--kafka", help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.docs < 100 or args.lag_docs < 100:
        ap.error("--docs and --lag-docs must be at least 100")
    if args.run is not None:
        _child(args.run, args.docs, args.rate, args.kafka, args.work_dir)
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("error: bench.report needs matplotlib (pip install -e '.[dev]')")

    from gateway.broker import select_broker
    from gateway.config import load_settings

    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        conf = {**load_settings(None).producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        kafka = json.dumps({"producer": conf, "client": {"bootstrap.servers": broker.bootstrap_servers}})

        def run(kind: str, docs: int, rate: float = 0.0) -> dict[str, Any]:
            proc = subprocess.run([sys.executable, "-m", "bench.report", "--run", kind, "--docs", str(docs),
                                   "--rate", str(rate), "--kafka", kafka, "--work-dir", td],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"error: the {kind} run failed: {proc.stderr.strip().splitlines()[-1:]}")
            return dict(json.loads(proc.stdout.strip().splitlines()[-1]))

        results: dict[str, Any] = {k: run(k, args.docs) for k in ("raw-bulk", "bulk-on", "bulk-off")}
        half = run("saturated", args.lag_docs)["rate"] / 2
        results["rate"] = half
        for k in ("raw-steady", "steady-off", "steady-on"):
            results[k] = run(k, args.lag_docs, half)
        for path in draw(results, Path(args.out), args.docs):
            print(json.dumps({"info": "chart", "path": str(path)}), flush=True)


if __name__ == "__main__":
    main()
