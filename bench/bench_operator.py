"""Operator latency and scale: apply → WeightVersion Ready (p50/p99, all Ready) and operator RSS, for N versions
applied at once, in one namespace or spread over several.

Each row runs on a fresh stack (apiserver, SeaweedFS, operator), so its RSS and latencies are its own. References,
measured in the same run: apply → the same object's ADDED watch event (what the apiserver alone costs), and when the
apiserver had delivered every object. After each row a single new version is applied, one at a time, into the loaded
cluster: its apply → Ready beside its apply → watch event is the "single new version" ratio. Our figure includes S3
verification of every version (index GET, one header GET per shard) and the status patch. Each row also reports
the CPU seconds the operator and the apiserver + etcd spent during it.

The floor (`--floor`, on by default): the same N versions applied the same way into a fresh stack with no operator,
until the apiserver has delivered every one on the watch, with the apiserver + etcd's and this client's CPU
seconds. No operator can make all of them Ready sooner than that on the same machine.

The operator rows run with the chart's MutatingAdmissionPolicy that creates each version with the release finalizer,
as a chart install on Kubernetes 1.36 has it (`--no-admission-policy`: without it, the operator patches the
finalizer onto each version itself).

Rows: `--rows 1,100,1000,10000,10000x100` (`NxM`: N versions over M namespaces). Writes bench/results/operator.json
and operator.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from _common import write_results
from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines

from ferry import checkpoint_format as cf
from ferry.api.conditions import is_true
from ferry.api.models import API_VERSION, GROUP, VERSION, WeightVersionConditionType
from ferry_dev.localcluster import LocalCluster, binary, local_stack, start_operator, wait_until

CHART = Path(__file__).resolve().parents[1] / "charts" / "ferry"
BUCKET = "bench"
SINGLE_PROBES = 5  # single versions applied one at a time after each row
CREATE_THREADS = 8


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


class Watcher:
    """Records, per (namespace, name), the first time each WeightVersion is seen at all, and seen Ready=True."""

    def __init__(self, api: client.ApiClient) -> None:
        self.seen: dict[tuple[str, str], float] = {}
        self.ready: dict[tuple[str, str], float] = {}
        self._api = client.CustomObjectsApi(api)
        self._stop = False
        self._version: str | None = None  # where the watch resumes
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True

    def _run(self) -> None:
        # A watch ends (server timeout, a broken chunk); resume it where it stopped, so that the apiserver does not
        # send every object again each minute (at 10,000 versions that alone would load it). Only a watch the
        # apiserver can no longer resume (410 Gone) starts over, and `setdefault` keeps the first time each state
        # was seen.
        while not self._stop:
            try:
                self._consume()
            except Exception:  # a dropped connection: resume
                time.sleep(0.1)

    def _consume(self) -> None:
        resume = {"resource_version": self._version} if self._version else {}
        response = self._api.list_cluster_custom_object(
            GROUP,
            VERSION,
            "weightversions",
            watch=True,
            allow_watch_bookmarks=True,
            timeout_seconds=60,
            _preload_content=False,  # plain JSON lines: the client's models would cost this process more CPU
            **resume,
        )
        try:
            for line in iter_resp_lines(response):
                if not line.strip():
                    continue
                now = time.monotonic()
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    if obj.get("code") == 410:
                        self._version = None  # too old to resume: the next watch starts with every object
                    return
                self._version = obj["metadata"]["resourceVersion"]
                if event["type"] == "BOOKMARK":
                    continue
                key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                self.seen.setdefault(key, now)
                conditions = (obj.get("status") or {}).get("conditions") or []
                if is_true(conditions, WeightVersionConditionType.READY):
                    self.ready.setdefault(key, now)
                if self._stop:
                    return
        finally:
            response.close()
            response.release_conn()


def body(name: str, uri: str) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "WeightVersion",
        "metadata": {"name": name},
        "spec": {"modelName": "bench", "format": "FullCheckpoint", "storage": {"uri": uri}},
    }


def prepare_burst(
    api: client.ApiClient, n: int, spread: int, prefix: str
) -> tuple[client.CustomObjectsApi, Watcher, list[str], list[tuple[str, str]]]:
    """The row's namespaces, a running watcher and the (namespace, name) of each of the N versions to apply."""
    core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
    namespaces = [f"{prefix}-{i}" for i in range(spread)]
    for ns in namespaces:
        core.create_namespace({"metadata": {"name": ns}})
    watcher = Watcher(api)
    time.sleep(1.0)
    return objects, watcher, namespaces, [(namespaces[i % spread], f"v{i}") for i in range(n)]


def server_pids(cluster: LocalCluster) -> list[int]:
    return [p.proc.pid for p in cluster.processes if p.name in ("etcd", "kube-apiserver") and p.proc]


def run_row(api: client.ApiClient, n: int, spread: int, uri: str, timeout: float) -> dict:
    objects, watcher, namespaces, keys = prepare_burst(api, n, spread, "bench")
    created: dict[tuple[str, str], float] = {}

    def create(key: tuple[str, str]) -> None:
        created[key] = time.monotonic()
        objects.create_namespaced_custom_object(GROUP, VERSION, key[0], "weightversions", body(key[1], uri))

    # "At once": several clients in parallel, as a fleet of trainers would publish.
    with ThreadPoolExecutor(CREATE_THREADS) as pool:
        list(pool.map(create, keys))
    applied_s = max(created.values()) - min(created.values())
    wait_until(lambda: all(k in watcher.ready for k in keys), timeout, f"{n} WeightVersions Ready")
    ours = [watcher.ready[k] - created[k] for k in keys]
    raw = [watcher.seen[k] - created[k] for k in keys]
    start = min(created.values())

    # One new version at a time into the loaded cluster.
    single, single_raw = [], []
    for i in range(SINGLE_PROBES):
        key = (namespaces[0], f"single-{i}")
        create(key)
        wait_until(lambda key=key: key in watcher.ready, 60, f"single version {key} Ready")
        single.append(watcher.ready[key] - created[key])
        single_raw.append(watcher.seen[key] - created[key])
    watcher.stop()
    return {
        "count": n,
        "namespaces": spread,
        "applied_in_s": round(applied_s, 2),
        "ready_p50_s": round(percentile(ours, 0.5), 4),
        "ready_p99_s": round(percentile(ours, 0.99), 4),
        "ready_all_s": round(max(watcher.ready[k] for k in keys) - start, 2),
        "apiserver_watch_p50_s": round(percentile(raw, 0.5), 4),
        "apiserver_watch_p99_s": round(percentile(raw, 0.99), 4),
        "apiserver_all_s": round(max(watcher.seen[k] for k in keys) - start, 2),
        "mean_ready_s": round(statistics.fmean(ours), 4),
        "single_ready_s": round(statistics.median(single), 4),
        "single_watch_s": round(statistics.median(single_raw), 4),
    }


def measure_floor(n: int, spread: int) -> dict:
    """The apiserver alone: N creates with no operator running, until the watch has delivered every one."""
    with local_stack() as (cluster, _s3):
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        api.configuration.connection_pool_maxsize = CREATE_THREADS
        objects, watcher, _, keys = prepare_burst(api, n, spread, "floor")
        servers = server_pids(cluster)
        server_cpu, client_cpu = sum(cpu_seconds(pid) for pid in servers), time.process_time()
        start = time.monotonic()
        uri = f"s3://{BUCKET}/m/{cf.INDEX_NAME}"
        with ThreadPoolExecutor(CREATE_THREADS) as pool:
            list(
                pool.map(
                    lambda k: objects.create_namespaced_custom_object(
                        GROUP, VERSION, k[0], "weightversions", body(k[1], uri)
                    ),
                    keys,
                )
            )
        applied = time.monotonic() - start
        wait_until(lambda: all(k in watcher.seen for k in keys), 120 + 0.1 * n, f"{n} WeightVersions seen")
        watcher.stop()
        return {
            "count": n,
            "namespaces": spread,
            "applied_in_s": round(applied, 2),
            "all_seen_s": round(max(watcher.seen[k] for k in keys) - start, 2),
            "apiserver_etcd_cpu_s": round(sum(cpu_seconds(pid) for pid in servers) - server_cpu, 2),
            "client_cpu_s": round(time.process_time() - client_cpu, 2),
        }


def parse_rows(text: str) -> list[tuple[int, int]]:
    rows = []
    for item in text.split(","):
        count, _, spread = item.partition("x")
        rows.append((int(count), int(spread or 1)))
    return rows


def install_finalizer_policy(cluster: LocalCluster) -> None:
    """The chart's MutatingAdmissionPolicy that creates each WeightVersion with the release finalizer (as a chart
    install on Kubernetes 1.36 has it), rendered by helm; returns once the apiserver applies it."""
    rendered = subprocess.run(
        [
            *(binary("helm"), "template", "bench", str(CHART), "--kube-version", "1.36.3"),
            *("--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"),
            *("-s", "templates/operator-finalizer-policy.yaml"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cluster.kubectl("apply", "-f", "-", input=rendered)
    probe = json.dumps(
        {**body("probe", f"s3://{BUCKET}/m/{cf.INDEX_NAME}"), "metadata": {"name": "probe", "namespace": "default"}}
    )

    def applied() -> bool:
        out = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=probe).stdout
        return bool(json.loads(out)["metadata"].get("finalizers"))

    wait_until(applied, 30, "the release finalizer policy")


def measure(n: int, spread: int, policy: bool) -> dict:
    with local_stack() as (cluster, s3):
        if policy:
            install_finalizer_policy(cluster)
        s3.create_bucket(BUCKET)
        weights = {f"w{i}": np.ones((256, 256), np.float32) for i in range(8)}
        for name, data in cf.build_full_checkpoint(weights, shard_bytes=1 << 20).items():
            s3.client().put_object(Bucket=BUCKET, Key=f"m/{name}", Body=data)
        uri = f"s3://{BUCKET}/m/{cf.INDEX_NAME}"
        operator = start_operator(cluster, cluster.workdir, env=s3.env())
        wait_until(lambda: "metrics on" in operator.log_tail(200), 30, "operator", operator)
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        api.configuration.connection_pool_maxsize = CREATE_THREADS
        # CPU seconds spent during the row: steadier than wall time on shared cores, and the apiserver's own share
        # (etcd included) shows what each version's requests cost there.
        servers = server_pids(cluster)
        cpu_before = cpu_seconds(operator.proc.pid), sum(cpu_seconds(pid) for pid in servers)
        row = run_row(api, n, spread, uri, timeout=180 + 0.2 * n)
        row["operator_cpu_s"] = round(cpu_seconds(operator.proc.pid) - cpu_before[0], 2)
        row["apiserver_etcd_cpu_s"] = round(sum(cpu_seconds(pid) for pid in servers) - cpu_before[1], 2)
        row["operator_rss_mib"] = proc_mib(operator.proc.pid, "VmRSS")
        row["operator_peak_rss_mib"] = proc_mib(operator.proc.pid, "VmHWM")
        log = (cluster.workdir / "operator.log").read_text(errors="replace")
        row["operator_log_lines"] = log.count("\n")
        operator.stop()
    return row


def duration(seconds: float) -> str:
    if seconds < 0.1:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def table(rows: list[dict]) -> str:
    lines = [
        "| versions | namespaces | apply→Ready p50 | p99 | all Ready | apiserver: watch p50 / all seen (reference) "
        "| single new version: Ready / watch event | ratio | operator RSS | CPU s: operator / apiserver+etcd |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["single_ready_s"] / max(r["single_watch_s"], 1e-6)
        lines.append(
            f"| {r['count']} | {r['namespaces']} | {duration(r['ready_p50_s'])} | {duration(r['ready_p99_s'])} "
            f"| {r['ready_all_s']:.1f} s | {duration(r['apiserver_watch_p50_s'])} / {r['apiserver_all_s']:.1f} s "
            f"| {duration(r['single_ready_s'])} / {duration(r['single_watch_s'])} | {ratio:.1f}x "
            f"| {r['operator_rss_mib']:.0f} MiB | {r['operator_cpu_s']:.1f} / {r['apiserver_etcd_cpu_s']:.1f} |"
        )
    return "\n".join(lines)


def floor_table(rows: list[dict], floors: list[dict]) -> str:
    lines = [
        "| versions | namespaces | apiserver alone: applied / all seen | its CPU s: apiserver+etcd / client "
        "| ours: all Ready | ours / floor |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for f in floors:
        ours = next((r for r in rows if (r["count"], r["namespaces"]) == (f["count"], f["namespaces"])), None)
        ready = f"{ours['ready_all_s']:.1f} s" if ours else "-"
        ratio = f"{ours['ready_all_s'] / max(f['all_seen_s'], 1e-3):.1f}x" if ours else "-"
        lines.append(
            f"| {f['count']} | {f['namespaces']} | {f['applied_in_s']:.1f} s / {f['all_seen_s']:.1f} s "
            f"| {f['apiserver_etcd_cpu_s']:.1f} / {f['client_cpu_s']:.1f} | {ready} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,100,1000", help="comma-separated N or NxM (N versions over M namespaces)")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="skip the apiserver-alone rows")
    parser.add_argument(
        "--no-admission-policy",
        dest="policy",
        action="store_false",
        help="without the chart's release finalizer policy: the operator patches the finalizer onto each version",
    )
    args = parser.parse_args()
    rows, floors = [], []
    for n, spread in parse_rows(args.rows):
        row = measure(n, spread, args.policy)
        row["admission_policy"] = args.policy
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.floor:
            floors.append(measure_floor(n, spread))
            print(json.dumps({"floor": floors[-1]}), flush=True)

    report = table(rows) + ("\n\nThe floor (no operator):\n\n" + floor_table(rows, floors) if floors else "")
    write_results("operator", {"rows": rows, "floor": floors}, report)


if __name__ == "__main__":
    main()
