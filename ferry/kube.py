"""The Kubernetes client every Ferry process uses: an explicit kubeconfig, else the pod's ServiceAccount, else
$KUBECONFIG (or ~/.kube/config)."""

from __future__ import annotations

from typing import Any


def kube_client(kubeconfig: str | None = None) -> Any:
    from kubernetes import client, config  # imported on use: `ferry publish --no-apply` never needs it

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()
