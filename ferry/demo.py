"""`make demo`: the whole control plane on one machine.

Starts etcd + kube-apiserver + kube-controller-manager + SeaweedFS S3 + the operator (`kopf run`), publishes a small
full checkpoint and two XOR deltas to S3, applies the sample WeightVersions, and shows them resolve and go Ready.
Then it deletes the base to show that release waits for its dependents. Ctrl-C tears everything down.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ferry import checkpoint_format as cf
from ferry.localcluster import REPO_ROOT, LocalCluster, local_stack, start_operator

SAMPLES = REPO_ROOT / "crds" / "samples"
BUCKET = "ferry-models"
VERSIONS = ["llama-tiny-v1", "llama-tiny-v2", "llama-tiny-v3"]


def say(text: str) -> None:
    print(f"\n\033[1m==> {text}\033[0m", flush=True)


def show(cluster: LocalCluster, *args: str) -> None:
    print(f"$ kubectl {' '.join(args)}")
    print(cluster.kubectl(*args, check=False).stdout.rstrip(), flush=True)


def publish(s3, rng: np.random.Generator) -> None:
    """Full checkpoint v1, then v2 and v3 as XOR deltas that each change one layer."""
    weights = {f"model.layers.{i}.mlp.weight": rng.standard_normal((256, 256)).astype(np.float32) for i in range(8)}
    s3.create_bucket(BUCKET)
    client = s3.client()
    for i, version in enumerate(VERSIONS):
        if i == 0:
            files = cf.build_full_checkpoint(weights, shard_bytes=1 << 20)
        else:
            new = dict(weights)
            layer = f"model.layers.{i}.mlp.weight"
            new[layer] = weights[layer] + np.float32(0.01)
            files = cf.build_xor_delta(weights, new, version=version, base_version=VERSIONS[i - 1])
            weights = new
        for name, data in files.items():
            client.put_object(Bucket=BUCKET, Key=f"llama-tiny/{version[len('llama-tiny-') :]}/{name}", Body=data)
        print(f"  s3://{BUCKET}/llama-tiny/{version[len('llama-tiny-') :]}/  {len(files)} objects", flush=True)


def wait_for_interrupt() -> None:
    stop = False

    def handler(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not stop:
        time.sleep(0.5)


def run(wait: bool, workdir: Path | None) -> int:
    say("Starting etcd, kube-apiserver, kube-controller-manager and SeaweedFS S3 on 127.0.0.1")
    with local_stack(workdir) as (cluster, s3):
        print(f"  apiserver {cluster.server}   S3 {s3.endpoint}")
        print(f"  export KUBECONFIG={cluster.kubeconfig}")
        show(cluster, "api-resources", "--categories=ferry")

        say("Starting the operator (kopf run)")
        operator = start_operator(cluster, cluster.workdir, env={**s3.env(), "FERRY_RESYNC_SECONDS": "5"})
        print(f"  log: {operator.log_path}")

        say("Publishing a full checkpoint and two XOR/zstd deltas to S3")
        publish(s3, np.random.default_rng(7))

        say("Applying the sample WeightVersions (crds/samples/01-weightversions.yaml)")
        started = time.monotonic()
        show(cluster, "apply", "-f", str(SAMPLES / "01-weightversions.yaml"))
        cluster.kubectl("wait", "--for=condition=Ready", *(f"wv/{v}" for v in VERSIONS), "--timeout=90s")
        print(f"  all Ready in {time.monotonic() - started:.1f}s")
        show(cluster, "get", "wv", "-o", "wide")
        show(cluster, "get", "wv", VERSIONS[-1], "-o", "jsonpath={.status.chain}{'\\n'}")

        say("Deleting the full checkpoint while deltas still need it: the release waits")
        cluster.kubectl("delete", "wv", VERSIONS[0], "--wait=false")
        time.sleep(3)
        show(cluster, "get", "wv")
        show(
            cluster, "get", "wv", VERSIONS[0], "-o", 'jsonpath={.status.conditions[?(@.type=="Ready")].message}{"\\n"}'
        )

        say("Deleting the deltas releases the base too")
        cluster.kubectl("delete", "wv", *VERSIONS[1:])
        cluster.kubectl("wait", "--for=delete", f"wv/{VERSIONS[0]}", "--timeout=30s")
        show(cluster, "get", "wv")
        show(cluster, "get", "events", "--sort-by=.lastTimestamp")

        if wait:
            say("The cluster stays up for kubectl (see KUBECONFIG above). Ctrl-C to tear down.")
            wait_for_interrupt()
        operator.stop()
        say("Tearing down")
    print("done")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry-demo", description=__doc__)
    parser.add_argument("--no-wait", action="store_true", help="tear down right after the walkthrough")
    parser.add_argument("--workdir", type=Path, help="keep state here instead of a temporary directory")
    args = parser.parse_args(argv)
    try:
        return run(wait=not args.no_wait and sys.stdin.isatty(), workdir=args.workdir)
    except subprocess.CalledProcessError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
