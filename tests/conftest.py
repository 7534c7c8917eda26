"""Session-wide real infrastructure: one local etcd + kube-apiserver + kube-controller-manager and one SeaweedFS
S3 server, started on first use and torn down at the end of the run (also on failure)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferry_dev.localcluster import LocalCluster, S3Server, local_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, S3Server]]:
    root: Path = tmp_path_factory.mktemp("stack")
    with local_stack(root) as (cluster, s3):
        yield cluster, s3


@pytest.fixture(scope="session")
def cluster(stack: tuple[LocalCluster, S3Server]) -> LocalCluster:
    return stack[0]


@pytest.fixture(scope="session")
def s3(stack: tuple[LocalCluster, S3Server]) -> S3Server:
    return stack[1]


@pytest.fixture(scope="session")
def kube(cluster: LocalCluster):
    """An official-client ApiClient bound to the local cluster."""
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield api
    api.close()
    del client


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
