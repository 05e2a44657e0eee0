"""The Python models and the CRD schemas describe the same fields (neither can drift).

The CRD YAML in helm/gpualloc/crds/ is the source of truth. For each model the
test walks the dataclass fields (``codecs.model_fields``) alongside the schema:
every model field exists in the schema with a matching type, every schema
property exists in the model, a field the model requires is required by the
schema, scalar defaults agree, and the enums equal the tuples in ``constants``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpualloc.api import codecs, constants, models

CRD_DIR = Path(__file__).resolve().parents[2] / "helm" / "gpualloc" / "crds"


def _schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRD_DIR / f"{plural}.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == constants.VERSION]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


CLAIM = _schema(constants.CLAIM_PLURAL)
NODE_STATUS = _schema(constants.NODE_STATUS_PLURAL)
QUOTA = _schema(constants.QUOTA_PLURAL)

ROOTS = [
    ("GpuClaim.spec", models.GpuClaimSpec, CLAIM["properties"]["spec"]),
    ("GpuClaim.status", models.GpuClaimStatus, CLAIM["properties"]["status"]),
    ("GpuNodeStatus.spec", models.GpuNodeStatusSpec, NODE_STATUS["properties"]["spec"]),
    ("GpuNodeStatus.status", models.NodeInventory, NODE_STATUS["properties"]["status"]),
    ("GpuQuota.spec", models.GpuQuotaSpec, QUOTA["properties"]["spec"]),
    ("GpuQuota.status", models.GpuQuotaStatus, QUOTA["properties"]["status"]),
]


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner
    return tp


def _walk(path: str, cls: type, schema: Mapping[str, Any]) -> Iterator[tuple[str, type, Mapping[str, Any]]]:
    """(path, dataclass, schema) for ``cls`` and every dataclass reachable from it."""
    yield path, cls, schema
    properties = schema.get("properties", {})
    for key, _field, tp in codecs.model_fields(cls):
        if key not in properties:
            continue  # reported by the test below
        sub, inner = properties[key], _unwrap_optional(tp)
        while typing.get_origin(inner) is tuple:
            inner, sub = typing.get_args(inner)[0], sub.get("items", {})
        if dataclasses.is_dataclass(inner) and isinstance(inner, type):
            yield from _walk(f"{path}.{key}", inner, sub)


PAIRS = [pair for root in ROOTS for pair in _walk(*root)]
PAIR_IDS = [path for path, _, _ in PAIRS]


def test_walk_reaches_every_nested_model() -> None:
    reached = {cls for _, cls, _ in PAIRS}
    assert {
        models.DeviceRequest,
        models.LabelSelector,
        models.SelectorRequirement,
        models.Topology,
        models.RetryPolicy,
        models.Allocation,
        models.DeviceRef,
        models.Condition,
        models.Device,
        models.MigInfo,
        models.MigDevice,
        models.Link,
        models.ProductLimit,
        models.Toleration,
    } <= reached


@pytest.mark.parametrize(("path", "cls", "schema"), PAIRS, ids=PAIR_IDS)
def test_every_model_field_is_in_the_crd_schema(path: str, cls: type, schema: Mapping[str, Any]) -> None:
    properties = schema.get("properties", {})
    missing = [key for key, _, _ in codecs.model_fields(cls) if key not in properties]
    assert not missing, f"{cls.__name__} fields not in the CRD at {path}: {missing}"


@pytest.mark.parametrize(("path", "cls", "schema"), PAIRS, ids=PAIR_IDS)
def test_every_crd_property_is_in_the_model(path: str, cls: type, schema: Mapping[str, Any]) -> None:
    fields = {key for key, _, _ in codecs.model_fields(cls)}
    missing = sorted(set(schema.get("properties", {})) - fields)
    assert not missing, f"CRD properties at {path} missing from {cls.__name__}: {missing}"


def _schema_type(tp: Any) -> str:
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "array"
    if dataclasses.is_dataclass(tp) or origin in (Mapping, dict) or tp is dict:
        return "object"
    return {int: "integer", str: "string", bool: "boolean"}[tp]


@pytest.mark.parametrize(("path", "cls", "schema"), PAIRS, ids=PAIR_IDS)
def test_model_field_types_match_the_crd(path: str, cls: type, schema: Mapping[str, Any]) -> None:
    properties = schema.get("properties", {})
    wrong = {
        key: (_schema_type(tp), properties[key].get("type"))
        for key, _, tp in codecs.model_fields(cls)
        if key in properties and _schema_type(tp) != properties[key].get("type")
    }
    assert not wrong, f"{path}: model type vs CRD type: {wrong}"


@pytest.mark.parametrize(("path", "cls", "schema"), PAIRS, ids=PAIR_IDS)
def test_fields_the_model_requires_are_required_by_the_crd(
    path: str, cls: type, schema: Mapping[str, Any]
) -> None:
    required_by_model = {
        key
        for key, field, _ in codecs.model_fields(cls)
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    }
    assert required_by_model <= set(schema.get("required", [])), path


@pytest.mark.parametrize(("path", "cls", "schema"), PAIRS, ids=PAIR_IDS)
def test_scalar_defaults_in_the_crd_equal_the_model_defaults(
    path: str, cls: type, schema: Mapping[str, Any]
) -> None:
    properties = schema.get("properties", {})
    for key, field, _ in codecs.model_fields(cls):
        crd_default = properties.get(key, {}).get("default")
        if crd_default is None or isinstance(crd_default, dict | list):
            continue
        assert field.default == crd_default, f"{path}.{key}: model {field.default!r} vs CRD {crd_default!r}"


def _at(schema: Mapping[str, Any], *keys: str) -> Mapping[str, Any]:
    node: Any = schema
    for key in keys:
        node = node["items"] if key == "[]" else node["properties"][key]
    return typing.cast(Mapping[str, Any], node)


@pytest.mark.parametrize(
    ("schema", "keys", "expected"),
    [
        (CLAIM, ("spec", "devices", "exclusivity"), constants.EXCLUSIVITIES),
        (CLAIM, ("spec", "devices", "policy"), constants.POLICIES),
        (CLAIM, ("spec", "topology", "mode"), constants.TOPOLOGY_MODES),
        (CLAIM, ("spec", "strategy"), constants.STRATEGIES),
        (CLAIM, ("spec", "selector", "matchExpressions", "[]", "operator"), constants.SELECTOR_OPERATORS),
        (CLAIM, ("status", "phase"), constants.PHASES),
        (NODE_STATUS, ("status", "source"), constants.SOURCES),
        (NODE_STATUS, ("status", "devices", "[]", "health"), (constants.HEALTHY, constants.UNHEALTHY)),
    ],
    ids=["exclusivity", "policy", "topology-mode", "strategy", "operator", "phase", "source", "health"],
)
def test_crd_enum_equals_the_constants_tuple(
    schema: Mapping[str, Any], keys: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    assert tuple(_at(schema, *keys)["enum"]) == expected


def test_a_quotas_allowed_tolerations_have_the_claims_toleration_schema() -> None:
    assert _at(QUOTA, "spec", "allowedTolerations", "[]") == _at(CLAIM, "spec", "tolerations", "[]")


def test_link_type_pattern_accepts_every_known_link_type_and_nothing_else() -> None:
    pattern = re.compile(_at(NODE_STATUS, "status", "links", "[]", "type")["pattern"])

    for link_type in (*constants.LINK_TYPES_PCIE, "NV1", "NV12", "NV18"):
        assert pattern.search(link_type), link_type
    for bogus in ("NV", "NVLINK", "PCI", "nv12", ""):
        assert not pattern.search(bogus), bogus


def test_status_fields_the_printer_columns_read_exist_in_the_schema() -> None:
    for plural, schema in ((constants.CLAIM_PLURAL, CLAIM), (constants.NODE_STATUS_PLURAL, NODE_STATUS)):
        crd = yaml.safe_load((CRD_DIR / f"{plural}.yaml").read_text())
        (version,) = crd["spec"]["versions"]
        for column in version["additionalPrinterColumns"]:
            keys = column["jsonPath"].lstrip(".").split(".")
            if keys[0] == "metadata":
                continue
            _at(schema, *keys)  # KeyError if the column reads a field the schema lacks


# ------------------------------------------ what kube-apiserver refuses in a CRD


def _nulls(node: Any, path: str) -> Iterator[str]:
    if node is None:
        yield path
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _nulls(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _nulls(value, f"{path}[{index}]")


def _schema_nodes(node: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _schema_nodes(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _schema_nodes(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("plural", [constants.CLAIM_PLURAL, constants.NODE_STATUS_PLURAL])
def test_crd_yaml_has_no_null_values(plural: str) -> None:
    # An unquoted comma inside a YAML flow mapping ({description: a, b}) makes "b" a key
    # with a null value, which the API server refuses as an undeclared schema field.
    crd = yaml.safe_load((CRD_DIR / f"{plural}.yaml").read_text())
    assert list(_nulls(crd, plural)) == []


@pytest.mark.parametrize(
    ("plural", "schema"), [(constants.CLAIM_PLURAL, CLAIM), (constants.NODE_STATUS_PLURAL, NODE_STATUS)]
)
def test_no_crd_schema_combines_properties_with_additional_properties(
    plural: str, schema: Mapping[str, Any]
) -> None:
    # "additionalProperties and properties are mutual exclusive" (kube-apiserver, structural schemas);
    # unknown fields are pruned, or refused by clients that ask for fieldValidation=Strict.
    both = [
        path
        for path, node in _schema_nodes(schema, plural)
        if "properties" in node and "additionalProperties" in node
    ]
    assert both == []
