"""`python -m ferry_agent --node NAME`: the node agent (one per GPU node; in tests one process per simulated node)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path

from ferry.api.models import worker_audience
from ferry.kube import kube_client
from ferry_agent import metrics
from ferry_agent.attach.memstore import HostStore, parse_bytes
from ferry_agent.attach.service import AttachService
from ferry_agent.kube.apiretry import bound_requests
from ferry_agent.kube.registry import DEFAULT_LEASE_SECONDS
from ferry_agent.node_agent import NodeAgent
from ferry_agent.store.checkpoints import CheckpointStore
from ferry_agent.strategies.local_file import seed_argument
from ferry_agent.transport import worker_auth


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ferry-agent", description=__doc__)
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (env NODE_NAME)")
    parser.add_argument("--seed", type=seed_argument, action="append", default=[],
                        metavar="NAMESPACE/MODEL/VERSION=PATH",
                        help="a local safetensors file that holds that WeightVersion")  # fmt: skip
    parser.add_argument("--lease-seconds", type=int, default=DEFAULT_LEASE_SECONDS)
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=10.0,
        help="resync period; changes to this node's WeightReplicas are watched and act at once",
    )
    parser.add_argument("--bind-address", default=os.environ.get("POD_IP", "127.0.0.1"),
                        help="address peers reach this agent's worker service on (env POD_IP)")  # fmt: skip
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(os.environ.get("FERRY_CHECKPOINT_DIR", "/var/lib/ferry/checkpoints")),
        help="local checkpoint store for the ObjectStorage strategy (env FERRY_CHECKPOINT_DIR)",
    )
    parser.add_argument("--checkpoint-quota-gib", type=float, default=500.0)
    parser.add_argument(
        "--s3-endpoint",
        default=os.environ.get("FERRY_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL"),
        help="S3 endpoint for versions that name none",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("FERRY_AGENT_METRICS_PORT", "-1")),
        help="serve Prometheus metrics on this port (env FERRY_AGENT_METRICS_PORT; -1 = off)",
    )
    parser.add_argument("--retry-seconds", type=float, default=5.0, help="first backoff after a failed load")
    parser.add_argument(
        "--rank-timeout-seconds",
        type=float,
        default=3600.0,
        help="bound on each agreement step of a multi-rank replica (the other ranks wait in one while the first "
        "replays the chain from S3); a rank process that dies is noticed at once",
    )
    parser.add_argument(
        "--socket-dir",
        default=os.environ.get("FERRY_AGENT_SOCKET_DIR", "/run/ferry"),
        help="serve attach sockets at DIR/pods/<pod-uid>/ferry.sock to this node's pods "
        "(env FERRY_AGENT_SOCKET_DIR; empty = off)",
    )
    parser.add_argument(
        "--host-memory-budget",
        type=_budget,
        default=os.environ.get("FERRY_AGENT_HOST_MEMORY_BUDGET", ""),
        metavar="BYTES",
        help="most host memory the resident versions of this node may take, e.g. 64Gi (env "
        "FERRY_AGENT_HOST_MEMORY_BUDGET; empty = unlimited); a load beyond it fails with MemoryBudgetExceeded",
    )
    worker_auth.add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.node:
        parser.error("--node (or NODE_NAME) is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # each retry's warning; ours say it once
    api = bound_requests(kube_client())
    try:
        worker_tokens, auth = worker_auth.from_arguments(args, api, args.node)
    except ValueError as exc:  # no identity to mint worker tokens for: exit now, with the reason
        raise SystemExit(f"ferry-agent: {exc}") from exc
    me = worker_tokens.identity
    logging.getLogger("ferry.agent").info(
        "worker readers: pod-bound tokens of %s for audience %s; own tokens: %s bound to Pod %s",
        ", ".join(sorted(auth.allowed_identities)), worker_audience(args.node), me.username, me.pod_name,
    )  # fmt: skip
    if args.metrics_port >= 0:
        port = metrics.serve(args.bind_address, args.metrics_port)
        logging.getLogger("ferry.agent").info("metrics on http://%s:%d/metrics", args.bind_address, port)
    store = CheckpointStore(args.checkpoint_dir, int(args.checkpoint_quota_gib * 2**30))
    store.recover()  # a crash mid-load leaves tmp files and an UPDATING state: repair before serving anything
    host = HostStore(args.host_memory_budget)
    attach = (
        AttachService(api, args.node, Path(args.socket_dir), agent_name=args.node, store=host)
        if args.socket_dir
        else None
    )
    if attach is not None:
        try:
            attach.start()
        except OSError as exc:  # engines cannot attach here; peers and replicas are served all the same
            logging.getLogger("ferry.agent").error("attach disabled: %s: %s", args.socket_dir, exc)
            attach = None
    agent = NodeAgent(
        api, args.node, seeds=dict(args.seed), lease_seconds=args.lease_seconds,
        poll_seconds=args.poll_seconds, retry_seconds=args.retry_seconds,
        bind_address=args.bind_address,
        store=store,
        s3_endpoint=args.s3_endpoint,
        rank_timeout_s=args.rank_timeout_seconds,
        worker_auth=auth,
        worker_tokens=worker_tokens,
        attach=attach,
        host=host,
    )  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    agent.run()
    if attach is not None:
        attach.stop()


def _budget(text: str) -> int | None:
    if not text.strip():
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


if __name__ == "__main__":
    main()
