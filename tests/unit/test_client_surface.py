"""`ferry.client` has the surface issue 11 gives engines, and needs nothing beyond the standard library and torch
(a stricter form of test_client_imports: any module outside the standard library counts, not only a list)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import json, sys
import torch
before = {m.split(".")[0] for m in sys.modules}
import ferry.client
MODULES
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} - before - set(sys.stdlib_module_names))))
"""


def loaded_beyond_torch(imports: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    program = PROGRAM.replace("MODULES", imports)
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_client_and_the_vllm_glue_load_only_the_standard_library_beyond_torch():
    assert loaded_beyond_torch("import ferry_vllm, ferry_vllm.refit, ferry_vllm.worker") == ["ferry", "ferry_vllm"]


def test_the_check_sees_a_third_party_import():
    assert "yaml" in loaded_beyond_torch("import yaml")


def test_the_surface_of_the_issue():
    from ferry import client

    attach = inspect.signature(client.attach).parameters
    assert list(attach)[:2] == ["name", "namespace"] and attach["namespace"].default is None
    assert {"timeout", "version", "rank"} <= set(attach)
    assert attach["version"].default is None and attach["rank"].default is None
    load_into = inspect.signature(client.Attachment.load_into).parameters
    assert load_into["strict"].default is True and load_into["only_changed"].default is False
    assert list(inspect.signature(client.watch).parameters)[:2] == ["name", "namespace"]
    assert {"attach", "watch", "AttachError"} <= set(client.__all__)  # w.version, w.tensors(): tests/e2e/test_attach


def test_socket_dir_defaults_to_the_pods_own_directory(monkeypatch):
    from ferry.client import AttachError, socket_path

    monkeypatch.delenv("FERRY_SOCKET_DIR", raising=False)
    monkeypatch.setenv("POD_UID", "1234-abcd")
    assert str(socket_path()) == "/run/ferry/pods/1234-abcd/ferry.sock"
    monkeypatch.setenv("FERRY_SOCKET_DIR", "/ferry")
    assert str(socket_path()) == "/ferry/ferry.sock"
    monkeypatch.delenv("FERRY_SOCKET_DIR")
    monkeypatch.delenv("POD_UID")
    with pytest.raises(AttachError, match="FERRY_SOCKET_DIR"):
        socket_path()
