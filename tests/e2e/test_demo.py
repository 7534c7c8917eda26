"""`make demo` stays true: the walkthrough runs end to end on its own cluster and tells the story it promises."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_end_to_end():
    result = subprocess.run(
        [sys.executable, "-m", "ferry.demo", "--no-wait", "--size-mib", "16"],
        capture_output=True, text=True, timeout=400, env={**os.environ, "UCX_NET_DEVICES": "lo"},
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    tables = out.split("replica  ")[1:]
    assert len(tables) == 2, out[-2000:]
    first_round = tables[0].split("\n\n")[0]
    assert first_round.count(" s3 ") == 1 and first_round.count(" peer/") == 2, first_round
    assert "llama-tiny-v2" in tables[1] and "3/3" in out and "AllReplicasReady" in out
    assert out.rstrip().endswith("done")
