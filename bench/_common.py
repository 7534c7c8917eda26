"""Shared by the benchmark scripts: rate summaries and the JSON + markdown result files."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def summary(nbytes: int, seconds: Sequence[float]) -> dict[str, Any]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {
        "seconds": [round(s, 5) for s in seconds],
        "gbps_median": round(statistics.median(rates), 3),
        "gbps_best": round(max(rates), 3),
    }


def write_results(name: str, data: Any, table: str, out: Path = RESULTS) -> None:
    """`<out>/<name>.json` and `<out>/<name>.md`; the table is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{name}.md").write_text(table.rstrip() + "\n")
    print(table)
