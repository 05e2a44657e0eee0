"""The parts of an AdmissionReview the webhook reads, and the answer it writes, by ``msgspec``. Pure.

Why typed decoding: a claim pod's review is 5 to 10 KiB of JSON, and the
webhook reads perhaps a tenth of it (annotations, labels, node pins, each
container's name, env and resources). ``msgspec`` decodes straight into the
Structs below and skips everything else without building Python objects for
it, and it checks the types of what it keeps (an annotation value that is not
a string, a ``containers`` that is not a list) on the way, in C. On the
benchmark's 6.8 KB review that takes 8.7 µs, against 17.5 µs for orjson and
38 µs for the standard library parsing the whole body into dicts, and the
shape check the decision needs comes free.

Two passes, for correctness with any input:

* the fast pass decodes the review with ``request.object`` as a ``GpuFreePod``:
  a Pod that names no ``nvidia.com/gpu`` quantity, which is every pod the
  webhook allows (the others are denied unless ``--allow-device-plugin``);
* if that fails validation (a pod with such a quantity, a non-Pod object in a
  hand-made review, or a pod with a field of the wrong type), the review is
  decoded again with the object kept as raw JSON, so the uid can still be
  answered; ``pod_of`` then decodes the object as a ``Pod[Any]`` only if the
  request is one the webhook decides on, and raises ``PodShapeError`` with
  msgspec's message (it names the field).

Field names are the API's own (``rename="camel"``: ``node_selector`` reads
``nodeSelector``). Unknown fields are ignored. The Structs are not tracked by
the garbage collector (``gc=False``): decoded JSON cannot hold a cycle.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec


class PodShapeError(ValueError):
    """The request's object is not a Pod: a field has the wrong type. The message names the field."""


class NotAReview(ValueError):
    """The body is JSON but not an object with a ``request`` object: there is no uid to answer."""


class _Struct(msgspec.Struct, rename="camel", gc=False):
    """Base of the Structs here: API field names, no GC tracking."""


# ------------------------------------------------------------------ the pod


class EnvVar(_Struct):
    name: str = ""
    value: str | None = None
    value_from: msgspec.Raw = msgspec.Raw(b"null")  # kept as JSON text: read only for our own names


# The type of an ``nvidia.com/gpu`` quantity: ``None`` in the fast pass, where a pod that names
# one fails to decode (see ``decode_review``), and ``Any`` when the pod is decoded again.
Gpu = TypeVar("Gpu")


class GpuAmount(msgspec.Struct, Generic[Gpu], rename={"gpu": "nvidia.com/gpu"}, gc=False):
    """The ``nvidia.com/gpu`` quantity of a resource list (string or number); other resources are skipped."""

    gpu: Gpu | None = None


class ClaimRef(_Struct):
    """An entry of a container's ``resources.claims``: a name of the pod's ``spec.resourceClaims``."""

    name: str = ""
    request: str | None = None


class Resources(_Struct, Generic[Gpu]):
    limits: GpuAmount[Gpu] | None = None
    requests: GpuAmount[Gpu] | None = None
    claims: list[ClaimRef] | None = None


class Container(_Struct, Generic[Gpu]):
    name: str = ""
    env: list[EnvVar] | None = None
    resources: Resources[Gpu] | None = None


class SchedulingGate(_Struct):
    name: str = ""


class PodResourceClaim(_Struct):
    """An entry of ``spec.resourceClaims``: a name for the containers, and the ResourceClaim (or
    template) it stands for."""

    name: str = ""
    resource_claim_name: str | None = None
    resource_claim_template_name: str | None = None


class Toleration(_Struct):
    key: str = ""
    operator: str = ""
    value: str = ""
    effect: str = ""
    toleration_seconds: int | None = None


class ObjectMeta(_Struct):
    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    annotations: dict[str, str] | None = None
    labels: dict[str, str] | None = None


class PodSpec(_Struct, Generic[Gpu]):
    node_name: str | None = None
    node_selector: dict[str, str] | None = None
    affinity: Any = None  # read by ``pods.affinity_excludes``, which takes any JSON
    scheduling_gates: list[SchedulingGate] | None = None
    resource_claims: list[PodResourceClaim] | None = None
    tolerations: list[Toleration] | None = None
    resources: Resources[Gpu] | None = None  # pod-level resources
    init_containers: list[Container[Gpu]] | None = None
    containers: list[Container[Gpu]] | None = None


class Pod(_Struct, Generic[Gpu]):
    kind: str | None = None
    metadata: ObjectMeta | None = None
    spec: PodSpec[Gpu] | None = None


GpuFreePod = Pod[None]  # a pod that names no nvidia.com/gpu quantity (in limits or requests) anywhere


# ------------------------------------------------------------------ the review

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"

NULL = msgspec.Raw(b"null")


class RequestHead(_Struct):
    """What the webhook reads of ``request`` before the object; loosely typed so any value reaches a check."""

    uid: Any = None
    kind: Any = None
    operation: Any = None
    namespace: Any = None
    sub_resource: Any = None


class Request(RequestHead):
    object: GpuFreePod | None = None


class RawRequest(RequestHead):
    object: msgspec.Raw = NULL


class Review(_Struct):
    api_version: Any = None
    kind: Any = None
    request: Request | None = None


class RawReview(_Struct):
    api_version: Any = None
    kind: Any = None
    request: RawRequest | None = None


AnyReview = Review | RawReview

_REVIEW = msgspec.json.Decoder(Review)
_RAW_REVIEW = msgspec.json.Decoder(RawReview)
_POD_OR_NULL: msgspec.json.Decoder[Pod[Any] | None] = msgspec.json.Decoder(Pod[Any] | None)


def decode_review(body: bytes) -> AnyReview:
    """The review in ``body``: a ``Review`` when its object reads as a GpuFreePod (or is absent), else raw.

    So a ``Review``'s pod provably asks the device plugin for nothing: the
    webhook's check of every container's resources is done by msgspec, in C,
    while decoding. A pod that names ``nvidia.com/gpu`` is read by ``pod_of``.

    Raises ``msgspec.DecodeError`` (a ValueError) when the body is not JSON,
    ``RecursionError`` past msgspec's nesting limit, and ``NotAReview`` when
    the JSON is not an object whose ``request`` is an object or null.
    """
    try:
        return _REVIEW.decode(body)
    except msgspec.ValidationError:
        pass
    try:
        return _RAW_REVIEW.decode(body)
    except msgspec.ValidationError as exc:
        if "`$.request`" in str(exc):
            raise NotAReview(f"the AdmissionReview has no request object: {exc}") from None
        raise NotAReview(f"the body must be a JSON object (an AdmissionReview): {exc}") from None


def pod_of(request: RequestHead) -> Pod[Any] | None:
    """The request's object as a Pod (None when absent or null); raises PodShapeError when it is not one."""
    if isinstance(request, Request):
        return request.object
    assert isinstance(request, RawRequest)
    return decode_pod(request.object)


def decode_pod(data: bytes | msgspec.Raw) -> Pod[Any] | None:
    """A Pod from its JSON (None for ``null``); PodShapeError names the first field of a wrong type."""
    try:
        return _POD_OR_NULL.decode(data)
    except msgspec.ValidationError as exc:
        raise PodShapeError(str(exc).replace("`$", "`request.object", 1)) from None


# ------------------------------------------------------------------ the answer


class Status(_Struct):
    code: int
    reason: str
    message: str
    status: str = "Failure"


class Response(_Struct, omit_defaults=True):
    """``response`` of the answering AdmissionReview; msgspec writes ``patch`` (bytes) as base64."""

    uid: str
    allowed: bool
    status: Status | None = None
    patch_type: str | None = None
    patch: bytes | None = None
    warnings: list[str] | None = None


class Answer(_Struct):
    """The AdmissionReview sent back."""

    response: Response
    api_version: str = API_VERSION
    kind: str = KIND


# Compact JSON of an Answer, or of a value built by the webhook (dicts, lists, strings, numbers).
encode = msgspec.json.Encoder().encode
