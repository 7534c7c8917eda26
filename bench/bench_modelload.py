"""ModelLoad benchmarks with agents as processes: apply → Ready, and publish → serving for each rollout mode.

Apply → Ready, for 1, 3, 8 and 16 replicas of 1 rank and 1 and 3 replicas of 2 ranks (`ranksPerReplica: 2`),
peers-first against S3-only: the reference is the same load with `sourceOrder: [ObjectStorage]`, measured in the same
run on the same agents (fresh checkpoint stores each round). Reports wall time to Ready, how many replicas read S3 vs
a peer, the bytes fetched from S3 (the fan-out saving), each row's ratio to the 1-replica row of the same ranks and
order, and per replica when its load started and finished (what bench/sim_fanout.py calibrates against). The 2-rank
rows' agents start with `--warm-ranks 2`: their rank processes start with the agent, before the apply, as the agent
itself does (`--warm-ranks 0`: the first load starts them).

Publish → serving, for 1, 3 and 8 replicas serving a version, per `spec.rollout` mode (Parallel; Rolling with the
default maxUnavailable 25%): from the end of `ferry publish` of an XorDelta (10% of the tensors changed; the
WeightVersion is created, not yet verified) and the ModelLoad's desiredVersion patched to it, to every replica
serving it. Split into the operator's verification (→ WeightVersion Ready) and the rollout (→ all serving). The
ratio 8 replicas vs 1 is the rollout's scaling (goal: at most 2x). The rollout is observed with watches (a poll
would load the apiserver it measures), and each round prints every process's CPU seconds over it (`cpu_seconds`:
where the time went on a VM that the agents, the control plane and S3 share).

Writes bench/results/modelload.json and modelload.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
from _common import add_shmem_argument, shmem_huge_pages, write_results
from safetensors.torch import load_file, save_file

from ferry.api.models import API_VERSION, GROUP, VERSION, ReplicaPhase, WeightVersionPhase
from ferry_dev.localcluster import LocalCluster, ManagedProcess, local_stack, start_operator, wait_until

MODEL = "bench"


def modelload_body(n: int, tag: str, **spec: object) -> dict:
    """ModelLoad `m` of MODEL at v1 on the `n` CPU nodes labelled `bench=<tag>`; `spec` adds fields."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelLoad",
        "metadata": {"name": "m"},
        "spec": {
            "modelName": MODEL,
            "desiredVersion": "v1",
            "replicas": n,
            "device": "cpu",
            "nodeSelector": {"bench": tag},
            **spec,
        },
    }


def publish(cluster: LocalCluster, s3, root: Path, size_mib: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn((1024, 1024), generator=gen) for i in range(size_mib // 4)}
    src = root / "weights-v1"
    src.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(src / "model.safetensors"))
    s3.create_bucket("bench")
    import subprocess

    subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry.cli",
            "publish",
            str(src),
            "--version",
            "v1",
            "--model",
            MODEL,
            "--uri-prefix",
            "s3://bench/m",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--wait",
            "-q",
        ],
        check=True,
        env={**os.environ, **s3.env()},
    )


def start_agents(
    cluster: LocalCluster, s3, root: Path, n: int, tag: str, socket_dir: str = "", warm_ranks: int = 0
) -> list[ManagedProcess]:
    """`socket_dir` empty: no attach (its sealing is measured by bench_attach). `warm_ranks`: rank processes each
    agent starts with and keeps for multi-rank loads (waited for, as the agents themselves are)."""
    agents = []
    for i in range(n):
        node = f"{tag}-{i}"
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"bench": tag}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
        store = root / "stores" / node
        shutil.rmtree(store, ignore_errors=True)
        argv = [
            sys.executable,
            "-m",
            "ferry_agent",
            "--node",
            node,
            "--checkpoint-dir",
            str(store),
            "--poll-seconds",
            "0.2",
            "--retry-seconds",
            "1",
            "--socket-dir",
            socket_dir,
            *cluster.agent_identity_args(node),
            "--warm-ranks",
            str(warm_ranks),
        ]
        env = {**os.environ, **cluster.env(), **s3.env(), "UCX_NET_DEVICES": "lo"}
        agents.append(ManagedProcess(node, argv, root / "logs" / f"{node}.log", env=env).start())

    # Every agent up (torch and NIXL imported, its loop running) before the clock starts: 8 agents importing torch
    # on 2 cores take longer than a fixed pause, and a late one's start-up ran beside the others' loads.
    def ready() -> bool:
        logs = [a.log_path.read_text(errors="replace") for a in agents]
        return all("serving node" in log and log.count(") ready") >= warm_ranks for log in logs)

    wait_until(ready, 120, f"every agent running, {warm_ranks} warm rank processes each")
    return agents


def apply_v1(cluster: LocalCluster, namespace: str) -> None:
    """The v1 published into `default`, applied into the round's own namespace, and Ready there."""
    wv = json.loads(cluster.kubectl("get", "wv", "v1", "-n", "default", "-o", "json").stdout)
    body = {"apiVersion": API_VERSION, "kind": "WeightVersion", "metadata": {"name": "v1"}, "spec": wv["spec"]}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    cluster.kubectl("wait", "--for=condition=Ready", "wv/v1", "-n", namespace, "--timeout=60s")


def one_round(
    cluster: LocalCluster, s3, root: Path, n: int, order: list[str], ranks: int = 1, warm_ranks: int = 0
) -> dict:
    tag = f"r{n}x{ranks}-{'p' if 'Peer' in order else 's'}"
    namespace = tag
    cluster.kubectl("create", "namespace", namespace)
    agents = start_agents(cluster, s3, root, n, tag, warm_ranks=warm_ranks if ranks > 1 else 0)
    try:
        apply_v1(cluster, namespace)
        ml = modelload_body(n, tag, sourceOrder=order, ranksPerReplica=ranks)
        started, started_wall = time.monotonic(), time.time()
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(ml))

        def ready() -> bool:
            status = json.loads(cluster.kubectl("get", "ml", "m", "-n", namespace, "-o", "json").stdout).get("status")
            return bool(status) and status.get("readyReplicas") == n

        wait_until(ready, 600, f"{n} replicas Ready")
        seconds = time.monotonic() - started
        items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
        sources = [r["status"]["source"] for r in items]
        return {
            "replicas": n,
            "ranks": ranks,
            "source_order": "+".join(order),
            "seconds_to_ready": round(seconds, 2),
            "from_s3": sum(s == "s3" for s in sources),
            "from_peer": sum(s.startswith("peer/") for s in sources),
            "s3_bytes": sum(r["status"]["bytesDone"] for r in items if r["status"]["source"] == "s3"),
            # Per replica, seconds from the apply: its load's start and end, its source and bytes.
            "loads": sorted((load_times(r["status"], started_wall) for r in items), key=lambda x: x["started_s"]),
        }
    finally:
        for a in agents:
            a.stop()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def load_times(status: dict, since_wall: float) -> dict:
    return {
        "started_s": round(wall(status["startedTime"]) - since_wall, 3),
        "completed_s": round(wall(status["completedTime"]) - since_wall, 3),
        "source": status["source"],
        "bytes": status["bytesDone"],
    }


ROLLOUTS = {"Parallel": {"strategy": "Parallel"}, "Rolling": {"strategy": "Rolling"}}


def publish_delta(cluster: LocalCluster, s3, root: Path, namespace: str, base: str, version: str) -> None:
    """`ferry publish` of `version` as an XorDelta over `base` (whose weights are `root/weights-<base>`): every
    tenth tensor changed. Returns at the end of the command, the WeightVersion created but not verified yet."""
    import subprocess

    weights = load_file(str(root / f"weights-{base}" / "model.safetensors"))
    for i, name in enumerate(sorted(weights)):
        if i % 10 == 0:
            weights[name] = weights[name] + 1.0
    src = root / f"weights-{version}"
    src.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(src / "model.safetensors"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry.cli",
            "publish",
            str(src),
            "--version",
            version,
            "--base",
            base,
            "--base-dir",
            str(root / f"weights-{base}"),
            "--model",
            MODEL,
            "--uri-prefix",
            f"s3://bench/{namespace}",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "-n",
            namespace,
            "-q",
        ],
        check=True,
        env={**os.environ, **s3.env()},
    )


def rollout_rounds(cluster: LocalCluster, s3, root: Path, n: int, socket_dir: str) -> list[dict]:
    """One ModelLoad of `n` replicas on v1, then per rollout mode a delta published and rolled out."""
    from kubernetes import client, config

    namespace = tag = f"roll{n}"
    cluster.kubectl("create", "namespace", namespace)
    agents = start_agents(cluster, s3, root, n, tag, socket_dir)
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    objects = client.CustomObjectsApi(api)
    rows = []
    try:
        apply_v1(cluster, namespace)
        ml = modelload_body(n, tag)
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(ml))
        wait_until(lambda: serving(objects, namespace, "v1") == n, 600, f"{n} replicas on v1")
        base = "v1"
        for step, (mode, rollout) in enumerate(ROLLOUTS.items(), start=2):
            version = f"v{step}"
            patch = {"spec": {"rollout": rollout}}
            objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, "modelloads", "m", patch)
            publish_delta(cluster, s3, root, namespace, base, version)
            published, published_wall = time.monotonic(), time.time()  # the end of `ferry publish`
            cpu_before = cpu_seconds()
            ready_s, first_s, all_s, writes = observe(objects, namespace, version, n, published)
            cpu = cpu_spent(cpu_before, cpu_seconds())
            items = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "weightreplicas")["items"]
            sources = [r["status"]["source"] for r in items]
            # Where the time went, per replica: when its agent started the load, and when it served.
            detail = sorted(
                (
                    round(wall(r["status"]["startedTime"]) - published_wall, 2),
                    round(wall(r["status"]["completedTime"]) - published_wall, 2),
                    r["status"]["source"],
                )
                for r in items
            )
            print(json.dumps({"replicas": n, "rollout": mode, "started_served_source": detail}), flush=True)
            print(json.dumps({"replicas": n, "rollout": mode, "cpu_seconds": cpu}), flush=True)
            rows.append(
                {
                    "replicas": n,
                    "rollout": mode,
                    "publish_to_ready_s": round(ready_s, 2),
                    "first_serving_s": round(first_s, 2),
                    "all_serving_s": round(all_s, 2),
                    "rollout_s": round(all_s - ready_s, 2),
                    "from_s3": sum(s == "s3" for s in sources),
                    "from_peer": sum(s.startswith("peer/") for s in sources),
                    "replica_writes": writes,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            base = version
    finally:
        for a in agents:
            a.stop()
        api.close()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    return rows


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of every process of this machine, by what it is: an agent (by node), the
    operator, the apiserver, etcd, SeaweedFS, this bench. Where a rollout's time went on a machine it saturates."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--node" in argv:
            label = "agent " + argv[argv.index(b"--node") + 1].decode()
        elif b"ferry_operator.main" in argv:
            label = "operator"
        elif int(stat.parent.name) == os.getpid():
            label = "bench"
        else:
            label = Path(argv[0].decode(errors="replace")).name
        out[label] = out.get(label, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    spent = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in spent.items() if v >= 0.01), key=lambda kv: -kv[1]))


def wall(rfc3339: str) -> float:
    return dt.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def observe(objects, namespace: str, version: str, n: int, published: float) -> tuple[float, float, float, int]:
    """Patch the ModelLoad's desiredVersion to `version` and return the seconds from `published` to the
    WeightVersion Ready, to the first and to the n-th replica serving it, as watch events arrive: a poll would add
    its interval and load the apiserver that the rollout shares (watches opened from a list before the patch, so
    no event is missed); and the WeightReplica writes until then (each one an event to every watcher)."""
    from kubernetes import watch

    got: dict[str, float] = {}

    def version_ready() -> None:
        body = objects.list_namespaced_custom_object(
            GROUP, VERSION, namespace, "weightversions", field_selector=f"metadata.name={version}"
        )
        items = body["items"]
        if items and (items[0].get("status") or {}).get("phase") == WeightVersionPhase.READY:
            got["ready"] = time.monotonic() - published
            return
        rv = body["metadata"]["resourceVersion"]
        for event in watch.Watch().stream(
            objects.list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            "weightversions",
            field_selector=f"metadata.name={version}",
            resource_version=rv,
            timeout_seconds=600,
        ):
            if (event["object"].get("status") or {}).get("phase") == WeightVersionPhase.READY:
                got["ready"] = time.monotonic() - published
                return

    listed = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "weightreplicas")
    statuses = {r["metadata"]["name"]: r.get("status") or {} for r in listed["items"]}
    ready = threading.Thread(target=version_ready, daemon=True)
    ready.start()
    patch = {"spec": {"desiredVersion": version}}
    objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, "modelloads", "m", patch)
    stream = watch.Watch()
    writes = 0
    for event in stream.stream(
        objects.list_namespaced_custom_object,
        GROUP,
        VERSION,
        namespace,
        "weightreplicas",
        resource_version=listed["metadata"]["resourceVersion"],
        timeout_seconds=600,
    ):
        statuses[event["object"]["metadata"]["name"]] = event["object"].get("status") or {}
        writes += 1
        want = (ReplicaPhase.SERVING, version)
        count = sum(1 for st in statuses.values() if (st.get("phase"), st.get("version")) == want)
        if count and "first" not in got:
            got["first"] = time.monotonic() - published
        if count >= n:
            got["all"] = time.monotonic() - published
            stream.stop()
            break
    if "all" not in got:
        raise TimeoutError(f"{n} replicas not serving {version} after 600 s")
    ready.join(10)
    return got.get("ready", got["all"]), got["first"], got["all"], writes


def serving(objects, namespace: str, version: str) -> int:
    items = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "weightreplicas")["items"]
    statuses = [r.get("status") or {} for r in items]
    return sum(1 for s in statuses if s.get("phase") == ReplicaPhase.SERVING and s.get("version") == version)


def rollout_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "publish → serving: end of `ferry publish` of a delta (desiredVersion patched at once) → every replica serving",
        "",
        "| rollout | replicas | → WeightVersion Ready s | → first serving s | → all serving s "
        "| rollout s (Ready → all) | S3 reads / peer copies | WeightReplica writes until all serve |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rollout']} | {r['replicas']} | {r['publish_to_ready_s']:.2f} | {r['first_serving_s']:.2f} "
            f"| {r['all_serving_s']:.2f} | {r['rollout_s']:.2f} | {r['from_s3']} / {r['from_peer']} "
            f"| {r['replica_writes']} |"
        )
    for mode in ROLLOUTS:
        by_n = {r["replicas"]: r for r in rows if r["rollout"] == mode}
        if 1 in by_n and 8 in by_n:
            total = by_n[8]["all_serving_s"] / by_n[1]["all_serving_s"]
            lines.append(f"\n{mode}: 8 replicas vs 1, publish → all serving: {total:.2f}x (goal: at most 2x)")
    return lines


def cold_table(rows: list[dict], size_mib: int) -> list[str]:
    """Peers-first beside S3-only per (ranks, replicas), and each row against the 1-replica row of its ranks and
    order (the fan-out's scaling; issue 14's goal for 8 replicas, peers first: at most 1.5x)."""
    lines = [
        f'model {size_mib} MiB; S3-only is the reference measured in the same run; "vs 1" is the row\'s time over the '
        "1-replica row of the same ranks and source order, also from this run",
        "",
        "| ranks | replicas | peers first: s to Ready | vs 1 | S3 only: s to Ready | vs 1 | S3 only / peers first "
        "| peers first: S3 reads / peer copies | S3 bytes, peers first vs S3 only |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pairs = list(zip(rows[::2], rows[1::2], strict=True))
    one = {(p["ranks"], "peer"): p for p, _ in pairs if p["replicas"] == 1}
    one |= {(s["ranks"], "s3"): s for _, s in pairs if s["replicas"] == 1}

    def vs_one(row: dict, kind: str) -> str:
        base = one.get((row["ranks"], kind))
        return f"{row['seconds_to_ready'] / base['seconds_to_ready']:.2f}x" if base else "—"

    for peer, s3only in pairs:
        lines.append(
            f"| {peer['ranks']} | {peer['replicas']} | {peer['seconds_to_ready']:.1f} | {vs_one(peer, 'peer')} "
            f"| {s3only['seconds_to_ready']:.1f} | {vs_one(s3only, 's3')} "
            f"| {s3only['seconds_to_ready'] / peer['seconds_to_ready']:.2f}x | {peer['from_s3']} / {peer['from_peer']} "
            f"| {peer['s3_bytes'] >> 20} MiB vs {s3only['s3_bytes'] >> 20} MiB |"
        )
    by = {(p["ranks"], p["replicas"]): p for p, _ in pairs}
    for (ranks, n), row in sorted(by.items()):
        if ranks > 1 and (1, n) in by:
            ratio = row["seconds_to_ready"] / by[(1, n)]["seconds_to_ready"]
            lines.append(f"\n{ranks} ranks vs 1 rank, {n} replica(s), peers first: {ratio:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", default="1,3,8,16")
    parser.add_argument("--ranks2-replicas", default="1,3", help="replica counts of the 2-rank rows ('' for none)")
    parser.add_argument(
        "--warm-ranks",
        type=int,
        default=2,
        help="rank processes the 2-rank rows' agents start with (0: started by the first load, as without the flag)",
    )
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--only", choices=["cold", "rollout"], help="run one of the two parts (default: both)")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (agent and operator logs)")
    parser.add_argument(
        "--socket-dir", default="", help="the agents serve attach sockets there (seal every version); default: off"
    )
    add_shmem_argument(parser)
    args = parser.parse_args()
    rows, rollouts = [], []
    counts = [int(x) for x in args.replicas.split(",")]
    cold = [(1, n) for n in counts] + [(2, int(x)) for x in args.ranks2_replicas.split(",") if x]
    with shmem_huge_pages(args.shmem_huge_pages) as mode, local_stack(keep=args.keep) as (cluster, s3):
        root = cluster.workdir.parent
        print(f"run directory {root}", flush=True)
        operator = start_operator(cluster, root / "operator", env=s3.env())
        publish(cluster, s3, root, args.size_mib)
        for ranks, n in cold if args.only != "rollout" else []:
            for order in (["Peer", "ObjectStorage"], ["ObjectStorage"]):
                row = one_round(cluster, s3, root, n, order, ranks, args.warm_ranks)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "loads"}), flush=True)
        for n in counts if args.only != "cold" else []:
            rollouts += rollout_rounds(cluster, s3, root, n, args.socket_dir)
        operator.stop()
    lines = cold_table(rows, args.size_mib) if rows else [f"model {args.size_mib} MiB"]
    lines[0] += f", shmem huge pages `{mode}`"
    data = {"size_mib": args.size_mib, "shmem_huge_pages": mode, "cold": rows, "rollout": rollouts}
    write_results("modelload", data, "\n".join(lines + rollout_table(rollouts)))


if __name__ == "__main__":
    main()
