"""Real pods: a `LocalCluster(pods=True)` with two kubelet nodes (ferry_dev.localnodes), SeaweedFS reachable from pods,
and the dev images (ferry_dev.localimages) imported into each node's containerd."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ferry_dev import localimages
from ferry_dev.localcluster import LocalCluster, S3Server
from ferry_dev.localnodes import HOST_IP, NodePool

IMAGE_TAG = "0.1.0"


@dataclass
class PodStack:
    cluster: LocalCluster
    s3: S3Server
    nodes: NodePool
    s3_endpoint: str  # as pods (and this machine) reach it
    image_tag: str = IMAGE_TAG


@pytest.fixture(scope="module")
def pod_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodStack]:
    root: Path = tmp_path_factory.mktemp("pods")
    images = list(localimages.dev_images(IMAGE_TAG).values())
    cluster = LocalCluster(root / "k8s", pods=True)
    s3 = S3Server(root / "s3")
    nodes = NodePool(cluster, root / "nodes", count=2)
    try:
        cluster.start()
        s3.start()
        nodes.start(images)
        nodes.forward(s3.port, "s3")
        yield PodStack(cluster, s3, nodes, f"http://{HOST_IP}:{s3.port}")
    finally:
        nodes.stop()
        s3.stop()
        cluster.stop()
