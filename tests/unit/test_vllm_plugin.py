"""ferry_vllm's packaging: the entry point vLLM loads, and that nothing of Ferry needs vLLM to import.

vLLM is not installed here (docs/vllm.md); what runs against it is in tests/e2e/test_vllm_integration.py."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_namespace_packages

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What an engine installs: ferry-client (ferry.client, ferry_vllm, the plugin's entry point, the vllm extra).
CLIENT = tomllib.loads((ROOT / "dist" / "client" / "pyproject.toml").read_text())
# Where vLLM may be imported: the modules register() loads, and register() itself (lazily, in the function).
IMPORTS_VLLM = {"ferry_vllm/loader.py", "ferry_vllm/transfer.py", "ferry_vllm/__init__.py"}


def test_the_entry_point_is_declared_and_resolves_to_register():
    plugins = CLIENT["project"]["entry-points"]["vllm.general_plugins"]
    assert "entry-points" not in PYPROJECT["project"]  # one distribution declares it
    assert plugins == {"ferry": "ferry_vllm:register"}
    module, _, attr = plugins["ferry"].partition(":")
    target = getattr(importlib.import_module(module), attr)
    assert callable(target) and target.__module__ == "ferry_vllm"


def test_vllm_is_an_extra_ci_does_not_install():
    extras = CLIENT["project"]["optional-dependencies"]
    assert [d for d in extras["vllm"] if d.startswith("vllm")] == extras["vllm"]
    assert CLIENT["project"]["dependencies"] == ["torch>=2.4"]
    server = PYPROJECT["project"]
    assert not any(d.startswith("vllm") for d in server["dependencies"] + server["optional-dependencies"]["test"])


def test_the_package_ships():
    shipped = CLIENT["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert {"ferry/client", "ferry_vllm", "ferry/__init__.py"} <= set(shipped.values())
    assert all((ROOT / "dist" / "client" / src).exists() for src in shipped)
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    packages = set()
    for where in find["where"]:
        packages |= set(find_namespace_packages(str(ROOT / where), include=find["include"]))
    assert {"ferry_vllm", "ferry.client"} <= packages


def _vllm_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, at module level) of each `import vllm...` in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            found.append((node.lineno, id(node) in top))
    return found


def test_only_the_vllm_modules_import_vllm():
    importing = {}
    for base in ("ferry", "ferry_vllm", "agent", "operator"):
        for path in (ROOT / base).rglob("*.py"):
            if found := _vllm_imports(path):
                importing[str(path.relative_to(ROOT))] = found
    assert set(importing) == IMPORTS_VLLM
    assert not any(top for _, top in importing["ferry_vllm/__init__.py"])  # only inside register()


BLOCKED = (
    "vllm",
    "kopf",
    "kubernetes",
    "boto3",
    "botocore",
    "grpc",
    "nixl",
    "pydantic",
    "ferry_agent",
    "ferry_operator",
)
PROGRAM = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"blocked: {{name}}")
sys.meta_path.insert(0, Block())
import ferry_vllm, ferry_vllm.worker, ferry_vllm.refit, ferry_vllm._weights
try:
    ferry_vllm.register()
except ImportError as exc:
    print(exc)
"""


def test_imports_without_vllm_or_ferrys_stack_and_register_needs_vllm():
    """As in an engine image before vLLM loads it: the package imports; only register() reaches for vLLM."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "blocked: vllm", out.stdout


def test_settings_from_model_loader_extra_config(monkeypatch):
    from ferry_vllm._weights import Source

    assert Source.from_config({"model_load": "llama", "namespace": "serving", "timeout": "30", "rank": "0"}) == (
        Source("llama", "serving", 30.0, None, 0)
    )
    monkeypatch.setenv("FERRY_MODEL_LOAD", "from-env")
    assert Source.from_config(None).model_load == "from-env"
    with pytest.raises(ValueError, match="unknown Ferry settings"):
        Source.from_config({"model_load": "llama", "modelLoad": "typo"})
    monkeypatch.delenv("FERRY_MODEL_LOAD")
    with pytest.raises(ValueError, match="name the ModelLoad"):
        Source.from_config({})
