"""A vLLM-shaped engine process playing a pod, for test_vllm_integration.py. NOT vLLM: vLLM does not run here.

`python vllm_consumer.py MODELLOAD` with FERRY_SOCKET_DIR and `vllm_stub` on PYTHONPATH (or, by hand, an
interpreter with a real vLLM installed: FERRY_VLLM_PYTHON in test_vllm_integration.py). The model is a fresh
tiny transformers Llama behind `LoadWeightsAdapter`, which has the contract of a vLLM model (`load_weights` of
checkpoint-named tensors, returning the names loaded); the `vllm` it imports is the stand-in of tests/e2e/vllm_stub.
What runs for real: `ferry_vllm.register()`, `FerryModelLoader`, `FerryWeightTransferEngine`,
`FerryWorkerExtension`, `ferry_vllm.refit` (as its own process, over HTTP) and `ferry.client` against the agent.

1. Cold load through `--load-format ferry`'s loader; prints a line, with the port of a stand-in for vLLM's
   weight-update HTTP routes (the ones ferry_vllm.refit calls), served by the weight-transfer engine.
2. The refit sidecar drives those routes to the next version; the consumer prints a line after `/resume`.
3. A line on stdin: refit to the version after that through the worker extension (`collective_rpc`'s path);
   prints a line and exits.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

from attach_consumer import BLOCKED, _Block, build_model, greedy, model_tensors, tensors_sha256


class LoadWeightsAdapter:
    """Stands in for a vLLM model: a transformers module behind vLLM's `load_weights(weights) -> loaded names`
    contract. It copies each (name, tensor) into the parameter or buffer of that name, in place."""

    def __init__(self, module) -> None:
        self.module = module

    def named_parameters(self):
        return self.module.named_parameters()

    def load_weights(self, weights) -> set[str]:
        import torch

        targets = model_tensors(self.module)
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                targets[name].copy_(tensor)
                loaded.add(name)
        return loaded


def report(model, ptrs: dict, **extra) -> None:
    out = {
        "sha256": tensors_sha256(model_tensors(model)),
        "tokens": greedy(model),
        "in_place": ptrs == {n: t.data_ptr() for n, t in model_tensors(model).items()},
        **extra,
    }
    print(json.dumps(out), flush=True)


def listed() -> list:
    from ferry.client import request

    return [(v["version"], v["offered"], v["attached"]) for v in request({"op": "list"}, timeout=5)["versions"]]


class StandIn(BaseHTTPRequestHandler):
    """vLLM's dev-mode weight-update routes (vllm/entrypoints/rl/online/api_router.py), each calling what vLLM's
    engine client calls on the worker's weight-transfer engine."""

    engine = None
    calls: list = []
    weight_version = None
    initial = None  # the version the cold load gave
    done = threading.Event()

    def do_GET(self):
        body = {"weight_version": StandIn.weight_version} if self.path == "/weight_info" else {}
        self.reply(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        path = self.path.split("?")[0]
        StandIn.calls.append(self.path)
        engine = StandIn.engine
        if path == "/init_weight_transfer_engine":
            engine.init_transfer_engine(engine.parse_init_info(body["init_info"]))
        elif path == "/start_weight_update":
            engine.start_weight_update()
        elif path == "/update_weights":
            engine.update_weights(body["update_info"])
            StandIn.calls.append({"listed": listed()})  # both versions leased: make before break
        elif path == "/finish_weight_update":
            engine.finish_weight_update()
            StandIn.weight_version = body.get("weight_version")
            StandIn.calls.append({"listed": listed()})
        elif path == "/resume" and StandIn.weight_version not in (None, StandIn.initial):
            StandIn.done.set()
        self.reply({})

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def main(name: str) -> None:
    sys.meta_path.insert(0, _Block())
    import torch
    from vllm.config.load import LoadConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader import get_model_loader

    import ferry_vllm
    from ferry.client import watch
    from ferry_vllm._weights import held
    from ferry_vllm.worker import FerryWorkerExtension

    torch.set_num_threads(1)
    if not torch.accelerator.is_available():  # vLLM's update_weights syncs the device; CPU-only machines have none
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    module = build_model(seed=1234)
    model = LoadWeightsAdapter(module)
    ptrs = {n: t.data_ptr() for n, t in model_tensors(module).items()}
    tokens_before = greedy(module)

    try:  # a real vLLM (FERRY_VLLM_PYTHON): through the vllm.general_plugins entry point, as vLLM does it
        from vllm.plugins import load_general_plugins
    except ImportError:  # the stand-in
        ferry_vllm.register()
    else:
        load_general_plugins()
    load_config = LoadConfig(load_format="ferry", model_loader_extra_config={"model_load": name, "timeout": 120})
    model_config = SimpleNamespace(quantization=None)
    loader = get_model_loader(load_config)
    loader.download_model(model_config)
    loader.load_weights(model, model_config)

    vllm_config = SimpleNamespace(model_config=model_config, parallel_config=SimpleNamespace())
    StandIn.engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="ferry"), vllm_config, torch.device("cpu"), model
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    StandIn.initial = held(model).version
    threading.Thread(target=server.serve_forever, daemon=True).start()
    report(
        module,
        ptrs,
        version=held(model).version,
        tokens_before=tokens_before,
        port=server.server_port,
        listed=listed(),
        blocked_loaded=sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
    )

    StandIn.done.wait(300)
    last = held(model).last
    report(module, ptrs, version=held(model).version, calls=StandIn.calls, sent=last.sent, skipped=len(last.skipped))

    target = sys.stdin.readline().strip()
    for version in watch(name, timeout=120):
        if version == target:
            break
    worker = type("Worker", (FerryWorkerExtension,), {})()
    worker.vllm_config = vllm_config
    worker.model_runner = SimpleNamespace(get_model=lambda: model)
    out = worker.ferry_refit(version=target)
    report(module, ptrs, version=worker.ferry_version(), refit=out, sent=held(model).last.sent, listed=listed())
    held(model).close()
    server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
