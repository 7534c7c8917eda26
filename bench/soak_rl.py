"""The long RL soak (`ferry_dev.soak`; tests/e2e/test_soak.py runs it bounded): steps published back to back from
the publish API, the ModelLoad's desiredVersion moved to each at once, retention on with deleteStorage, agents as
processes over S3, and an engine process that follows every step with watch + attach + load_into(only_changed=True).

Reports steps per second, publish → engine p50/p99, backward holds and backward replica moves (both must be 0),
wrong bytes (must be 0), the S3 versions left against those retention must keep, and each agent's RSS growth per
step. The reference, measured in the same run, is the publish API's own upload time per step: how much of the
publish → engine latency is the rollout's.

Not in `make bench` (bench_*.py only): `python bench/soak_rl.py --steps 200`. Writes bench/results/soak_rl.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _common import write_results

import ferry_dev.soak as soak
from ferry_dev.localcluster import local_stack, start_operator


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--keyframe-every", type=int, default=10)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--rollout", choices=["Parallel", "Rolling"], default="Parallel")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--size", type=int, default=256, help="each tensor is SIZE x SIZE float32")
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between one publish and the next")
    args = parser.parse_args()
    cfg = soak.SoakConfig(
        steps=args.steps,
        agents=args.agents,
        keyframe_every=args.keyframe_every,
        keep_last=args.keep_last,
        rollout=args.rollout,
        tensors=args.tensors,
        shape=(args.size, args.size),
        interval_s=args.interval,
        settle_timeout_s=300.0,
    )
    upload_s: list[float] = []
    publish = soak.publish

    def timed_publish(opts):  # the reference: the publish API's upload alone, per step
        t0 = time.perf_counter()
        try:
            return publish(opts)
        finally:
            upload_s.append(time.perf_counter() - t0)

    soak.publish = timed_publish
    with tempfile.TemporaryDirectory(prefix="ferry-soak-") as tmp:
        root = Path(tmp)
        with local_stack(root / "stack") as (cluster, s3):
            operator = start_operator(cluster, root / "operator", env=s3.env())
            namespace = f"soak-{uuid.uuid4().hex[:6]}"
            cluster.kubectl("create", "namespace", namespace)
            try:
                report = soak.run_soak(cluster, s3, root / "run", namespace, cfg, Path(tempfile.mkdtemp(dir="/tmp")))
            finally:
                operator.stop()
    summary = report.summary()
    summary["publish_upload_p50_s"] = round(statistics.median(upload_s), 3)
    p50 = summary["publish_to_engine_p50_s"]
    summary["engine_p50_vs_upload_p50"] = round(p50 / summary["publish_upload_p50_s"], 2) if p50 else None
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    table = (
        f"## RL soak ({cfg.steps} steps, {cfg.agents} agents, {cfg.rollout})\n\n| metric | value |\n|---|---|\n{rows}\n"
    )
    write_results("soak_rl", {"config": vars(args), "summary": summary}, table)
    ok = not (report.wrong_bytes or report.backward_holds or report.backward_moves)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
