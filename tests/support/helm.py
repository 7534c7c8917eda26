"""The real `helm` binary against the chart in charts/ferry: run it, render the chart into objects; the example engine
chart (examples/vllm-engine) made installable from a copy."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from ferry_dev.localcluster import binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ferry"
CONSUMER_LIBRARY = ROOT / "charts" / "ferry-consumer"
EXAMPLE_ENGINE = ROOT / "examples" / "vllm-engine"
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


def vendored_example(dest: Path, run_helm: Callable[..., object]) -> Path:
    """examples/vllm-engine copied under `dest`, the library it depends on found by absolute path and vendored by
    `helm dependency build` (`run_helm(*args)` runs helm)."""
    import yaml

    chart = dest / EXAMPLE_ENGINE.name
    shutil.copytree(EXAMPLE_ENGINE, chart, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    (dep,) = meta["dependencies"]
    assert dep["repository"] == "file://../../charts/ferry-consumer"  # what the repository's layout needs
    dep["repository"] = f"file://{CONSUMER_LIBRARY}"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    run_helm("dependency", "build", str(chart))
    return chart
