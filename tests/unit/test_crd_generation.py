"""The CRD YAML in crds/ is generated from the pydantic models and must never go stale."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ferry.api import crdgen, models

pytestmark = pytest.mark.unit

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"


@pytest.mark.parametrize("model", models.RESOURCES, ids=lambda m: m.kind)
def test_checked_in_crd_matches_models(model):
    path = CRD_DIR / crdgen.crd_filename(model)
    assert path.exists(), f"{path} missing: run `make crds`"
    assert path.read_text() == crdgen.render(model), f"{path.name} is stale: run `make crds` and commit the result"


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


@pytest.mark.parametrize("model", models.RESOURCES, ids=lambda m: m.kind)
def test_schema_is_structural(model):
    schema = crdgen.openapi_schema(model)
    for path, node in _walk(schema):
        if isinstance(node, dict):
            assert "$ref" not in node, path
            assert "anyOf" not in node, path
            assert node.get("type") != "null", path


@pytest.mark.parametrize("model", models.RESOURCES, ids=lambda m: m.kind)
def test_names_printer_columns_and_category(model):
    crd = yaml.safe_load(crdgen.render(model))
    names = crd["spec"]["names"]
    assert names["categories"] == ["ferry"]
    assert names["shortNames"] == model.short_names
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert version["additionalPrinterColumns"][-1]["name"] == "Age"


def test_weightversion_columns_follow_the_design():
    columns = [c["name"] for c in crdgen.crd(models.WeightVersion)["spec"]["versions"][0]["additionalPrinterColumns"]]
    for wanted in ("Phase", "Ready", "Model", "Base", "Depth", "Size", "Age"):
        assert wanted in columns


def test_modelload_columns_follow_the_design():
    cols = crdgen.crd(models.ModelLoad)["spec"]["versions"][0]["additionalPrinterColumns"]
    by_name = {c["name"]: c for c in cols}
    assert {"Desired", "Ready", "Phase", "Reason", "Age"} <= set(by_name)
    assert by_name["Reason"].get("priority") == 1, "Reason belongs to -o wide"
