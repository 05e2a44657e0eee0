"""The admission decision: an ``admission.k8s.io/v1`` AdmissionReview in, its response out. Pure.

``admit(review, claims, options)`` looks at a Pod CREATE carrying the
``gpu.scheduling/claim`` annotation, finds the claim in the pod's own namespace
through ``claims`` (a synchronous lookup; the server warms it with one GET on a
cache miss before calling), and answers:

* claim Allocated: allow, with a JSON Patch that pins the pod to the node
  (``nodeSelector kubernetes.io/hostname``), sets ``CUDA_VISIBLE_DEVICES`` and
  ``NVIDIA_VISIBLE_DEVICES`` in every container and init container, and records
  the allocation in the ``gpu.scheduling/devices`` annotation (UUIDs,
  comma-joined);
* claim missing, Pending or Failed: deny with the claim's status message
  (``pending="deny"``), or (``pending="gate"``) allow with the scheduling gate
  ``gpu.scheduling/claim-allocated`` and env vars read from the annotation
  through the downward API, which the controller fills in later. A claim that
  does not exist yet is gated too: it may be created after the pod;
* pods that also ask the device plugin for ``nvidia.com/gpu``: deny, unless
  ``allow_device_plugin``;
* anything else (other kinds, other operations, pods without the annotation):
  allow, no patch.

Device ids: UUIDs by default. ``device_ids="index"`` is for clusters whose
container runtime exposes every GPU of the node to every container: it writes
host indices to ``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (so
CUDA numbers GPUs as nvidia-smi does) and ``NVIDIA_VISIBLE_DEVICES=all``: were
the runtime to expose only the allocated GPUs, they would be renumbered from 0
inside the container and host indices would name the wrong devices, so index
mode must not ask it to. Gate mode always yields UUIDs (the annotation holds
UUIDs), whatever the device-id mode.

A review with no uid to answer raises ``BadReview`` (the server answers HTTP
400); any other malformed review is denied with a message saying what is wrong.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, TypeVar

import orjson

from gpualloc.api import codecs, constants, models, pods
from webhook import mutations, patches

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"

PendingMode = Literal["deny", "gate"]
DeviceIdMode = Literal["uuid", "index"]

# Outcomes, also the label values of the admissions counter.
ALLOWED = "allowed"  # allowed, nothing to change
MUTATED = "mutated"  # allowed with the allocation written in
GATED = "gated"  # allowed with a scheduling gate
DENIED = "denied"  # a policy denial (claim not ready, conflict, bad replica)
INVALID = "invalid"  # a malformed review or object
OUTCOMES = (ALLOWED, MUTATED, GATED, DENIED, INVALID)

_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_MESSAGE_LIMIT = 512


class BadReview(ValueError):
    """The body is not an AdmissionReview with a request uid: there is nothing to answer."""


class ClaimUnavailable(Exception):
    """The claim could not be read (API server unreachable): the pod is denied, fail closed."""


class ClaimLookup(Protocol):
    """``claims(namespace, name)``: the claim, or None when it does not exist.

    May raise ``ClaimUnavailable`` or ``codecs.DecodeError``.
    """

    def __call__(self, namespace: str, name: str, /) -> models.GpuClaim | None: ...


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    pending: PendingMode = "deny"
    device_ids: DeviceIdMode = "uuid"
    allow_device_plugin: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The response to send and the outcome to count."""

    response: dict[str, Any]
    outcome: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PodCreate:
    """A Pod CREATE with a claim annotation: the case that needs a claim to decide."""

    uid: str
    namespace: str
    pod: dict[str, Any]
    claim_name: str

    @property
    def claim_ref(self) -> tuple[str, str]:
        return (self.namespace, self.claim_name)


def lookup_from(claims: Mapping[str, models.GpuClaim]) -> ClaimLookup:
    """A ClaimLookup over a mapping keyed ``namespace/name`` (tests, the benchmark)."""

    def lookup(namespace: str, name: str, /) -> models.GpuClaim | None:
        return claims.get(f"{namespace}/{name}")

    return lookup


# ------------------------------------------------------------------ JSON


def load_json(body: bytes) -> Any:
    """Parse a request body: ``orjson`` (a fifth of an admission's CPU with the standard library).

    What orjson refuses and ``json`` takes (UTF-16 and UTF-32, a BOM, ``NaN``
    and ``Infinity``, lone surrogates) is parsed by ``json`` as before; its
    error is the one raised (a ValueError) when neither can parse it. One
    difference remains: orjson reads an integer past 64 bits as a float.
    """
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


def dump_json(value: Any) -> bytes:
    """Compact JSON in UTF-8, with ``orjson``.

    What it refuses (integers past 64 bits, nesting past 254 levels: only in
    values the pod brought) goes through ``json``. ``NaN`` and infinities,
    which only the lenient side of ``load_json`` lets in, come out as ``null``.
    """
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


# ------------------------------------------------------------------ responses


def _review(response: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}


def allow(
    uid: str, *, patch: list[dict[str, Any]] | None = None, warnings: list[str] | None = None
) -> dict[str, Any]:
    """An allowing AdmissionReview; ``patch`` and ``patchType`` only when the patch is not empty."""
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(dump_json(patch)).decode("ascii")
    if warnings:
        response["warnings"] = warnings
    return _review(response)


def deny(uid: str, message: str, *, code: int = 403, reason: str = "Forbidden") -> dict[str, Any]:
    """A denying AdmissionReview; the API server shows ``message`` to the user."""
    status = {"code": code, "reason": reason, "message": message, "status": "Failure"}
    return _review({"uid": uid, "allowed": False, "status": status})


def _invalid(uid: str, message: str) -> Decision:
    return Decision(response=deny(uid, message, code=400, reason="BadRequest"), outcome=INVALID)


def _denied(uid: str, message: str, *, code: int = 403, reason: str = "Forbidden") -> Decision:
    return Decision(response=deny(uid, message, code=code, reason=reason), outcome=DENIED)


def _quote(message: str) -> str:
    message = " ".join(message.split())
    if len(message) > _MESSAGE_LIMIT:
        message = message[: _MESSAGE_LIMIT - 1] + "…"
    return json.dumps(message, ensure_ascii=False)


# ------------------------------------------------------------------ parsing


def request_uid(review: Any) -> str:
    """The ``request.uid`` to echo; raises BadReview when there is none."""
    if not isinstance(review, dict):
        raise BadReview(f"the body must be a JSON object (an AdmissionReview), not {type(review).__name__}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReview("the AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("the AdmissionReview request has no uid")
    return uid


def prepare(review: Any) -> PodCreate | Decision:
    """The Pod CREATE with a claim annotation to decide on, or the answer for everything else.

    Raises BadReview when there is no uid to answer. The server calls this
    once, looks the claim up (``PodCreate.claim_ref``), then ``decide_prepared``.
    """
    uid = request_uid(review)
    if review.get("apiVersion") != API_VERSION or review.get("kind") != KIND:
        got = f"apiVersion {review.get('apiVersion')!r} kind {review.get('kind')!r}"
        return _invalid(uid, f"expected apiVersion {API_VERSION} kind {KIND}, got {got}"[:300])
    request = review["request"]
    kind = request.get("kind")
    if not isinstance(kind, dict) or not isinstance(kind.get("kind"), str):
        return _invalid(uid, "request.kind must be an object with a kind (group, version, kind)")
    if (kind.get("group") or "") != "" or kind["kind"] != "Pod" or request.get("subResource"):
        return Decision(response=allow(uid), outcome=ALLOWED)
    operation = request.get("operation")
    if not isinstance(operation, str):
        return _invalid(uid, "request.operation must be a string")
    if operation != "CREATE":
        return Decision(response=allow(uid), outcome=ALLOWED)
    pod = request.get("object")
    try:
        mutations.check_shape(pod)
    except mutations.PodShapeError as exc:
        return _invalid(uid, f"request.object is not a Pod: {exc}")
    claim_name = mutations.pod_annotations(pod).get(constants.ANNOTATION_CLAIM)
    if claim_name is None:
        return Decision(response=allow(uid), outcome=ALLOWED)
    annotation = f"annotation {constants.ANNOTATION_CLAIM}"
    if "/" in claim_name:
        return _denied(
            uid,
            f"{annotation}: {claim_name[:100]!r} names a namespace; claims are looked up in the pod's own "
            "namespace, so give the claim's name only",
        )
    if not claim_name:
        return _denied(uid, f"{annotation} is empty; give the name of a GpuClaim in the pod's namespace")
    if len(claim_name) > 253 or not _NAME.fullmatch(claim_name):
        return _denied(uid, f"{annotation}: {claim_name[:100]!r} is not a valid GpuClaim name")
    namespace = request.get("namespace") or mutations.section(pod, "metadata").get("namespace")
    if not isinstance(namespace, str) or not namespace:
        return _invalid(uid, "the request names no namespace for the pod")
    return PodCreate(uid=uid, namespace=namespace, pod=pod, claim_name=claim_name)


def claim_ref(review: Any) -> tuple[str, str] | None:
    """``(namespace, name)`` of the claim ``admit`` would look up for this review, else None. Never raises."""
    try:
        prepared = prepare(review)
    except BadReview:
        return None
    return prepared.claim_ref if isinstance(prepared, PodCreate) else None


# ------------------------------------------------------------------ deciding


def admit(review: Any, claims: ClaimLookup, options: Options = Options()) -> dict[str, Any]:
    """The AdmissionReview answering ``review``. Raises BadReview only when there is no uid to answer."""
    return decide(review, claims, options).response


def decide(review: Any, claims: ClaimLookup, options: Options = Options()) -> Decision:
    """``admit`` with the outcome (for metrics and logs)."""
    return decide_prepared(prepare(review), claims, options)


def decide_prepared(
    parsed: PodCreate | Decision, claims: ClaimLookup, options: Options = Options()
) -> Decision:
    """The decision for what ``prepare`` returned."""
    if isinstance(parsed, Decision):
        return parsed
    uid, namespace, pod, name = parsed.uid, parsed.namespace, parsed.pod, parsed.claim_name
    claim_words = f"GpuClaim {namespace}/{name}"

    users = mutations.device_plugin_requests(pod)
    if users and not options.allow_device_plugin:
        return _denied(
            uid,
            f"the pod uses {claim_words} and also requests {mutations.GPU_RESOURCE} from the NVIDIA "
            f"device plugin (containers: {', '.join(users)[:200]}); the device plugin would pick GPUs of "
            f"its own that may be the ones the claim holds. Remove the {mutations.GPU_RESOURCE} request, "
            "or run the webhook with --allow-device-plugin",
        )

    try:
        claim = claims(namespace, name)
    except ClaimUnavailable as exc:
        return _denied(
            uid, f"could not read {claim_words}: {exc}; try again", code=503, reason="ServiceUnavailable"
        )
    except codecs.DecodeError as exc:
        return _denied(uid, f"{claim_words} could not be read: {exc}")

    if claim is not None and claim.metadata.deletion_timestamp:
        return _denied(uid, f"{claim_words} is being deleted")
    if claim is not None and claim.status.phase == constants.PHASE_ALLOCATED:
        return _allocated(parsed, claim, claim_words, options)

    if claim is None:
        why = f"{claim_words} does not exist"
    else:
        status_message = claim.status.message or "(no status message yet)"
        why = f"{claim_words} is {claim.status.phase}, not Allocated: {_quote(status_message)}"
    if options.pending == "deny":
        return _denied(uid, f"{why}; the pod can be created once the claim is Allocated")
    return _gated(parsed, claim, claim_words, why)


def _replica(pod: Mapping[str, Any], claim: models.GpuClaim, claim_words: str) -> int | str:
    """The replica index for this pod, or a denial message."""
    try:
        replica = pods.replica_of(mutations.section(pod, "metadata"))  # shape checked in prepare
    except pods.ReplicaError as exc:
        return str(exc)
    replicas = claim.spec.replicas
    if replica is None:
        if replicas == 1:
            return 0
        sources = ", ".join(words for _, _, words in pods.REPLICA_SOURCES)
        return (
            f"{claim_words} has {replicas} replicas and the pod does not say which one it is; "
            f"set one of: {sources}"
        )
    if replica.index >= replicas:
        return (
            f"replica {replica.index} (from {replica.source}) is out of range: {claim_words} has "
            f"{replicas} replica{'s' if replicas != 1 else ''} (0..{replicas - 1})"
        )
    return replica.index


T = TypeVar("T")


def patch_for(pod: Mapping[str, Any], edit: Callable[[dict[str, Any]], T]) -> tuple[list[dict[str, Any]], T]:
    """The JSON Patch that ``edit`` (made of ``mutations`` functions) makes to ``pod``, and what it returned.

    The patch comes from diffing the pod's ``mutations.touched_parts`` before
    and after the edit (``patches.diff``: keys with ``/`` are escaped as
    ``~1``, a missing ``env`` is added whole), so a big pod costs no more than
    its env lists and annotations. The edits replace what they change instead
    of changing it in place, so the two views share what is unchanged, which
    the diff skips at once; ``pod`` is left alone.
    """
    before = mutations.touched_parts(pod)
    after = mutations.touched_parts(pod)
    result = edit(after)
    return patches.diff(before, after), result


def _allocated(req: PodCreate, claim: models.GpuClaim, claim_words: str, options: Options) -> Decision:
    uid, pod = req.uid, req.pod
    replica = _replica(pod, claim, claim_words)
    if isinstance(replica, str):
        return _denied(uid, replica)
    allocation = next((a for a in claim.status.allocations if a.replica == replica), None)
    if allocation is None or not allocation.devices:
        return _denied(uid, f"{claim_words} is Allocated but holds no devices for replica {replica}")
    node = allocation.node_name
    pin = mutations.node_pin(pod)
    if pin is not None and pin[1] != node:
        how, pinned = pin
        return _denied(
            uid,
            f"pod {mutations.display_name(pod)} is pinned to node {pinned!r} by {how}, but {claim_words} "
            f"(replica {replica}) holds GPUs on node {node!r}; remove the pin or use another claim",
        )

    uuids = ",".join(d.uuid for d in allocation.devices)
    if options.device_ids == "index":
        entries = [
            mutations.value_env(
                mutations.ENV_CUDA_VISIBLE_DEVICES, ",".join(str(d.index) for d in allocation.devices)
            ),
            mutations.value_env(mutations.ENV_NVIDIA_VISIBLE_DEVICES, "all"),
            mutations.value_env(mutations.ENV_CUDA_DEVICE_ORDER, "PCI_BUS_ID"),
        ]
    else:
        entries = [mutations.value_env(name, uuids) for name in mutations.DEVICE_ENV_NAMES]

    ops, replaced = patch_for(pod, functools.partial(edit_allocated, node=node, entries=entries, uuids=uuids))
    warnings = (
        [f"gpualloc replaced {', '.join(replaced)[:200]} with the devices of {claim_words}"]
        if replaced
        else None
    )
    return Decision(response=allow(uid, patch=ops, warnings=warnings), outcome=MUTATED)


def _gated(req: PodCreate, claim: models.GpuClaim | None, claim_words: str, why: str) -> Decision:
    uid, pod = req.uid, req.pod
    spec = mutations.section(pod, "spec")
    if spec.get("nodeName"):
        return _denied(
            uid,
            f"{why}; the pod sets spec.nodeName, which cannot be combined with the scheduling gate the pod "
            "would wait behind; remove spec.nodeName",
        )
    if claim is not None:
        replica = _replica(pod, claim, claim_words)
        if isinstance(replica, str):
            return _denied(uid, replica)
    ops, _ = patch_for(pod, edit_gated)
    return Decision(response=allow(uid, patch=ops), outcome=GATED)


def edit_allocated(pod: dict[str, Any], *, node: str, entries: list[dict[str, Any]], uuids: str) -> list[str]:
    """The edits for an allocated claim; returns the user-set env entries replaced (``container/NAME``)."""
    mutations.remove_scheduling_gate(pod)
    mutations.pin_to_node(pod, node)
    replaced = mutations.set_env_everywhere(pod, entries)
    mutations.set_annotation(pod, constants.ANNOTATION_DEVICES, uuids)
    return replaced


def edit_gated(pod: dict[str, Any]) -> None:
    """The edits for a claim not allocated yet, in gate mode."""
    # Only the controller may say which devices the pod gets: drop a user-set value.
    mutations.remove_annotation(pod, constants.ANNOTATION_DEVICES)
    mutations.add_scheduling_gate(pod)
    mutations.set_label(pod, constants.LABEL_GATED, "true")
    mutations.set_env_everywhere(pod, [mutations.annotation_env(name) for name in mutations.DEVICE_ENV_NAMES])
