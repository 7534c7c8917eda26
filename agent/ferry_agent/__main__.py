"""`python -m ferry_agent --node NAME`: the node agent (one per GPU node; in tests one process per simulated node)."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from ferry import s3
from ferry.api.models import worker_audience
from ferry.kube import kube_client
from ferry_agent import logs, metrics
from ferry_agent.attach.memstore import HostStore
from ferry_agent.attach.publish import TrainerPublishing
from ferry_agent.attach.service import AttachService
from ferry_agent.config import AgentConfig
from ferry_agent.kube.apiretry import bound_requests
from ferry_agent.node_agent import NodeAgent
from ferry_agent.store.checkpoints import CheckpointStore
from ferry_agent.transport import worker_auth


def main(argv: list[str] | None = None) -> None:
    config = AgentConfig.from_args(argv)
    logs.configure(config.log_format)
    api = bound_requests(kube_client())
    try:
        worker_tokens, auth = worker_auth.from_arguments(config, api, config.node)
    except ValueError as exc:  # no identity to mint worker tokens for: exit now, with the reason
        raise SystemExit(f"ferry-agent: {exc}") from exc
    me = worker_tokens.identity
    logging.getLogger("ferry.agent").info(
        "worker readers: pod-bound tokens of %s for audience %s; own tokens: %s bound to Pod %s",
        ", ".join(sorted(auth.allowed_identities)),
        worker_audience(config.node),
        me.username,
        me.pod_name,
    )
    if config.metrics_port >= 0:
        port = metrics.serve(config.bind_address, config.metrics_port)
        logging.getLogger("ferry.agent").info("metrics on http://%s:%d/metrics", config.bind_address, port)
    # The S3 model parsed now, off any load: a replica that got its first version from a peer otherwise pays it
    # (0.3 to 0.8 s of CPU) on its first S3 load, e.g. a rollout's delta.
    threading.Thread(target=s3.prewarm, name="ferry-s3-prewarm", daemon=True).start()
    store = CheckpointStore(config.checkpoint_dir, int(config.checkpoint_quota_gib * 2**30))
    store.recover()  # a crash mid-load leaves tmp files and an UPDATING state: repair before serving anything
    host = HostStore(config.host_memory_budget)
    attach = (
        AttachService(
            api,
            config.node,
            Path(config.socket_dir),
            agent_name=config.node,
            store=host,
            max_connections_per_pod=config.attach_connections_per_pod,
            publishing=TrainerPublishing(api, host, ambient=config.ambient_credentials, s3_endpoint=config.s3_endpoint),
        )
        if config.socket_dir
        else None
    )
    if attach is not None:
        try:
            attach.start()
        except OSError as exc:  # engines cannot attach here; peers and replicas are served all the same
            logging.getLogger("ferry.agent").error("attach disabled: %s: %s", config.socket_dir, exc)
            attach = None
    agent = NodeAgent(api, config, store=store, worker_auth=auth, worker_tokens=worker_tokens, attach=attach, host=host)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    metrics.READY.set()
    agent.run()
    if attach is not None:
        attach.stop()


if __name__ == "__main__":
    main()
