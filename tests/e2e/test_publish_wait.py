"""`ferry publish --wait` against the real operator: a version that only its publisher can mend ends the wait at
once, with the operator's reason and exit status 1, instead of running out the timeout."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from safetensors.numpy import save_file

from ferry.cli import main

pytestmark = pytest.mark.e2e

BUCKET = "ferry-publish-wait"


def test_wait_ends_at_once_when_only_the_user_can_fix_the_version(
    s3, cluster, namespace, operator, tmp_path, capsys, monkeypatch
) -> None:
    """The operator verifies with the Secret's keys, which S3 refuses (AccessDenied)."""
    s3.create_bucket(BUCKET)
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "wrong"},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": "not-the-key"},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    source = tmp_path / "w"
    source.mkdir()
    save_file({"layers.0.weight": np.ones((16, 16), np.float32)}, source / "model.safetensors")
    args = [
        "publish",
        str(source),
        "--version=f1",
        f"--uri-prefix=s3://{BUCKET}/{uuid.uuid4().hex[:8]}",
        f"--endpoint={s3.endpoint}",
        f"--kubeconfig={cluster.kubeconfig}",
        f"--namespace={namespace}",
        "--model=tiny",
        "--credentials-secret=wrong",
        "--wait",
        "--timeout=300",
        "-q",
    ]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "failed (Failed: AccessDenied" in err, err
