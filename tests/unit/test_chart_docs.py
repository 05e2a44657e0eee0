"""docs/api.md documents every field of both CRDs (helm/gpualloc/crds/, the source of truth)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = sorted((ROOT / "helm" / "gpualloc" / "crds").glob("*.yaml"))
API_DOC = ROOT / "docs" / "api.md"


def field_paths(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from field_paths(sub, f"{path}.{name}")
    items = schema.get("items") or {}
    for name, sub in (items.get("properties") or {}).items():
        yield from field_paths(sub, f"{path}[].{name}")


def crd_fields(crd_path: Path) -> list[tuple[str, dict[str, Any]]]:
    crd = yaml.safe_load(crd_path.read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return [f for top in ("spec", "status") for f in field_paths(root["properties"][top], top)]


@pytest.mark.parametrize("crd_path", CRDS, ids=lambda p: p.stem)
def test_api_doc_has_a_row_for_every_crd_field_with_its_enum_values_and_default(crd_path: Path) -> None:
    doc = API_DOC.read_text()
    kind = yaml.safe_load(crd_path.read_text())["spec"]["names"]["kind"]
    section = doc.split(f"## {kind}\n", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`"): line for line in section.splitlines() if line.startswith("| `")
    }
    for path, schema in crd_fields(crd_path):
        assert path in rows, f"docs/api.md ({kind}) has no row for {path}"
        for value in schema.get("enum", []):
            assert f"`{value}`" in rows[path], f"{path}: enum value {value} missing"
        if "default" in schema and schema["default"] != {}:
            assert f"`{schema['default']}`" in rows[path], f"{path}: default missing"
        if "maximum" in schema:
            assert str(schema["maximum"]) in rows[path], f"{path}: maximum missing"


def validation_messages(schema: dict[str, Any]) -> Iterator[str]:
    """The message of every CEL rule in ``schema`` and below it."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield rule["message"]
    for sub in (schema.get("properties") or {}).values():
        yield from validation_messages(sub)
    if schema.get("items"):
        yield from validation_messages(schema["items"])


def test_api_doc_quotes_every_crd_rule_message_as_the_api_server_gives_it() -> None:
    doc = API_DOC.read_text()
    messages = {
        crd_path.name: list(
            validation_messages(
                yaml.safe_load(crd_path.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            )
        )
        for crd_path in CRDS
    }
    assert messages["gpuclaims.yaml"] and messages["gpunodestatuses.yaml"]
    missing = [(name, m) for name, found in messages.items() for m in found if m not in doc]
    assert missing == []
