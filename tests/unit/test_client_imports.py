"""`ferry.client` runs in an engine image that has the standard library and torch, nothing of Ferry's own stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = (
    "kopf",
    "kubernetes",
    "boto3",
    "botocore",
    "grpc",
    "nixl",
    "safetensors",
    "pydantic",
    "ferry_agent",
    "ferry_operator",
)

PROGRAM = f"""
import importlib.abc, sys
BLOCKED = {BLOCKED!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {{name}}")
sys.meta_path.insert(0, Block())
from ferry.client import attach, AttachError, request
import ferry.client.protocol
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not loaded, loaded
print("ok")
"""


def test_client_imports_with_only_stdlib_and_torch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_blocker_bites():
    """The same program fails when the client would need a blocked package: the test can fail."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    program = PROGRAM.replace("from ferry.client import", "import kubernetes\nfrom ferry.client import")
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "blocked: kubernetes" in out.stderr
