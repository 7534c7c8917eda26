"""The real `helm` binary against the chart in charts/ferry: run it, render the chart into objects."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ferry_dev.localcluster import binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ferry"
KUBE_VERSION = "1.36.3"


def helm(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([binary("helm"), *args], capture_output=True, text=True, env=env, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    return proc


def render(env: dict[str, str], *values: str, namespace: str = "ferry-system", release: str = "ferry") -> list[dict]:
    import yaml

    out = helm(env, "template", release, str(CHART), "--kube-version", KUBE_VERSION, "-n", namespace, *values).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def sets(**values: str) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key.replace('__', '.')}={value}")]
