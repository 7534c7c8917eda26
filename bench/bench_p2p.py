"""P2P throughput: a full PeerStrategy load between two processes vs a raw NIXL READ of the same buffers vs
an in-process memcpy (torch `copy_`), in one run, for 64 MiB to 4 GiB; the peer loads and raw READs take turns. A
size needs five times its bytes of memory at once (two sources' copies, the target, and memcpy's source and
destination): sizes for which that plus 8 GiB left to the machine's other users exceeds MemAvailable are skipped and
listed (on the shared 24 GiB VM: 4 GiB is).

    unshare -n bash -c 'ip link set lo up; UCX_NET_DEVICES=lo ~/.cache/ferry/venv/bin/python bench/bench_p2p.py'

- peer: lease + manifest (gRPC) + add_remote + connection set-up + READ + sync + remove_remote + release,
  into a pre-faulted target that the strategy reuses (the same buffers the raw READ uses). Authenticated as an
  agent's reads are (a pod-bound worker token, TokenReview and the replica-assignment check on a local apiserver
  started for the run), unless `--no-auth`.
- raw: only `NixlPeer.read` on an already connected pair (a second source of the same bytes).
- memcpy: `dst.copy_(src)` of the same size in this process.
Writes bench/results/p2p.json and p2p.md. GB/s means 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:
    from bench._common import summary
except ImportError:  # run as a script: bench/ is on sys.path, the repository root may not be
    from _common import summary

from ferry.api.models import API_VERSION, LABEL_MODEL, LABEL_NODE, label_value, worker_audience
from ferry_agent.store.resident import ResidentWeights, TensorSpec
from ferry_agent.strategies.candidate import SourceCandidate
from ferry_agent.strategies.chain import LoadContext
from ferry_agent.strategies.peer import PeerStrategy, TransferSettings
from ferry_agent.transport.worker_service import SourceIdentity, get_tensor_manifest
from ferry_dev.localcluster import local_stack
from ferry_dev.source_main import READY_MARKER

MIB = 1 << 20
SPARE_BYTES = 8 << 30  # left to the other users of a shared machine


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


@dataclass(frozen=True)
class Auth:
    """The reader's token and what the source is told to check (None: an open source)."""

    token: Path  # for the source's audience, worker_audience(SOURCE_NODE)
    identity: str
    kubeconfig: Path


SOURCE_NODE = "bench-source-node"  # the node the source's worker service says it runs on


def authenticated(cluster: Any, workdir: Path) -> Auth:
    """A Node with a WeightReplica of bench/v, and a worker token for the source bound to a Pod on it (what a
    reader there mints)."""
    node = "bench-node"
    token = cluster.pod_token(node, worker_audience(SOURCE_NODE), workdir / "worker-token")
    body = {
        "apiVersion": API_VERSION,
        "kind": "WeightReplica",
        "metadata": {
            "name": "bench-target",
            "namespace": "default",
            # the assignment views select a served model's replicas by this label, as the operator sets it
            "labels": {LABEL_NODE: node, LABEL_MODEL: label_value("bench")},
        },
        "spec": {"modelLoad": "bench", "modelName": "bench", "version": "v", "nodeName": node, "device": "cpu"},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    return Auth(token, "system:serviceaccount:ferry-system:ferry-agent", cluster.kubeconfig)  # pod_token's


def start_source(
    name: str, tensors: int, tensor_bytes: int, auth: Auth | None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    cmd = [
        sys.executable,
        "-m",
        "ferry_dev.source_main",
        "--agent-name",
        name,
        "--tensors",
        str(tensors),
        "--tensor-bytes",
        str(tensor_bytes),
    ]
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
    if auth is not None:
        cmd += ["--serve", "default/bench/v", "--node", SOURCE_NODE, "--worker-allowed-identity", auth.identity]
        env["KUBECONFIG"] = str(auth.kubeconfig)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(READY_MARKER):
            return proc, json.loads(line[len(READY_MARKER) :])
    raise RuntimeError(f"source {name} exited with {proc.wait()} before it was ready")


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping others out)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    fn()  # warm-up, not counted
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def peer_load(
    peer: Any, replica: str, info: dict[str, Any], target: ResidentWeights, auth: Auth | None
) -> Callable[[], Any]:
    """A PeerStrategy load from the source `info` (started by `start_source`) into `target`, reused by every load so
    that all land in the same pre-faulted pages; as an authenticated reader when `auth` is given."""
    cand = SourceCandidate(
        replica=replica,
        rank=0,
        agent_name=info["agent_name"],
        grpc_endpoint=info["endpoint"],
        manifest_digest=info["manifest_digest"],
        tensor_count=info["tensor_count"],
        instance_id=info["instance_id"],
        node=SOURCE_NODE,
    )

    def reuse(specs: Sequence[TensorSpec], device: str) -> ResidentWeights:
        return target

    strategy = PeerStrategy(
        peer=peer,
        candidates=lambda _: [cand],
        settings=TransferSettings(timeout_s=120),
        allocate=reuse,
        credentials=(lambda node: auth.token.read_text()) if auth is not None else None,
    )
    ctx = LoadContext(model="bench", version="v", rank=0, target_id="bench-target")
    return lambda: strategy.load(ctx)


def alternating(runs: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds of `reps` timed calls of each run after one warm-up each, the runs taking turns (the order rotating
    each round), so that a shared machine's drift hits them alike."""
    for fn in runs.values():
        fn()  # warm-up, not counted
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for i in range(reps):
        for kind in order[i % len(order) :] + order[: i % len(order)]:
            start = time.perf_counter()
            runs[kind]()
            seconds[kind].append(time.perf_counter() - start)
    return seconds


def bench_size(peer: Any, size: int, tensor_bytes: int, reps: int, auth: Auth | None) -> dict[str, Any]:
    """PeerStrategy loads and raw READs taking turns (`alternating`); the raw READ reads a second source of the same
    seeded bytes, connected once (a peer load removes its source's remote when it is done)."""
    tensors = max(1, size // tensor_bytes)
    sources = [
        start_source(f"bench-{kind}-{uuid.uuid4().hex[:6]}", tensors, tensor_bytes, a)
        for kind, a in (("src", auth), ("raw", None))
    ]
    (_, info), (_, raw_info) = sources
    credentials = (lambda: auth.token.read_text()) if auth is not None else None
    try:
        identity = SourceIdentity(info["agent_name"], info["instance_id"])
        manifest = get_tensor_manifest(info["endpoint"], identity, timeout_s=30, credentials=credentials)
        target = ResidentWeights.allocate(manifest.specs, "cpu")
        for t in target.tensors.values():
            t.zero_()  # fault the pages in before timing
        peer.register(target)

        raw_manifest = get_tensor_manifest(
            raw_info["endpoint"], SourceIdentity(raw_info["agent_name"], raw_info["instance_id"]), timeout_s=30
        )
        remote = peer.add_remote(raw_manifest.nixl_metadata)
        load = peer_load(peer, "bench-source", info, target, auth)
        try:
            seconds = alternating(
                {"peer": load, "raw": lambda: peer.read(remote, raw_manifest.tensors, target, 120)}, reps
            )
        finally:
            peer.remove_remote(remote)
        verified = raw_info["content_sha256"] == info["content_sha256"] == target.content_sha256()
        for t in target.tensors.values():
            t.zero_()
        load()  # and a peer load alone lands the same bytes
        verified = verified and target.content_sha256() == info["content_sha256"]
        peer.deregister(target)

        total = info["total_bytes"]
        src = torch.empty(total, dtype=torch.uint8).random_(0, 256)
        dst = torch.zeros(total, dtype=torch.uint8)
        copy_s = timed(lambda: dst.copy_(src), reps)
    finally:
        for p, _ in sources:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(30)

    peer_r, raw_r, copy_r = summary(total, seconds["peer"]), summary(total, seconds["raw"]), summary(total, copy_s)
    return {
        "bytes": total,
        "tensors": info["tensor_count"],
        "verified_sha256": verified,
        "peer_strategy": peer_r,
        "raw_nixl_read": raw_r,
        "memcpy": copy_r,
        "ratio_peer_vs_raw": round(peer_r["gbps_median"] / raw_r["gbps_median"], 3),
        "ratio_peer_vs_memcpy": round(peer_r["gbps_median"] / copy_r["gbps_median"], 3),
        "ratio_raw_vs_memcpy": round(raw_r["gbps_median"] / copy_r["gbps_median"], 3),
    }


def compare_auth(peer: Any, size: int, tensor_bytes: int, rounds: int, auth: Auth) -> dict[str, Any]:
    """What authentication costs, paired: an open and an authenticated source of the same bytes, and per round a
    PeerStrategy load from each and a raw READ from a third (the order rotating), so that drift on a shared machine
    hits all three alike. Per round peer/raw for both; mean, spread and the paired difference (authenticated - open)."""
    tensors = max(1, size // tensor_bytes)
    sources = {
        kind: start_source(f"bench-{kind}-{uuid.uuid4().hex[:6]}", tensors, tensor_bytes, a)
        for kind, a in (("open", None), ("auth", auth), ("raw", None))
    }
    try:
        _, info = sources["open"]
        manifest = get_tensor_manifest(
            info["endpoint"], SourceIdentity(info["agent_name"], info["instance_id"]), timeout_s=30
        )
        target = ResidentWeights.allocate(manifest.specs, "cpu")
        for t in target.tensors.values():
            t.zero_()
        peer.register(target)

        # The raw READ has a source of its own (the same seeded bytes), connected once: a peer load removes its
        # source's remote when it is done.
        _, raw_src = sources["raw"]
        raw_manifest = get_tensor_manifest(
            raw_src["endpoint"], SourceIdentity(raw_src["agent_name"], raw_src["instance_id"]), timeout_s=30
        )
        remote = peer.add_remote(raw_manifest.nixl_metadata)
        runs = {
            "auth": peer_load(peer, "bench-auth", sources["auth"][1], target, auth),
            "open": peer_load(peer, "bench-open", info, target, None),
            "raw": lambda: peer.read(remote, raw_manifest.tensors, target, 120),
        }

        def once(kind: str) -> float:
            start = time.perf_counter()
            runs[kind]()
            return time.perf_counter() - start

        for kind in runs:
            once(kind)  # warm-up
        seconds: dict[str, list[float]] = {k: [] for k in runs}
        order = list(runs)
        for i in range(rounds):
            for kind in order[i % 3 :] + order[: i % 3]:
                seconds[kind].append(once(kind))
        digests = {src["content_sha256"] for _, src in sources.values()}
        verified = len(digests) == 1 and target.content_sha256() in digests
        peer.remove_remote(remote)
        peer.deregister(target)
    finally:
        for proc, _ in sources.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(30)
    ratios = {k: [raw / s for raw, s in zip(seconds["raw"], seconds[k], strict=True)] for k in ("auth", "open")}
    diffs = [a - o for a, o in zip(ratios["auth"], ratios["open"], strict=True)]

    def spread(values: list[float]) -> dict[str, float]:
        return {
            "mean": round(statistics.mean(values), 3),
            "stdev": round(statistics.stdev(values), 3),
            "median": round(statistics.median(values), 3),
        }

    return {
        "bytes": info["total_bytes"],
        "rounds": rounds,
        "verified_sha256": verified,
        "peer_vs_raw_authenticated": spread(ratios["auth"]),
        "peer_vs_raw_open": spread(ratios["open"]),
        "difference_authenticated_minus_open": spread(diffs),
        "seconds": {k: [round(x, 5) for x in v] for k, v in seconds.items()},
    }


def compare_markdown(results: list[dict[str, Any]], host: str) -> str:
    lines = [
        "# P2P: what reader authentication costs (paired rounds)",
        "",
        f"{host} · per round one load from an open source, one from an authenticated source (per-source token, "
        "TokenReview cached, assignment check) and one raw NIXL READ, order rotating · peer/raw per round, "
        "mean ± stdev (median)",
        "",
        "| size | rounds | authenticated peer/raw | open peer/raw | authenticated - open | sha256 |",
        "|---|---|---|---|---|---|",
    ]

    def cell(x: dict[str, float]) -> str:
        return f"{x['mean']:+.3f} ± {x['stdev']:.3f} ({x['median']:+.3f})"

    for r in results:
        a, o, d = r["peer_vs_raw_authenticated"], r["peer_vs_raw_open"], r["difference_authenticated_minus_open"]
        lines.append(
            f"| {r['bytes'] // MIB} MiB | {r['rounds']} | {a['mean']:.3f} ± {a['stdev']:.3f} ({a['median']:.3f}) | "
            f"{o['mean']:.3f} ± {o['stdev']:.3f} ({o['median']:.3f}) | {cell(d)} | "
            f"{'ok' if r['verified_sha256'] else 'MISMATCH'} |"
        )
    return "\n".join(lines) + "\n"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# P2P throughput (NIXL READ over UCX, CPU memory, loopback netns)",
        "",
        f"{report['host']} · torch {report['torch']} · reps {report['reps']} (+1 warm-up; peer and raw taking turns) · "
        f"tensors of {report['tensor_mib']} MiB · median (best) GB/s · "
        f"{'authenticated reader (TokenReview + assignment check)' if report['authenticated'] else 'open source'}",
        "",
        "| size | peer strategy | raw NIXL READ | memcpy | peer/raw | peer/memcpy | raw/memcpy | sha256 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:

        def cell(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]['gbps_median']:.2f} ({r[key]['gbps_best']:.2f})"

        lines.append(
            f"| {r['bytes'] // MIB} MiB | {cell('peer_strategy')} | {cell('raw_nixl_read')} | {cell('memcpy')} | "
            f"{r['ratio_peer_vs_raw']:.2f} | {r['ratio_peer_vs_memcpy']:.2f} | {r['ratio_raw_vs_memcpy']:.2f} | "
            f"{'ok' if r['verified_sha256'] else 'MISMATCH'} |"
        )
    if report["skipped_for_memory"]:
        lines += ["", "not run, for lack of memory: " + ", ".join(f"{m} MiB" for m in report["skipped_for_memory"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64M,256M,1G,2G,4G")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--no-auth", action="store_true", help="read from an open source (no apiserver needed)")
    parser.add_argument(
        "--compare-auth",
        type=int,
        metavar="ROUNDS",
        default=0,
        help="instead: paired rounds of authenticated vs open loads (writes p2p_auth.json/.md)",
    )
    args = parser.parse_args(argv)
    if args.compare_auth and (args.no_auth or args.compare_auth < 2):
        parser.error("--compare-auth needs at least 2 rounds and the apiserver (not --no-auth)")

    interfaces = sorted(name for _, name in socket.if_nameindex())
    if interfaces != ["lo"]:
        sys.exit(
            f"run in a loopback-only network namespace (this one has {interfaces}):\n"
            "  unshare -n bash -c 'ip link set lo up; UCX_NET_DEVICES=lo ~/.cache/ferry/venv/bin/python "
            "bench/bench_p2p.py'"
        )
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from ferry_agent.transport.nixl import NixlPeer

    with contextlib.ExitStack() as stack:
        auth = None
        if not args.no_auth:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ferry-bench-p2p-")))
            cluster, _ = stack.enter_context(local_stack(workdir, s3=False, controller_manager=False))
            auth = authenticated(cluster, workdir)
        peer = NixlPeer(f"bench-target-{uuid.uuid4().hex[:6]}")
        try:
            sizes, skipped = [], []
            for size in (parse_size(s) for s in args.sizes.split(",")):
                (sizes if 5 * size + SPARE_BYTES <= available_bytes() else skipped).append(size)
            for size in skipped:
                print(
                    f"skipping {size // MIB} MiB: needs {5 * size + SPARE_BYTES >> 30} GiB, "
                    f"{available_bytes() >> 30} available"
                )
            if args.compare_auth:
                assert auth is not None
                compared = [compare_auth(peer, n, args.tensor_mib * MIB, args.compare_auth, auth) for n in sizes]
            else:
                results = [bench_size(peer, size, args.tensor_mib * MIB, args.reps, auth) for size in sizes]
        finally:
            peer.shutdown()
    host = f"{platform.node()} ({os.cpu_count()} cpus)"
    if args.compare_auth:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "p2p_auth.json").write_text(json.dumps({"host": host, "results": compared}, indent=2) + "\n")
        table = compare_markdown(compared, host)
        (args.out / "p2p_auth.md").write_text(table)
        print(table)
        return 0 if all(r["verified_sha256"] for r in compared) else 1
    report = {
        "host": host,
        "torch": torch.__version__,
        "reps": args.reps,
        "tensor_mib": args.tensor_mib,
        "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
        "authenticated": not args.no_auth,
        "results": results,
        "skipped_for_memory": [size // MIB for size in skipped],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "p2p.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "p2p.md").write_text(markdown(report))
    for r in results:
        print(
            f"{r['bytes'] // MIB:>5} MiB  peer {r['peer_strategy']['gbps_median']:6.2f} GB/s  "
            f"raw {r['raw_nixl_read']['gbps_median']:6.2f} GB/s  memcpy {r['memcpy']['gbps_median']:6.2f} GB/s  "
            f"peer/raw {r['ratio_peer_vs_raw']:.2f}  peer/memcpy {r['ratio_peer_vs_memcpy']:.2f}  "
            f"raw/memcpy {r['ratio_raw_vs_memcpy']:.2f}  sha256 {'ok' if r['verified_sha256'] else 'MISMATCH'}"
        )
    print(f"wrote {args.out / 'p2p.json'} and {args.out / 'p2p.md'}")
    return 0 if all(r["verified_sha256"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
