"""Helpers for unit tests of the per-rank Worker gRPC service (`ferry_agent.transport.worker_service`) and of who may
call it: a served identity and manifest, a clock moved by hand, and the status code of a refused call."""

from __future__ import annotations

import grpc
import pytest
import torch

from ferry_agent.store.resident import ResidentWeights
from ferry_agent.transport.proto import worker_pb2
from ferry_agent.transport.worker_service import SourceIdentity, build_manifest

IDENTITY = SourceIdentity("src-agent", "inst-1")


class FakeClock:
    """Monotonic seconds that move only when a test sets `now`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def weights() -> ResidentWeights:
    return ResidentWeights({"w": torch.arange(16, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)})


def manifest_proto(identity: SourceIdentity = IDENTITY) -> worker_pb2.TensorManifest:
    """The manifest of `weights()` as rank 2 of `identity` serves it."""
    return build_manifest(weights(), identity=identity, rank=2, nixl_metadata=b"nixl-blob")


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    """The gRPC status code `call()` fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()
