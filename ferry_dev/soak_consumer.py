"""The soak's engine: `python -m ferry_dev.soak_consumer NAME` in a pod's socket directory (FERRY_SOCKET_DIR).

It follows every version the node serves for the ModelLoad NAME as an RL rollout engine does: `watch`, then
`attach` the new version (verified), `load_into(only_changed=True)` into the module that holds the one before, and
only then release the old lease (make before break). Each hold is one JSON line on stdout: the version, the sha256
of what the module now holds, when, and how many tensors were copied. It needs only `ferry.client` and torch.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

from ferry.client import AttachError, attach, watch


def module_for(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are named and shaped as the version's tensors (dotted names become submodules)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
    return root


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The soak's content digest: each name, a NUL, then its bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + b"\0")
        digest.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(name: str, idle_seconds: float = 120.0) -> None:
    torch.set_num_threads(1)
    module: torch.nn.Module | None = None
    held = None
    for version in watch(name, timeout=idle_seconds):
        try:
            new = attach(name, version=version, timeout=30, verify=True)
        except AttachError as exc:  # retention may retire a version before this engine gets to it
            emit(version=version, error=exc.code, message=str(exc))
            continue
        if module is None:
            module = module_for(dict(new.tensors()))
        result = new.load_into(module, only_changed=True)
        emit(
            version=new.version,
            sha256=tensors_sha256(dict(module.named_parameters())),
            time=time.time(),
            loaded=len(result.loaded),
            skipped=len(result.skipped),
        )
        if held is not None:
            held.close()
        held = new
    emit(done=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 120.0)
