"""The one output format of every benchmark: one JSON line per figure, with its same-run baseline."""

from __future__ import annotations

import json


def figure(name: str, value: float, unit: str, baseline: float, target: float | None, better: str) -> None:
    """Print ``{"figure", "value", "unit", "baseline", "ratio", "target", "better"}`` (ratio = value / baseline;
    ``target`` is the figure an issue set, ``None`` -- printed ``null`` -- for an informational figure)."""
    ratio = value / baseline if baseline else 0.0
    print(json.dumps({"figure": name, "value": round(value, 1), "unit": unit, "baseline": round(baseline, 1),
                      "ratio": round(ratio, 3), "target": target, "better": better}), flush=True)
