"""The Helm chart renders the generated CRDs once, from charts/ferry/templates/crds.yaml, which
hack/sync-chart-crds.sh makes from crds/ferry.dev_*.yaml. It ships no crds/ directory (Helm would install those too,
and never upgrade them).

Fix a failure with `make crds` (or `bash hack/sync-chart-crds.sh`); never edit the template by hand.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "crds"
CHART = ROOT / "charts" / "ferry"
TEMPLATE = CHART / "templates" / "crds.yaml"
FIX = "run `bash hack/sync-chart-crds.sh`"


def test_chart_template_is_rendered_from_crds(tmp_path):
    fresh = tmp_path / "crds.yaml"
    subprocess.run(["bash", str(ROOT / "hack" / "sync-chart-crds.sh"), str(fresh)], check=True, capture_output=True)
    assert TEMPLATE.exists(), f"{TEMPLATE} missing; {FIX}"
    assert TEMPLATE.read_text() == fresh.read_text(), f"{TEMPLATE.name} is stale; {FIX}"


def test_chart_ships_no_crds_directory():
    # Helm installs everything in crds/ once and never upgrades it: the CRDs would be in the chart twice.
    assert not (CHART / "crds").exists(), "charts/ferry/crds/ must not exist: the CRDs render from templates/crds.yaml"


def test_template_holds_every_crd_unchanged_but_labels_and_annotations():
    """Without its Helm actions, the template is the generated CRDs, each with a `labels` and an `annotations` key
    added to its metadata."""
    text = TEMPLATE.read_text()
    plain = "\n".join(line for line in text.splitlines() if "{{" not in line)
    docs = [d for d in yaml.safe_load_all(plain) if d]
    source = [yaml.safe_load(p.read_text()) for p in sorted(SOURCE.glob("ferry.dev_*.yaml"))]
    assert source, f"no generated CRDs in {SOURCE}"
    for doc in docs:
        assert doc["metadata"].pop("labels") is None  # filled by the include that was dropped above
        assert doc["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert docs == source
    # Behind crds.enabled and, for the annotation, crds.keep.
    assert re.match(r"(?s)\{\{-? /\*.*?\*/ -?\}\}\n\{\{- if \.Values\.crds\.enabled \}\}\n", text)
    assert text.rstrip().endswith("{{- end }}")
    assert text.count("{{- if .Values.crds.keep }}") == len(source)
