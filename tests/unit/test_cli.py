"""The `ferry` command itself: `ferry --version` prints the package's one version."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ferry

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_version():
    proc = subprocess.run(
        [sys.executable, "-m", "ferry.cli", "--version"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ferry {ferry.__version__}"
