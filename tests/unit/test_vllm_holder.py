"""ferry_vllm's Holder (what the loader, the weight-transfer engine and the worker extension share) against the
real attach server over a real Unix socket: what it feeds to `load_weights`, and which leases it holds."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from ferry_agent.attach.memstore import seal_tensors
from ferry_agent.attach.server import AttachServer, Offer, Pod
from ferry_vllm._weights import Holder, Source, check_in_place, holder_for

pytestmark = pytest.mark.unit


class Model(torch.nn.Module):
    """A module with vLLM's `load_weights` contract: (checkpoint name, tensor) pairs in, loaded names out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4, 4))
        self.b = torch.nn.Parameter(torch.zeros(8))
        self.fed: list[list[str]] = []
        self.fail = False

    def load_weights(self, weights) -> set[str]:
        names = []
        with torch.no_grad():
            for name, tensor in weights:
                if self.fail:
                    raise RuntimeError("a weight loader failed")
                getattr(self, name).copy_(tensor)
                names.append(name)
        self.fed.append(names)
        return set(names)


def version(seed: int, base: dict | None = None, change: str | None = None) -> dict[str, torch.Tensor]:
    if base is not None:
        return {n: (t + 1 if n == change else t.clone()) for n, t in base.items()}
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn((4, 4), generator=gen), "b": torch.randn(8, generator=gen)}


@pytest.fixture
def agent():
    root = Path(tempfile.mkdtemp(prefix="ferry-v-", dir="/tmp"))
    srv = AttachServer(root)
    srv.start()
    pod = Pod(str(uuid.uuid4()), "ns", "engine")
    srv.add_pod(pod)
    yield srv, srv.pods_dir / pod.uid
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


def serve(srv: AttachServer, name: str, tensors: dict, base: tuple[str, dict] | None = None) -> None:
    """Offer `name` as the agent's attach service does: with a base, the manifest says what changed."""
    sealed = seal_tensors(tensors, f"ns/m/{name}")
    if base is not None:
        sealed.base_uid = f"uid-{base[0]}"
        sealed.changed = frozenset(n for n in tensors if not torch.equal(tensors[n], base[1][n]))
    srv.offer(("ns", "wr"), Offer("ns", "ml", "m", name, f"uid-{name}", sealed))


def leased(srv: AttachServer) -> list[tuple[str, int]]:
    return [(v["version"], v["attached"]) for v in srv.snapshot()]


def test_load_refit_reload_and_make_before_break(agent):
    srv, pod_dir = agent
    v1 = version(1)
    serve(srv, "v1", v1)
    model = Model()
    holder = Holder(Source("ml", timeout=5, socket_dir=str(pod_dir)))

    holder.load(model)
    assert model.fed == [["a", "b"]] and torch.equal(model.a, v1["a"]) and holder.version == "v1"
    assert leased(srv) == [("v1", 1)]  # held while the model holds it
    holder.load(model, only_changed=True)  # the version it holds: nothing to feed
    assert model.fed == [["a", "b"]]
    holder.load(model)  # a reload (vLLM may have dropped the weights) feeds all
    holder.finish()
    assert model.fed == [["a", "b"], ["a", "b"]] and leased(srv) == [("v1", 1)]

    v2 = version(0, v1, change="b")
    serve(srv, "v2", v2, base=("v1", v1))
    result = holder.load(model, only_changed=True)
    assert result.sent == ["b"] and result.skipped == ["a"] and torch.equal(model.b, v2["b"])
    assert sorted(leased(srv)) == [("v1", 1), ("v2", 1)]  # make before break
    holder.finish()
    assert leased(srv) == [("v2", 1)]
    holder.close()
    assert leased(srv) == [("v2", 0)]


def test_a_failed_load_holds_no_version_so_the_next_feeds_all(agent):
    srv, pod_dir = agent
    v1 = version(1)
    serve(srv, "v1", v1)
    model = Model()
    holder = Holder(Source("ml", timeout=5, socket_dir=str(pod_dir)))
    holder.load(model)
    v2 = version(0, v1, change="b")
    serve(srv, "v2", v2, base=("v1", v1))
    model.fail = True
    with pytest.raises(RuntimeError, match="weight loader failed"):
        holder.load(model, only_changed=True)
    assert holder.version is None and sorted(leased(srv)) == [("v1", 1), ("v2", 0)]
    model.fail = False
    assert holder.load(model, only_changed=True).sent == ["a", "b"]
    holder.close()


def test_one_holder_per_model_and_modelload():
    model = Model()
    with pytest.raises(ValueError, match="not loaded by Ferry"):
        holder_for(model)
    first = holder_for(model, Source("ml", timeout=120))
    assert holder_for(model) is first and holder_for(model, Source("ml", "ns", timeout=600)) is first
    assert holder_for(model, Source("other")) is not first


def test_refit_in_place_refuses_a_quantized_model():
    check_in_place(None)
    with pytest.raises(NotImplementedError, match="fp8"):
        check_in_place("fp8")
