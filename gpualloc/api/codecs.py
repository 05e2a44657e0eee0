"""Raw API dicts <-> frozen models, driven by the dataclass fields.

``decode(cls, raw)`` reads a model from the JSON shape the API server returns;
``encode(obj)`` writes it back, leaving out fields that hold ``None``. One
generic walk serves every model, so a field added to a model is read and
written without touching this module.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from gpualloc.api import constants, models

T = TypeVar("T")


class DecodeError(ValueError):
    """A raw object does not have the shape of the model it was read as."""


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def field_json_name(field: dataclasses.Field[Any]) -> str:
    return str(field.metadata.get("json", camel(field.name)))


def model_fields(cls: type) -> tuple[tuple[str, dataclasses.Field[Any], Any], ...]:
    """(json name, field, resolved type) for each field of a model class; worked out once per class.

    A typed front for the cache: ``functools.cache`` types its argument as Hashable, which
    mypy does not grant ``type[T]``."""
    return _model_fields(cls)


@functools.cache
def _model_fields(cls: type) -> tuple[tuple[str, dataclasses.Field[Any], Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((field_json_name(f), f, hints[f.name]) for f in dataclasses.fields(cls))


def _decode_value(tp: Any, raw: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None:
            return None
        return _decode_value(args[0], raw, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return decode(tp, raw, path)
    if origin is tuple:
        (item,) = typing.get_args(tp)[:1]
        if not isinstance(raw, list):
            raise DecodeError(f"{path}: expected a list, got {type(raw).__name__}")
        return tuple(_decode_value(item, r, f"{path}[{i}]") for i, r in enumerate(raw))
    if origin in (Mapping, dict, typing.Mapping) or tp is dict:
        if not isinstance(raw, dict):
            raise DecodeError(f"{path}: expected an object, got {type(raw).__name__}")
        value_type = (typing.get_args(tp) or (str, str))[1]
        if value_type is str:
            return {str(k): str(v) for k, v in raw.items()}
        return {str(k): _decode_value(value_type, v, f"{path}.{k}") for k, v in raw.items()}
    if tp is bool:
        if not isinstance(raw, bool):
            raise DecodeError(f"{path}: expected a boolean")
        return raw
    if tp is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise DecodeError(f"{path}: expected an integer, got {raw!r}")
        return raw
    if tp is str:
        if not isinstance(raw, str):
            raise DecodeError(f"{path}: expected a string, got {raw!r}")
        return raw
    raise DecodeError(f"{path}: unsupported type {tp!r}")  # pragma: no cover


def decode(cls: type[T], raw: Any, path: str = "") -> T:
    """Read ``raw`` (a dict from the API) as an instance of the model ``cls``."""
    if not isinstance(raw, dict):
        raise DecodeError(f"{path or cls.__name__}: expected an object, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {}
    for key, field, tp in model_fields(cls):
        if key in raw and raw[key] is not None:
            kwargs[field.name] = _decode_value(tp, raw[key], f"{path}.{key}" if path else key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise DecodeError(f"{path}.{key}: required" if path else f"{key}: required")
    return cls(**kwargs)


def _encode_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode(value)
    if isinstance(value, tuple):
        return [_encode_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _encode_value(v) for k, v in value.items()}
    return value


def encode(obj: Any) -> dict[str, Any]:
    """Write a model as the JSON shape the API takes; ``None`` fields are left out."""
    out: dict[str, Any] = {}
    for key, field, _ in model_fields(type(obj)):
        value = getattr(obj, field.name)
        if value is None:
            continue
        out[key] = _encode_value(value)
    return out


# ------------------------------------------------------------- object helpers


def decode_meta(raw: Mapping[str, Any]) -> models.ObjectMeta:
    # decode reads only the model's keys, so managedFields and the like are ignored.
    return decode(models.ObjectMeta, dict(raw.get("metadata") or {}), "metadata")


def parse_claim(raw: Mapping[str, Any]) -> models.GpuClaim:
    """A GpuClaim from the API's JSON. Raises DecodeError naming the bad field."""
    return models.GpuClaim(
        metadata=decode_meta(raw),
        spec=decode(models.GpuClaimSpec, raw.get("spec"), "spec"),
        status=decode(models.GpuClaimStatus, raw.get("status") or {}, "status"),
    )


def parse_node_status(raw: Mapping[str, Any]) -> models.GpuNodeStatus:
    """A GpuNodeStatus from the API's JSON."""
    return models.GpuNodeStatus(
        metadata=decode_meta(raw),
        spec=decode(models.GpuNodeStatusSpec, raw.get("spec"), "spec"),
        status=decode(models.NodeInventory, raw.get("status") or {}, "status"),
    )


def parse_quota(raw: Mapping[str, Any]) -> models.GpuQuota:
    """A GpuQuota from the API's JSON."""
    return models.GpuQuota(
        metadata=decode_meta(raw),
        spec=decode(models.GpuQuotaSpec, raw.get("spec"), "spec"),
        status=decode(models.GpuQuotaStatus, raw.get("status") or {}, "status"),
    )


def claim_body(name: str, spec: models.GpuClaimSpec, namespace: str = "") -> dict[str, Any]:
    """A GpuClaim object ready to create."""
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": metadata,
        "spec": _prune_empty(encode(spec)),
    }


def _prune_empty(value: dict[str, Any]) -> dict[str, Any]:
    """Leave out empty lists and objects: in a spec they mean "not set" (the CRD defaults apply),
    and some are rejected when present, e.g. ``preferIds: []`` without policy preferIds."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, dict):
            item = _prune_empty(item)
        if item in ([], {}):
            continue
        out[key] = item
    return out
