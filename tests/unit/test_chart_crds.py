"""The Helm chart ships the generated CRDs unchanged: charts/ferry/crds/ must equal crds/ferry.dev_*.yaml.

Fix a failure with `bash hack/sync-chart-crds.sh` (after `make crds`); never edit the chart's copies by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "crds"
CHART_CRDS = ROOT / "charts" / "ferry" / "crds"
FIX = "run `bash hack/sync-chart-crds.sh`"


def _crds(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("ferry.dev_*.yaml"))}


def test_chart_has_every_generated_crd():
    source = _crds(SOURCE)
    assert source, f"no generated CRDs in {SOURCE}"
    chart = _crds(CHART_CRDS)
    missing = sorted(set(source) - set(chart))
    extra = sorted(set(chart) - set(source))
    assert not missing and not extra, f"chart CRDs differ from crds/: missing {missing}, extra {extra}; {FIX}"


def test_chart_crds_are_byte_identical():
    source = _crds(SOURCE)
    chart = _crds(CHART_CRDS)
    stale = sorted(name for name in source.keys() & chart.keys() if source[name] != chart[name])
    assert not stale, f"chart copies are stale: {stale}; {FIX}"


def test_chart_crds_dir_holds_only_crds():
    # Helm applies every file in crds/; anything else there would be installed (and never removed).
    others = sorted(p.name for p in CHART_CRDS.iterdir() if not p.name.startswith("ferry.dev_"))
    assert not others, f"unexpected files in {CHART_CRDS}: {others}"
