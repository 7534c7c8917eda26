"""Attach against the usual ways of getting weights into a process, ratios from one run.

1. `attach` + `tensors()` of a version (sealed memfd chunks, mapped read-only) vs `safetensors.torch.load_file`
   of the same checkpoint from local disk (page cache warm: the reference at its best), read into memory
   (`backend="pread"`). Attach maps; it does not copy, so this is the zero-copy claim. safetensors' default
   `backend="mmap"` maps the file lazily too, so it is shown as well, both then reading every byte once.
2. `load_into` a module vs a plain `copy_` of the same tensors, from the same source memory under the same
   conditions: a fresh attach each round, so both map the chunks' 4 KiB pages in first. A `copy_` from ordinary,
   already mapped memory is shown as well: the difference is what mapping a fresh mapping's pages costs.
3. Refit: `load_into(only_changed=True)` of a version that differs in 10% of the bytes vs a full `load_into`; the
   new version shares the held one's unchanged chunks (host memory of both is shown).

The agent side (HostStore + AttachServer) runs in this process over a real Unix socket; the consumer side is
`ferry.client`. Writes bench/results/attach.json and attach.md.
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
    from bench._common import add_shmem_argument, shmem_huge_pages, write_results
except ImportError:  # run as a script
    from _common import add_shmem_argument, shmem_huge_pages, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "agent")]

from ferry.client import attach  # noqa: E402
from ferry_agent.attach.memstore import HostStore  # noqa: E402
from ferry_agent.attach.server import AttachServer, Pod  # noqa: E402
from ferry_agent.attach.service import AttachService  # noqa: E402
from ferry_agent.store.resident import ResidentWeights, spec_of  # noqa: E402

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


def resident(store: HostStore, key, tensors: dict[str, torch.Tensor], version: str, share=None) -> ResidentWeights:
    """As a loader leaves a version: written into the store's memory (unless shared), then sealed in place."""
    target = store.allocate(key, [spec_of(n, t) for n, t in tensors.items()], version, share)
    for name, t in tensors.items():
        if name not in target.shared:
            target.tensors[name].copy_(t)
    store.seal(target, version, version, f"uid-{version}")
    return target


def touch(tensors) -> None:
    """Read every byte once (what any use of the weights does first)."""
    for t in tensors.values():
        t.view(torch.uint8).max()


def paired(fns, rounds: int) -> list[float]:
    """Median seconds of each of `fns`, run in turns within every round (the order rotating), so that drift on
    shared cores weighs on all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in (list(range(len(fns))) * 2)[r % len(fns) :][: len(fns)]:
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    add_shmem_argument(parser)
    args = parser.parse_args()
    with shmem_huge_pages(args.shmem_huge_pages) as mode:
        run(args, mode)


def run(args: argparse.Namespace, mode: str | None) -> None:
    nbytes = args.size_mib << 20
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ferry-b-", dir="/tmp"))
    service = AttachService(None, "bench", root)
    service.server.start()
    store = HostStore()
    try:
        server: AttachServer = service.server
        uid = str(uuid.uuid4())
        server.add_pod(Pod(uid, "bench", "engine"))
        pod_dir = server.pods_dir / uid
        key, spec = ("bench", "ml-bench"), {"modelLoad": "ml", "modelName": "m"}
        v1 = weights(nbytes, seed=1)
        r1 = resident(store, key, v1, "v1")
        service.serve(key, {**spec, "version": "v1"}, r1, "uid-1")
        r1.host.sealed.unref()  # the offer holds it from here on (as the replica would)
        del r1

        # 1. attach + tensors() vs load_file (warm page cache): read into memory, and mapped (then both touched).
        checkpoint = root / "v1.safetensors"
        save_file(v1, str(checkpoint))
        load_file(str(checkpoint), backend="pread")  # warm the page cache

        def attach_views() -> None:
            with attach("ml", socket_dir=pod_dir, timeout=5) as w:
                assert len(w.tensors()) == len(v1)

        def attach_touched() -> None:
            with attach("ml", socket_dir=pod_dir, timeout=5) as w:
                touch(w.tensors())

        t_attach, t_pread = paired([attach_views, lambda: load_file(str(checkpoint), backend="pread")], args.rounds)
        t_attach_touched, t_mmap_touched = paired(
            [attach_touched, lambda: touch(load_file(str(checkpoint)))], args.rounds
        )

        # 2. load_into vs copy_ of the same attached tensors (a fresh attach each round), and vs warm private memory.
        module = Flat(v1)
        params = dict(module.named_parameters())

        def attached_copy() -> None:
            with attach("ml", socket_dir=pod_dir, timeout=5) as w, torch.no_grad():
                for name, t in w.tensors().items():
                    params[name].copy_(t)

        def warm_copy() -> None:
            with torch.no_grad():
                for name, t in v1.items():
                    params[name].copy_(t)

        def load_into() -> None:
            with attach("ml", socket_dir=pod_dir, timeout=5) as w:
                w.load_into(module)

        t_copy, t_load_into, t_warm = paired([attached_copy, load_into, warm_copy], args.rounds)

        # 3. refit of a version changed in 10% of its tensors vs a full load_into of it, each from a fresh attach
        # into a module that holds v1 (loaded from v1's attachment, which stays leased across the switch).
        changed = sorted(v1)[: max(1, len(v1) // 10)]
        v2 = {n: (t + 1 if n in changed else t) for n, t in v1.items()}
        w1 = attach("ml", socket_dir=pod_dir, timeout=5, version="v1")
        service.withdraw(key)
        r2 = resident(store, key, v2, "v2", share=lambda held: [n for n in v1 if n not in changed])
        service.serve(key, {**spec, "version": "v2"}, r2, "uid-2")
        r2.host.sealed.unref()
        del r2
        resident_both = store.resident_bytes(key)
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
        ("attach + tensors()", t_attach, "safetensors load_file, pread (warm cache)", t_pread, t_pread / t_attach),
        ("load_into", t_load_into, "plain copy_ of the same attached tensors", t_copy, t_copy / t_load_into),
        ("refit, 10% changed", t_refit, "full load_into", t_full, t_full / t_refit),
    ]
    shown = [
        (
            "attach + read every byte",
            t_attach_touched,
            "load_file, mmap (default), read every byte",
            t_mmap_touched,
            t_mmap_touched / t_attach_touched,
        ),
        ("load_into", t_load_into, "plain copy_ from warm private memory", t_warm, t_warm / t_load_into),
    ]
    mib = args.size_mib
    both = f"{resident_both / 2**20:.0f} MiB resident for v1 + v2 ({2 * nbytes / 2**20:.0f} MiB as two copies)"
    table = "\n".join(
        [
            f"attach, {mib} MiB in {len(v1)} tensors (median of {args.rounds} paired rounds), shmem huge pages "
            f"`{mode}`",
            "",
            "| ours | s | reference | s | reference / ours |",
            "|---|---|---|---|---|",
        ]
        + [f"| {a} | {ta:.4f} | {b} | {tb:.4f} | {r:.2f} |" for a, ta, b, tb, r in rows]
        + [
            "",
            "Shown alongside (no target):",
            "",
            "| ours | s | reference | s | reference / ours |",
            "|---|---|---|---|---|",
        ]
        + [f"| {a} | {ta:.4f} | {b} | {tb:.4f} | {r:.2f} |" for a, ta, b, tb, r in shown]
        + ["", f"Refit memory: {both}."]
    )
    data = {
        "size_mib": mib,
        "tensors": len(v1),
        "rounds": args.rounds,
        "shmem_huge_pages": mode,
        "resident_bytes_v1_v2": resident_both,
        "rows": [{"ours": a, "ours_s": ta, "reference": b, "reference_s": tb, "ratio": r} for a, ta, b, tb, r in rows],
        "shown": [
            {"ours": a, "ours_s": ta, "reference": b, "reference_s": tb, "ratio": r} for a, ta, b, tb, r in shown
        ],
    }
    write_results("attach", data, table)


if __name__ == "__main__":
    main()
