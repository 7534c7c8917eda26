"""A standalone P2P source for tests and benchmarks: seeds deterministic weights, registers them with NIXL
and serves the Worker service on 127.0.0.1.

    python -m ferry_dev.source_main --agent-name src-a [--tensors 8 --tensor-bytes 524288 --seed 0]

Unauthenticated by default: anyone who reaches the port may read. That is only for tests and benchmarks of the
transfer path; the node agent never serves that way. With `--serve NAMESPACE/MODEL/VERSION --node NODE` it checks
readers exactly as an agent on NODE does (`transport.worker_auth`, against the API of $KUBECONFIG: tokens for audience
ferry.dev/worker/NODE).

It prints one `FERRY-SOURCE {json}` line when ready (port, identity, manifest digest, content sha256)
and then answers line commands on stdin with `FERRY-REPLY {json}`: `leases`, `drain SECONDS`, `resume`,
`quit`. stdin EOF or SIGTERM stops it cleanly. Other output (NIXL logs) may share stdout, hence the
markers.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any

import torch

from ferry_agent.store.resident import ResidentWeights, TensorSpec, spec_of
from ferry_agent.transport.worker_service import WorkerServer, serve_resident

READY_MARKER = "FERRY-SOURCE "
REPLY_MARKER = "FERRY-REPLY "
_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int8)


def seeded_specs(tensors: int, tensor_bytes: int) -> list[TensorSpec]:
    """`tensors` 2-D tensors of `tensor_bytes` each (cycling dtypes), plus a scalar and an empty tensor."""
    specs = []
    for i in range(tensors):
        dtype = _DTYPES[i % len(_DTYPES)]
        elems = tensor_bytes // dtype.itemsize
        cols = 64 if elems % 64 == 0 else 1
        specs.append(spec_of(f"layers.{i}.weight", torch.empty((elems // cols, cols), dtype=dtype, device="meta")))
    specs.append(spec_of("extra.scale", torch.empty((), dtype=torch.float32, device="meta")))
    specs.append(spec_of("extra.empty", torch.empty((0, 4), dtype=torch.bfloat16, device="meta")))
    return specs


def seeded_weights(seed: int, tensors: int, tensor_bytes: int, device: str = "cpu") -> ResidentWeights:
    weights = ResidentWeights.allocate(seeded_specs(tensors, tensor_bytes), device)
    gen = torch.Generator().manual_seed(seed)
    for spec in weights.manifest:
        raw = weights.tensors[spec.name].reshape(-1).view(torch.uint8)
        host = torch.empty(raw.numel(), dtype=torch.uint8)
        if host.numel() % 8 == 0:
            # 8 bytes at a time is ~8x faster; each word's top bit is then 0, which test data can live with.
            host.view(torch.int64).random_(generator=gen)
        else:
            host.random_(0, 256, generator=gen)
        raw.copy_(host)
    return weights


def _emit(marker: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(marker + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _command(line: str, server: WorkerServer) -> dict[str, Any] | None:
    cmd, *args = line.split()
    if cmd == "leases":
        return {"active_leases": server.leases.active_count(), "accepting": server.leases.accepting}
    if cmd == "drain":
        try:
            server.drain(float(args[0]) if args else 10.0)
            return {"drained": True}
        except TimeoutError as exc:
            return {"drained": False, "error": str(exc)}
    if cmd == "resume":
        server.leases.resume()
        return {"accepting": True}
    if cmd == "quit":
        return None
    return {"error": f"unknown command {cmd!r}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agent-name", required=True)
    parser.add_argument("--instance-id", default="")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--tensor-bytes", type=int, default=512 << 10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lease-ttl", type=float, default=None, help="seconds; default from the transfer timeout")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--serve", metavar="NAMESPACE/MODEL/VERSION", help="authenticate readers for this version")
    parser.add_argument("--worker-allowed-identity", action="append", default=[], metavar="USERNAME")
    parser.add_argument("--node", help="with --serve: the node whose worker audience readers' tokens must have")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    from ferry_agent.transport.nixl import NixlPeer  # after torch: the NIXL import probes CUDA through it

    guard = None
    if args.serve:
        from ferry.kube import kube_client
        from ferry_agent.transport.worker_auth import ServedVersion, WorkerAuth

        if not args.node:
            parser.error("--serve needs --node")
        namespace, model, version = args.serve.split("/")
        auth = WorkerAuth.from_api(kube_client(), args.worker_allowed_identity, args.node)
        guard = auth.guard(ServedVersion(namespace, model, version))
    weights = seeded_weights(args.seed, args.tensors, args.tensor_bytes, args.device)
    peer = NixlPeer(args.agent_name)
    server = serve_resident(
        weights,
        peer,
        rank=args.rank,
        instance_id=args.instance_id,
        port=args.port,
        lease_ttl_s=args.lease_ttl,
        guard=guard,
    )
    identity = server.identity

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def serve_stdin() -> None:
        for line in sys.stdin:
            if not line.strip():
                continue
            reply = _command(line, server)
            if reply is None:
                break
            _emit(REPLY_MARKER, reply)
        stop.set()  # EOF: the parent is gone

    threading.Thread(target=serve_stdin, name="stdin", daemon=True).start()
    _emit(
        READY_MARKER,
        {
            "port": server.port,
            "endpoint": server.endpoint,
            "agent_name": identity.agent_name,
            "instance_id": identity.instance_id,
            "rank": args.rank,
            "manifest_digest": weights.digest,
            "tensor_count": weights.tensor_count,
            "total_bytes": weights.total_bytes,
            "content_sha256": weights.content_sha256(),
        },
    )
    stop.wait()
    server.stop(grace_s=1.0)
    peer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
