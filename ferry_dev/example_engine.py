"""The engine `examples/vllm-engine` runs where vLLM cannot (no GPU): `python -m ferry_dev.example_engine MODELLOAD
--config JSON [--port 8000]`, with nothing of Ferry but `ferry.client` (and this harness's tiny Llama).

It serves HTTP at once, as vLLM's API server does its routes, and answers `GET /health` with 503 until the weights
are in, so the chart's probes gate readiness on the load: it builds a transformers Llama from the config (random
weights, another seed than any trainer's), attaches the version its node serves for MODELLOAD through the pod's
socket, `load_into`s it in place and holds the lease while it serves. `POST /v1/completions` takes vLLM's token-id
form, `{"prompt": [ids], "max_tokens": n}`, and answers greedy tokens in `choices[0].token_ids` (and, space
separated, as `text`: there is no tokenizer). A failed attach ends the process non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ferry.client import Attachment, attach
from ferry_dev.demo_engine import build_model, generate

MAX_TOKENS = 64
MAX_BODY = 1 << 20


class Engine:
    def __init__(self, model_load: str, config: dict, timeout: float) -> None:
        self.model = build_model(config, seed=1234)  # not the published weights
        self.model_load, self.timeout = model_load, timeout
        self.attachment: Attachment | None = None  # held while serving: the node keeps the version for this pod
        self.lock = threading.Lock()  # one generation at a time over the one model

    def load(self) -> None:
        try:
            held = attach(self.model_load, timeout=self.timeout)
            held.load_into(self.model)
        except Exception as exc:
            print(f"example_engine: loading {self.model_load} failed: {exc!r}", file=sys.stderr, flush=True)
            os._exit(1)
        self.attachment = held
        print(json.dumps({"loaded": held.version, "modelLoad": held.model_load}), flush=True)

    def complete(self, body: dict) -> dict:
        prompt, steps = body.get("prompt"), body.get("max_tokens", 16)
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise ValueError("prompt must be a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if not (isinstance(steps, int) and 1 <= steps <= MAX_TOKENS):
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_TOKENS}]")
        with self.lock:
            tokens = generate(self.model, steps, prompt)
        choice = {"index": 0, "text": " ".join(map(str, tokens)), "token_ids": tokens, "finish_reason": "length"}
        return {"object": "text_completion", "model": self.attachment.version, "choices": [choice]}


def handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def reply(self, status: HTTPStatus, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/health":
                return self.reply(HTTPStatus.NOT_FOUND, {"error": "not found"})
            if engine.attachment is None:
                return self.reply(HTTPStatus.SERVICE_UNAVAILABLE, {"status": "loading"})
            return self.reply(HTTPStatus.OK, {"status": "ok", "version": engine.attachment.version})

        def body(self) -> bytes:
            """The request body, also when a proxy (the apiserver's pod proxy) sends it chunked."""
            if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    raise ValueError("request body too large")
                return self.rfile.read(length)
            data = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                data += self.rfile.read(size)
                self.rfile.readline()  # the CRLF after each chunk
                if len(data) > MAX_BODY:
                    raise ValueError("request body too large")
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return data

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                return self.reply(HTTPStatus.NOT_FOUND, {"error": "not found"})
            if engine.attachment is None:
                return self.reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "weights not loaded yet"})
            try:
                return self.reply(HTTPStatus.OK, engine.complete(json.loads(self.body() or b"{}")))
            except (ValueError, AttributeError) as exc:
                return self.reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})

        def log_message(self, format: str, *args) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ferry_dev.example_engine", description=__doc__.split("\n")[0])
    parser.add_argument("model_load", help="the ModelLoad (in the pod's namespace) whose weights to serve")
    parser.add_argument("--config", required=True, help="the LlamaConfig as JSON")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait until the node serves it")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engine = Engine(args.model_load, json.loads(args.config), args.timeout)
    server = ThreadingHTTPServer(("0.0.0.0", args.port), handler(engine))
    threading.Thread(target=engine.load, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
