"""Fixtures of the S3 strategy tests (the session's S3 with their bucket, a fresh prefix, a checkpoint store) and of
the chart tests (a private Helm home)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferry_agent.store.checkpoints import CheckpointStore
from ferry_dev.localcluster import S3Server
from tests.support.operators import OperatorHandle
from tests.support.s3 import BUCKET, Registry, Weights, evolve, weights


@pytest.fixture(autouse=True, scope="module")
def no_operator() -> None:
    """These tests play the operator's part themselves (statuses set by hand): the session's operator, which an e2e
    file run earlier in the same process (pytest-xdist sends whole files to each worker) may have left running,
    must not write over them."""
    OperatorHandle.stop_all()


@pytest.fixture(scope="module")
def s3_server(s3: S3Server) -> S3Server:
    """The session's SeaweedFS (tests/conftest.py), with this module's bucket."""
    s3.create_bucket(BUCKET)
    return s3


@pytest.fixture
def registry(s3_server: S3Server) -> Registry:
    return Registry(s3_server)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    s = CheckpointStore(tmp_path / "store", quota_bytes=1 << 30)
    yield s
    s.close()


@pytest.fixture(scope="module")
def chain3() -> tuple[Weights, Weights, Weights]:
    w1 = weights(1)
    w2 = evolve(w1, 2, ["embed.weight", "layers.0.attn.weight", "mask"])
    w3 = evolve(w2, 3, ["layers.0.mlp.weight", "norm.scale", "embed.weight", "step"])
    return w1, w2, w3


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Helm's cache/config/data dirs in a temp dir, so the tests never touch ~/.config/helm."""
    home = tmp_path_factory.mktemp("helm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_") and k != "KUBECONFIG"}
    for kind in ("CACHE", "CONFIG", "DATA"):
        env[f"HELM_{kind}_HOME"] = str(home / kind.lower())
    return env
