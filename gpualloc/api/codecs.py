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
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gpualloc.api import constants, models, quantities

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


class _Bad(Exception):
    """A decode failure on its way up: what is wrong, and the keys from where it was found."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.where: list[str] = []  # innermost last once complete; each level prepends its key


Decoder = Callable[[Any], Any]


@functools.cache
def _decoder(tp: Any) -> Decoder:
    """The function that reads a raw value as ``tp``, worked out once per type: reading an
    object then costs no type introspection (the controller parses every watch event)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = _decoder(next(a for a in typing.get_args(tp) if a is not type(None)))
        return lambda raw: None if raw is None else inner(raw)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _model_decoder(tp)
    if origin is tuple:
        item = _decoder(typing.get_args(tp)[0])

        def tuple_of(raw: Any) -> tuple[Any, ...]:
            if not isinstance(raw, list):
                raise _Bad(f"expected a list, got {type(raw).__name__}")
            out = []
            try:
                for r in raw:
                    out.append(item(r))
            except _Bad as bad:
                bad.where.insert(0, f"[{len(out)}]")
                raise
            return tuple(out)

        return tuple_of
    if origin in (Mapping, dict, typing.Mapping) or tp is dict:
        value_type = (typing.get_args(tp) or (str, str))[1]
        values = None if value_type is str else _decoder(value_type)

        def mapping_of(raw: Any) -> dict[str, Any]:
            if not isinstance(raw, dict):
                raise _Bad(f"expected an object, got {type(raw).__name__}")
            if values is None:
                return {str(k): str(v) for k, v in raw.items()}
            out, k = {}, ""
            try:
                for k, v in raw.items():
                    out[str(k)] = values(v)
            except _Bad as bad:
                bad.where.insert(0, f".{k}")
                raise
            return out

        return mapping_of
    if tp is bool:
        return _boolean
    if tp is int:
        return _integer
    if tp is str:
        return _string
    raise TypeError(f"unsupported type {tp!r}")  # pragma: no cover - a model written wrong


def _boolean(raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise _Bad("expected a boolean")
    return raw


def _integer(raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise _Bad(f"expected an integer, got {raw!r}")
    return raw


def _string(raw: Any) -> str:
    if not isinstance(raw, str):
        raise _Bad(f"expected a string, got {raw!r}")
    return raw


def _model_decoder(cls: type) -> Decoder:
    """A typed front for the cache (as ``model_fields``)."""
    return _model_decoder_cached(cls)


@functools.cache
def _model_decoder_cached(cls: type) -> Decoder:
    fields = [
        (
            key,
            field.name,
            _FIELD_CODECS[field.metadata["codec"]][0] if "codec" in field.metadata else _decoder(tp),
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING,
        )
        for key, field, tp in model_fields(cls)
    ]

    def model(raw: Any) -> Any:
        if not isinstance(raw, dict):
            raise _Bad(f"expected an object, got {type(raw).__name__}")
        kwargs: dict[str, Any] = {}
        key = ""
        try:  # one handler per object, not per field: free until something is wrong
            for key, name, decoder, required in fields:
                value = raw.get(key)
                if value is not None:
                    kwargs[name] = decoder(value)
                elif required:
                    raise _Bad("required")
        except _Bad as bad:
            bad.where.insert(0, f".{key}")
            raise
        return cls(**kwargs)

    return model


def _resource_list(raw: Any) -> dict[str, int]:
    """A map of resource name to quantity, in each resource's unit (``models.resource_list``)."""
    if not isinstance(raw, dict):
        raise _Bad(f"expected an object, got {type(raw).__name__}")
    out, name = {}, ""
    try:
        for name, value in raw.items():
            try:
                units = quantities.parse_units(str(name), value)
            except quantities.QuantityError as bad:
                raise _Bad(str(bad)) from None
            if units < 0:
                raise _Bad(f"must not be negative, got {value!r}")
            out[str(name)] = units
    except _Bad as bad:
        bad.where.insert(0, f".{name}")
        raise
    return out


def _resource_list_json(value: Mapping[str, int]) -> dict[str, Any]:
    return {name: quantities.unit_quantity(name, units) for name, units in value.items()}


# Fields whose JSON is not their Python value (``models.resource_list``): (decoder, encoder).
_FIELD_CODECS: dict[str, tuple[Decoder, Callable[[Any], Any]]] = {
    "resource_list": (_resource_list, _resource_list_json),
}


def decode(cls: type[T], raw: Any, path: str = "") -> T:
    """Read ``raw`` (a dict from the API) as an instance of the model ``cls``; DecodeError naming
    the field (``spec.devices.count: expected an integer``) when it does not fit."""
    try:
        decoded: T = _model_decoder(cls)(raw)
    except _Bad as bad:
        where = (path + "".join(bad.where)).lstrip(".") or cls.__name__
        raise DecodeError(f"{where}: {bad.what}") from None
    return decoded


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
        codec = field.metadata.get("codec")
        out[key] = _FIELD_CODECS[codec][1](value) if codec else _encode_value(value)
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


# What a cache keeps of a claim's metadata: what the controller and the webhook read (the
# ObjectMeta fields other than labels and annotations, and the owner references the release on
# a workload's completion follows). Tenants create claims; the CRD bounds spec and only the
# controller writes status, but labels and annotations are free up to 256 KiB of annotations
# (``kubectl apply`` alone puts a copy of the whole claim in one).
_KEPT_CLAIM_METADATA = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "finalizers",
    "ownerReferences",
)


def kept_of_claim(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a claim a cache keeps (a ``watching.Reflector`` transform): the whole of it but
    its labels, annotations, managedFields and other metadata nothing in gpualloc reads.

    Safe because gpualloc writes claims only by merge patch of the fields it owns (status,
    finalizers), never by a PUT of the cached object."""
    metadata = raw.get("metadata") or {}
    kept = {key: raw[key] for key in ("apiVersion", "kind", "spec", "status") if key in raw}
    kept["metadata"] = {key: metadata[key] for key in _KEPT_CLAIM_METADATA if key in metadata}
    return kept


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
