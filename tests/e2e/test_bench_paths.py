"""The benchmarks' own load paths, at toy sizes: a benchmark is not a test (no timing is asserted here), but the
bytes every benchmark path loads are checked (each script exits non-zero on a sha256 mismatch), and a path that
stopped working (an authenticated reader refused, say) fails here rather than on the next `make bench`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout: float = 240) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def test_p2p_bench_loads_verified_bytes_as_an_authenticated_reader(tmp_path: Path) -> None:
    # its own apiserver: a Node-bound worker token, TokenReview and the assignment check on every read
    run_bench("bench_p2p.py", "--sizes", "8M", "--reps", "1", "--tensor-mib", "2", "--out", str(tmp_path))
    report = json.loads((tmp_path / "p2p.json").read_text())
    assert report["authenticated"] is True
    (row,) = report["results"]
    assert row["bytes"] >= 8 << 20 and row["verified_sha256"] is True


def test_s3_bench_loads_verified_bytes_on_every_row(tmp_path: Path) -> None:
    # full loads (1 and 2 ranks), from the store, delta replay: each row's tensors against the source's sha256
    toy = ["--size", "8M", "--shards", "2", "--tensor-mib", "1", "--reps", "1"]
    run_bench("bench_s3.py", *toy, "--out", str(tmp_path))
    report = json.loads((tmp_path / "s3.json").read_text())
    assert report["bytes"] == 8 << 20 and report["verified_sha256"] is True
    assert report["results"], "no rows were measured"
