"""Attach against the usual ways of getting weights into a process, ratios from one run.

1. `attach` + `tensors()` of a version (sealed memfd chunks, mapped read-only) vs `safetensors.torch.load_file`
   of the same checkpoint from local disk (page cache warm: the reference at its best). Attach maps; it does not
   copy, so this is the zero-copy claim.
2. `load_into` a module vs a plain `copy_` of the same tensors from ordinary memory into the same module (the
   mapped pages are faulted in on first touch; that is the cost this shows).
3. Refit: `load_into(only_changed=True)` of a version that differs in 10% of the bytes vs a full `load_into`.

The agent side (AttachServer) runs in this process over a real Unix socket; the consumer side is `ferry.client`.
Writes bench/results/attach.json and attach.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

try:
    from bench._common import write_results
except ImportError:  # run as a script
    from _common import write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "agent")]

from ferry.client import attach  # noqa: E402
from ferry_agent.attach.server import AttachServer, Pod  # noqa: E402
from ferry_agent.attach.service import AttachService  # noqa: E402
from ferry_agent.resident import ResidentWeights  # noqa: E402

TENSOR_BYTES = 16 << 20


def weights(total_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = max(1, total_bytes // TENSOR_BYTES)
    return {f"w{i:03d}": torch.randn(TENSOR_BYTES // 4, generator=gen) for i in range(n)}


class Flat(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    nbytes = args.size_mib << 20
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ferry-b-", dir="/tmp"))
    service = AttachService(None, "bench", root)
    service.server.start()
    try:
        server: AttachServer = service.server
        uid = str(uuid.uuid4())
        server.add_pod(Pod(uid, "bench", "engine"))
        pod_dir = server.pods_dir / uid
        key, spec = ("bench", "ml-bench"), {"modelLoad": "ml", "modelName": "m"}
        v1 = weights(nbytes, seed=1)
        service.serve(key, {**spec, "version": "v1"}, ResidentWeights(v1), "uid-1")

        # 1. attach + tensors() vs load_file (warm page cache).
        checkpoint = root / "v1.safetensors"
        save_file(v1, str(checkpoint))
        load_file(str(checkpoint))  # warm the page cache

        def attach_views() -> None:
            with attach("ml", socket_dir=pod_dir, timeout=5) as w:
                assert len(w.tensors()) == len(v1)

        t_attach = timed(attach_views, args.rounds)
        t_load_file = timed(lambda: load_file(str(checkpoint)), args.rounds)

        # 2. load_into vs copy_ from ordinary memory.
        module = Flat(v1)
        params = dict(module.named_parameters())

        def plain_copy() -> None:
            with torch.no_grad():
                for name, t in v1.items():
                    params[name].copy_(t)

        def load_into() -> None:
            with attach("ml", socket_dir=pod_dir, timeout=5) as w:
                w.load_into(module)

        t_copy = timed(plain_copy, args.rounds)
        t_load_into = timed(load_into, args.rounds)

        # 3. refit of a version changed in 10% of its tensors vs a full load_into of it, each from a fresh attach
        # into a module that holds v1 (loaded from v1's attachment, which stays leased across the switch).
        changed = sorted(v1)[: max(1, len(v1) // 10)]
        v2 = {n: (t + 1 if n in changed else t) for n, t in v1.items()}
        w1 = attach("ml", socket_dir=pod_dir, timeout=5, version="v1")
        service.withdraw(key)
        service.serve(key, {**spec, "version": "v2"}, ResidentWeights(v2), "uid-2")
        refits, fulls = [], []
        for _ in range(args.rounds):
            for only_changed, times in ((True, refits), (False, fulls)):
                w1.load_into(module)
                with attach("ml", socket_dir=pod_dir, timeout=5, version="v2") as w2:
                    t0 = time.perf_counter()
                    result = w2.load_into(module, only_changed=only_changed)
                    times.append(time.perf_counter() - t0)
                assert len(result.loaded) == (len(changed) if only_changed else len(v1))
        w1.close()
        t_refit, t_full = statistics.median(refits), statistics.median(fulls)
    finally:
        service.server.stop()
        shutil.rmtree(root, ignore_errors=True)

    rows = [
        ("attach + tensors()", t_attach, "safetensors load_file (warm cache)", t_load_file, t_load_file / t_attach),
        ("load_into", t_load_into, "plain copy_ from memory", t_copy, t_copy / t_load_into),
        ("refit, 10% changed", t_refit, "full load_into", t_full, t_full / t_refit),
    ]
    mib = args.size_mib
    table = "\n".join(
        [f"attach, {mib} MiB in {len(v1)} tensors (median of {args.rounds})", "",
         "| ours | s | reference | s | reference / ours |", "|---|---|---|---|---|"]
        + [f"| {a} | {ta:.4f} | {b} | {tb:.4f} | {r:.2f} |" for a, ta, b, tb, r in rows]
    )  # fmt: skip
    data = {"size_mib": mib, "tensors": len(v1), "rounds": args.rounds,
            "rows": [{"ours": a, "ours_s": ta, "reference": b, "reference_s": tb, "ratio": r}
                     for a, ta, b, tb, r in rows]}  # fmt: skip
    write_results("attach", data, table)


if __name__ == "__main__":
    main()
