"""An engine process playing a pod: `python attach_consumer.py MODELLOAD once|hold|refit` with FERRY_SOCKET_DIR.

It builds a fresh tiny Llama (another seed than the published one), attaches through the pod's socket with
Ferry's own stack unimportable (as in an engine image), `load_into`s the model, and prints one JSON line: the
version, the sha256 of its tensors, greedy tokens before and after, and whether the parameters stayed in place.
`hold` then keeps the lease until the process is killed. `refit` watches for the next version, leases it, refits
only the changed tensors in place, prints a second line, and releases the old version, then the new one, each
after a line on stdin.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import json
import sys
import time

BLOCKED = ("kopf", "kubernetes", "boto3", "botocore", "grpc", "nixl", "ferry_agent", "ferry_operator")


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked in the consumer: {name}")


def build_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def model_tensors(model) -> dict:
    """Parameters and buffers (the non-persistent rotary ones too): what the agent serves."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def tensors_sha256(tensors: dict) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def greedy(model, steps: int = 12) -> list[int]:
    import torch

    ids = torch.tensor([[1, 17, 42, 99, 3]])
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


def main(name: str, mode: str) -> None:
    sys.meta_path.insert(0, _Block())
    import torch

    from ferry.client import attach

    torch.set_num_threads(1)
    model = build_model(seed=1234)
    before = greedy(model)
    ptrs = {n: t.data_ptr() for n, t in model_tensors(model).items()}
    if mode == "refit":
        refit(name, model, before, ptrs)
        return
    with attach(name, timeout=120, verify=True) as w:
        result = w.load_into(model)
        out = {
            "version": w.version,
            "versionUid": w.version_uid,
            "loaded": len(result.loaded),
            "sha256": tensors_sha256(model_tensors(model)),
            "served_sha256": tensors_sha256(dict(w.tensors())),
            "tokens_before": before,
            "tokens": greedy(model),
            "in_place": ptrs == {n: t.data_ptr() for n, t in model_tensors(model).items()},
            "blocked_loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
        }
        print(json.dumps(out), flush=True)
        if mode == "hold":
            while True:
                time.sleep(60)


def refit(name: str, model, before: list[int], ptrs: dict) -> None:
    from ferry.client import attach, watch

    versions = watch(name, timeout=120)
    old = attach(name, version=next(versions), timeout=120, verify=True)
    old.load_into(model)
    print(json.dumps({"version": old.version, "tokens": greedy(model), "tokens_before": before}), flush=True)
    new = attach(name, version=next(versions), timeout=120, verify=True)  # make before break
    result = new.load_into(model, only_changed=True)
    out = {
        "version": new.version,
        "baseUid": new.base_uid,
        "oldUid": old.version_uid,
        "loaded": result.loaded,
        "skipped": len(result.skipped),
        "tokens": greedy(model),
        "sha256": tensors_sha256(model_tensors(model)),
        "in_place": ptrs == {n: t.data_ptr() for n, t in model_tensors(model).items()},
    }
    print(json.dumps(out), flush=True)
    sys.stdin.readline()
    old.close()
    print(json.dumps({"released": old.version}), flush=True)
    sys.stdin.readline()
    new.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
