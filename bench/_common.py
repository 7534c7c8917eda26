"""Shared by the benchmark scripts: rate summaries and the JSON + markdown result files."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from collections.abc import Iterator, Sequence
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


def add_shmem_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shmem-huge-pages",
        default="as-is",
        choices=["as-is", "advise", "never"],
        help="the host's shmem huge-page mode for the run (a node setting; needs root), put back afterwards; "
        "advise gives the agent's shared-memory chunks 2 MiB pages",
    )


@contextlib.contextmanager
def shmem_huge_pages(wanted: str) -> Iterator[str | None]:
    """The host's shmem huge-page mode set to `wanted` (`as-is`: left alone) for a run, then put back; yields the
    mode in force, which each report records."""
    from ferry_agent.attach.memstore import SHMEM_HUGE_PAGES  # imports torch: only for the benches that use it
    from ferry_agent.attach.memstore import shmem_huge_pages as shmem_mode

    mode, _ = shmem_mode()
    if wanted == "as-is" or wanted == mode:
        yield mode
        return
    if mode is None or not os.access(SHMEM_HUGE_PAGES, os.W_OK):
        raise SystemExit(f"--shmem-huge-pages {wanted} needs root and a writable {SHMEM_HUGE_PAGES}")
    SHMEM_HUGE_PAGES.write_text(wanted)
    try:
        yield wanted
    finally:
        SHMEM_HUGE_PAGES.write_text(mode)
