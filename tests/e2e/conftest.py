"""The real operator (`kopf run` subprocess) against the session's local cluster and S3."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.operators import OperatorHandle


@pytest.fixture(scope="session")
def operator_handle(cluster, s3, tmp_path_factory) -> Iterator[OperatorHandle]:
    handle = OperatorHandle(cluster, s3, tmp_path_factory.mktemp("operator"))
    handle.start()
    yield handle
    handle.stop()


@pytest.fixture
def operator(operator_handle: OperatorHandle) -> OperatorHandle:
    operator_handle.ensure_running()
    return operator_handle


@pytest.fixture
def socket_root() -> Iterator[Path]:
    """The agent's attach socket directory: short, under /tmp, since a Unix socket path is at most 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="ferry-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)
