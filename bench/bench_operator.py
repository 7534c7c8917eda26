"""Operator latency: apply → Ready for 1, 100 and 1000 WeightVersions (p50/p99), and operator RSS at 1000.

Reference, measured in the same run: apply → the same object's ADDED watch event, i.e. what the apiserver alone
costs. Our figure includes S3 verification of every version (index GET, shard HEAD + header GET) and the status patch.
Writes bench/results/operator.json and operator.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
from _common import write_results
from kubernetes import client, config, watch

from ferry import checkpoint_format as cf
from ferry.api.models import API_VERSION, GROUP, VERSION
from ferry.localcluster import local_stack, start_operator, wait_until

BUCKET = "bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Watcher:
    """Records the first time each object is seen at all, and seen Ready=True."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.seen: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self._api = client.CustomObjectsApi(api)
        self._namespace = namespace
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # A watch can drop (server timeout, a broken chunk); re-establish it until stopped. The re-list replays
        # current objects, and `setdefault` keeps the first time each state was seen.
        while not self._stop:
            with contextlib.suppress(Exception):
                self._consume(watch.Watch())

    def _consume(self, w: watch.Watch) -> None:
        for event in w.stream(
            self._api.list_namespaced_custom_object, GROUP, VERSION, self._namespace, "weightversions",
            timeout_seconds=60,
        ):  # fmt: skip
            now = time.monotonic()
            obj = event["object"]
            name = obj["metadata"]["name"]
            self.seen.setdefault(name, now)
            conditions = (obj.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                self.ready.setdefault(name, now)
            if self._stop:
                w.stop()


def run_batch(api: client.ApiClient, namespace: str, n: int, uri: str, timeout: float) -> dict:
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": namespace}})
    watcher = Watcher(api, namespace)
    time.sleep(0.5)
    objects = client.CustomObjectsApi(api)
    created: dict[str, float] = {}
    for i in range(n):
        name = f"v{i}"
        body = {
            "apiVersion": API_VERSION,
            "kind": "WeightVersion",
            "metadata": {"name": name},
            "spec": {"modelName": "bench", "format": "FullCheckpoint", "storage": {"uri": uri}},
        }
        created[name] = time.monotonic()
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightversions", body)
    wait_until(lambda: len(watcher.ready) == n, timeout, f"{n} WeightVersions Ready")
    watcher._stop = True
    ours = [watcher.ready[k] - created[k] for k in created]
    raw = [watcher.seen[k] - created[k] for k in created]
    return {
        "count": n,
        "ready_p50_s": percentile(ours, 0.5),
        "ready_p99_s": percentile(ours, 0.99),
        "ready_all_s": max(watcher.ready.values()) - min(created.values()),
        "apiserver_watch_p50_s": percentile(raw, 0.5),
        "apiserver_watch_p99_s": percentile(raw, 0.99),
        "mean_ready_s": statistics.fmean(ours),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1,100,1000")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with local_stack() as (cluster, s3):
        s3.create_bucket(BUCKET)
        weights = {f"w{i}": np.ones((256, 256), np.float32) for i in range(8)}
        for name, data in cf.build_full_checkpoint(weights, shard_bytes=1 << 20).items():
            s3.client().put_object(Bucket=BUCKET, Key=f"m/{name}", Body=data)
        uri = f"s3://{BUCKET}/m/{cf.INDEX_NAME}"
        operator = start_operator(cluster, cluster.workdir, env={**s3.env(), "FERRY_RESYNC_SECONDS": "60"})
        wait_until(lambda: "metrics on" in operator.log_tail(200), 30, "operator", operator)
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        for n in sizes:
            row = run_batch(api, f"bench-{n}", n, uri, timeout=120 + n)
            row["operator_rss_mib"] = round(rss_mib(operator.proc.pid), 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
        operator.stop()

    lines = [
        "| versions | apply→Ready p50 | p99 | apiserver watch p50 (reference) | ratio p50 "
        "| all Ready after | operator RSS |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["ready_p50_s"] / max(r["apiserver_watch_p50_s"], 1e-6)
        lines.append(
            f"| {r['count']} | {r['ready_p50_s'] * 1000:.0f} ms | {r['ready_p99_s'] * 1000:.0f} ms | "
            f"{r['apiserver_watch_p50_s'] * 1000:.1f} ms | {ratio:.0f}x | {r['ready_all_s']:.1f} s | "
            f"{r['operator_rss_mib']} MiB |"
        )
    write_results("operator", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
