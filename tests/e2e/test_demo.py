"""`make demo` stays true: the walkthrough runs end to end on its own cluster and tells the story it promises."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_end_to_end():
    result = subprocess.run(
        [sys.executable, "-m", "ferry_dev.demo", "--no-wait", "--size-mib", "16"],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    tables = [t.split("\n\n")[0] for t in out.split("replica  ")[1:]]
    assert len(tables) == 4, out[-2000:]  # v1, v2, the tensor-parallel load and its ranks
    first_round = tables[0]
    assert first_round.count(" s3 ") == 1 and first_round.count(" peer/") == 2, first_round
    assert "llama-tiny-v2" in tables[1] and "3/3" in out and "AllReplicasReady" in out
    # As narrated: each replica applies the small delta from S3 to its own v1.
    assert tables[1].count(" s3 ") == 3, tables[1]
    # The engine attaches to v1, then refits to v2 with only the changed tensors, and generates what the trainer's
    # own copy of each version generates; the ModelLoad shows it attached.
    engine = [line for line in out.splitlines() if line.startswith("  engine: ")]
    assert len(engine) == 2 and "loaded llama-tiny-v1: copied 48 of 48" in engine[0], engine
    assert "refit llama-tiny-v2: copied 12 of 48" in engine[1], engine
    assert out.count("generates") == 4 and out.count(": the same") == 2 and "DIFFERENT" not in out
    assert "True Attached: 1 pod attached to llama-tiny-v1" in out
    assert tables[2].count(" s3 ") == 1 and tables[2].count(" peer/llama-tiny-tp2-") == 1, tables[2]
    rank_rows = [line.split() for line in tables[3].splitlines()[1:]]
    by_replica: dict[str, list[str]] = {}
    for row in rank_rows:
        assert row[0].startswith("llama-tiny-tp2-") and int(row[2]) > 0, tables[3]
        by_replica.setdefault(row[0], []).append(row[1])
    assert len(by_replica) == 2 and all(sorted(ranks) == ["0", "1"] for ranks in by_replica.values()), tables[3]
    assert "ReplicaStale" not in out  # a rollout is not mistaken for a dead agent
    assert out.rstrip().endswith("done")
    # Every command it prints is one a shell takes as it is: no elided arguments.
    commands = [line[2:] for line in out.splitlines() if line.startswith("$ ")]
    assert commands and all("..." not in c and shlex.split(c)[0] in ("kubectl", "ferry") for c in commands), commands
