"""The refit sidecar: `python -m ferry_vllm.refit MODELLOAD [--engine URL]`, in the engine pod (same network
namespace, same attach directory). It watches the versions this node serves for the ModelLoad and moves the vLLM
server to each new one through vLLM's weight-update routes on localhost (they exist only with
`VLLM_SERVER_DEV_MODE=1`; the server must use `--weight-transfer-config '{"backend": "ferry"}'`):

    POST /init_weight_transfer_engine  (once)
    POST /pause?mode=keep -> /start_weight_update -> /update_weights -> /finish_weight_update -> /resume

A failed update leaves the server paused and this process exits non-zero: in-place loading that stopped midway
leaves weights that must not serve requests. Needs only the standard library and `ferry.client`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from ferry.client import watch

log = logging.getLogger("ferry_vllm.refit")


class Engine:
    """vLLM's HTTP weight-update routes."""

    def __init__(self, url: str, timeout: float = 600) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as reply:
            return json.loads(reply.read() or b"null")

    def wait_ready(self, interval: float = 2) -> None:
        """Until the server answers `/health` (it loads the model first)."""
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=self.timeout):
                    return
            except OSError:
                time.sleep(interval)

    def weight_version(self) -> str | None:
        with urllib.request.urlopen(self.url + "/weight_info", timeout=self.timeout) as reply:
            return json.loads(reply.read()).get("weight_version")

    def refit(self, version: str, pause_mode: str = "keep") -> None:
        self.post(f"/pause?mode={pause_mode}")
        self.post("/start_weight_update")
        self.post("/update_weights", {"update_info": {"version": version, "only_changed": True}})
        self.post("/finish_weight_update", {"weight_version": version})
        self.post("/resume")


def follow(
    engine: Engine,
    versions: Iterable[str],
    init_info: dict[str, Any],
    *,
    pause_mode: str = "keep",
    on_refit: Callable[[str], None] | None = None,
) -> None:
    """Move `engine` to each of `versions` it does not already serve (its `weight_version`)."""
    engine.wait_ready()
    engine.post("/init_weight_transfer_engine", {"init_info": init_info})
    for version in versions:
        if engine.weight_version() == version:
            continue
        log.info("refit to %s", version)
        engine.refit(version, pause_mode)
        if on_refit is not None:
            on_refit(version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry_vllm.refit", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_load", help="the ModelLoad the engine serves")
    parser.add_argument("--namespace", default=None, help="the pod's own when omitted")
    parser.add_argument("--engine", default="http://127.0.0.1:8000", help="the vLLM server (default: %(default)s)")
    parser.add_argument(
        "--pause-mode",
        default="keep",
        choices=("keep", "wait", "abort"),
        help="what vLLM does with requests in flight while it refits (default: %(default)s)",
    )
    parser.add_argument("--socket-dir", default=None, help="FERRY_SOCKET_DIR, else /run/ferry/pods/$POD_UID")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    init_info = {"model_load": args.model_load, "namespace": args.namespace, "socket_dir": args.socket_dir}
    follow(
        Engine(args.engine),
        watch(args.model_load, args.namespace, socket_dir=args.socket_dir),
        {k: v for k, v in init_info.items() if v is not None},
        pause_mode=args.pause_mode,
        on_refit=lambda v: print(json.dumps({"refit": v}), flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
