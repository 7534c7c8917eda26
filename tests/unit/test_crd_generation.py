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


def _properties(schema: dict, path: str):
    """Every property of a structural schema, with its path (`[]` for list items, `{}` for map values)."""
    for name, prop in (schema.get("properties") or {}).items():
        yield f"{path}.{name}", prop
        yield from _properties(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _properties(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _properties(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("model", models.RESOURCES, ids=lambda m: m.kind)
def test_every_field_has_a_description(model):
    """`kubectl explain` shows each field's description: a field without one tells a user nothing."""
    schema = crdgen.openapi_schema(model)
    props = list(_properties(schema, model.kind.lower()))
    assert len(props) > 20
    # The root `metadata` is ObjectMeta, which a CRD schema may not describe (the apiserver explains it itself).
    undescribed = [
        path
        for path, prop in props
        if not (prop.get("description") or "").strip() and path != f"{model.kind.lower()}.metadata"
    ]
    assert not undescribed, f"fields without a docstring in ferry/api/models.py: {undescribed}"
    assert schema.get("description"), f"{model.kind} has no class docstring"


@pytest.mark.parametrize("model", models.RESOURCES, ids=lambda m: m.kind)
def test_descriptions_are_one_paragraph(model):
    """Docstrings wrap at the source's line length; the CRD carries them unwrapped, for kubectl to wrap."""
    for path, prop in _properties(crdgen.openapi_schema(model), model.kind.lower()):
        assert "\n" not in prop.get("description", ""), path


def test_required_follows_the_models():
    """`required` comes from the models (a field without a default), not from a fixed list."""
    version = crdgen.openapi_schema(models.WeightVersion)
    assert version["required"] == ["spec"]
    assert version["properties"]["spec"]["required"] == ["modelName", "format"]
    replica = crdgen.openapi_schema(models.WeightReplica)
    assert set(replica["properties"]["spec"]["required"]) == {"modelLoad", "modelName", "version", "nodeName"}
