"""The demo's inference engine: `python -m ferry_dev.demo_engine MODELLOAD CONFIG.json` in a pod's socket directory
(FERRY_SOCKET_DIR), with nothing of Ferry but `ferry.client`.

It builds a tiny transformers Llama from the config (random weights: no hub), attaches to the version its node
serves, loads it in place and generates; then it follows the ModelLoad: at each new version it attaches that one
too (make before break), refits only the tensors that changed, generates again and lets the old version go. Each
step is one JSON line on stdout; it runs until killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ferry.client import attach, watch

PROMPT = [1, 17, 42, 99, 3]


def build_model(config: dict, seed: int | None = None) -> LlamaForCausalLM:
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def generate(model: LlamaForCausalLM, steps: int = 8, prompt: list[int] = PROMPT) -> list[int]:
    """Greedy tokens after `prompt`: the same weights give the same tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            next_id = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt) :].tolist()


def main(name: str, config_path: str) -> None:
    torch.set_num_threads(1)
    model = build_model(json.loads(Path(config_path).read_text()), seed=1234)  # not the published weights
    held = None
    for version in watch(name):
        new = attach(name, version=version, timeout=120, verify=True)
        started = time.perf_counter()
        result = new.load_into(model, only_changed=held is not None)
        paused_ms = (time.perf_counter() - started) * 1e3
        print(
            json.dumps(
                {
                    "version": new.version,
                    "copied": len(result.loaded),
                    "tensors": len(new.entries),
                    "pausedMs": round(paused_ms, 1),
                    "tokens": generate(model),
                }
            ),
            flush=True,
        )
        if held is not None:
            held.close()
        held = new


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
