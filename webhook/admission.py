"""The admission decision: an ``admission.k8s.io/v1`` AdmissionReview in, its response out. Pure.

Three steps, which the server runs in order: ``decode(body)`` reads the review
and answers everything that is not a Pod CREATE carrying the
``gpu.scheduling/claim`` annotation; for such a pod, ``decide(request, claims,
options)`` finds the claim in the pod's own namespace through ``claims`` (a
synchronous lookup; the server warms it with one GET on a cache miss before
calling) and answers; ``encode(answer)`` writes the answer as JSON:

* claim Allocated: allow, with a JSON Patch that pins the pod to the node of
  its replica's allocation and gives its containers those devices, and holds
  the pod behind the scheduling gate ``gpu.scheduling/claim-allocated``
  (``recipe.edits`` says what the pod gets). The claim was read from a watch,
  which may be behind: the controller lifts the gate only once the API server
  still holds that claim, with those devices, and nothing is releasing it.
  Until then the pod exists, so it keeps the claim in use;
* claim being deleted, or that lost devices to another claim (its ``DevicesLost``
  condition True with reason ``DevicesTaken``): deny, in gate mode too, saying
  so (delete and re-create the claim to get other GPUs);
* claim missing, Pending or Failed: deny with the claim's status message
  (``pending="deny"``), or (``pending="gate"``) allow with the scheduling gate
  ``gpu.scheduling/claim-allocated`` and env vars read from the annotation
  through the downward API, which the controller fills in later
  (``recipe.edits`` again). A claim that does not exist yet is gated too: it
  may be created after the pod;
* pods that also ask the device plugin for ``nvidia.com/gpu``: deny, unless
  ``allow_device_plugin``;
* anything else (other kinds, other operations, pods without the annotation):
  allow, no patch.

Device ids (``Options.device_ids``): UUIDs by default, or host indices for
runtimes that expose every GPU of the node (``recipe`` says why and how).

Input is the request body, decoded by ``objects.decode_review`` into typed
Structs holding only what is read here. A body that is not JSON raises
``NotJSON``, and a review with no uid to answer raises ``BadReview`` (the
server answers HTTP 400 to both); any other malformed review is denied with a
message saying what is wrong. The patch is a list of operations made by
``mutations``, json-encoded into the answer.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, Protocol

import msgspec

from gpualloc.api import codecs, constants, models, pods
from webhook import mutations, objects, recipe

PendingMode = Literal["deny", "gate"]
DeviceIdMode = recipe.DeviceIdMode

# Outcomes, also the label values of the admissions counter.
ALLOWED = "allowed"  # allowed, nothing to change
MUTATED = "mutated"  # allowed with the allocation written in
GATED = "gated"  # allowed with a scheduling gate
DENIED = "denied"  # a policy denial (claim not ready, conflict, bad replica)
INVALID = "invalid"  # a malformed review or object
ERROR = "error"  # an unexpected failure, answered with a denial (the server's outcome, not decide's)
OUTCOMES = (ALLOWED, MUTATED, GATED, DENIED, INVALID, ERROR)

_MESSAGE_LIMIT = 512
# request.kind of a Pod, as the API server writes it
_CORE_POD = {"group": "", "version": "v1", "kind": "Pod"}
_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"


def _valid_name(name: str) -> bool:
    """Whether ``name`` can be a GpuClaim's name: a DNS-1123 subdomain, 253 characters at most.

    That is dot-separated labels of ``[a-z0-9-]`` that start and end with a
    letter or digit: the characters are those, the first and last are
    alphanumeric, and no ``..``, ``.-`` or ``-.`` occurs.
    """
    return (
        0 < len(name) <= 253
        and not name.strip(_ALNUM + ".-")
        and name[0] in _ALNUM
        and name[-1] in _ALNUM
        and ".." not in name
        and ".-" not in name
        and "-." not in name
    )


class BadReview(ValueError):
    """The body is not an AdmissionReview with a request uid: there is nothing to answer."""


class NotJSON(ValueError):
    """The body is not JSON (or not UTF-8, or nested past the decoder's limit)."""


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
    dra: bool = False  # the pod also uses its replica's ResourceClaim (recipe.dra_edits)


class Decision(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The answer to send and the outcome to count."""

    answer: objects.Answer
    outcome: str


class PodCreate(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A Pod CREATE with a claim annotation: the case that needs a claim to decide."""

    uid: str
    namespace: str
    pod: objects.Pod[Any]
    claim_name: str
    gpu_free: bool  # decoded as an objects.GpuFreePod: asks the device plugin for nothing

    @property
    def claim_ref(self) -> tuple[str, str]:
        return (self.namespace, self.claim_name)

    @property
    def claim_words(self) -> str:
        """The claim, for messages: ``GpuClaim <namespace>/<name>`` (made only when a message needs it)."""
        return f"GpuClaim {self.namespace}/{self.claim_name}"


# ------------------------------------------------------------------ decode, encode


def decode(body: bytes) -> PodCreate | Decision:
    """The Pod CREATE with a claim annotation in a request body, or the answer for any other review.

    Raises NotJSON, or BadReview when there is no request uid to answer.
    """
    review = read_review(body)
    return prepare(review, request_uid(review))


encode = objects.encode  # compact JSON of an Answer


def read_review(body: bytes) -> objects.AnyReview:
    """The AdmissionReview in a request body. Raises NotJSON, or BadReview when it has no request object."""
    try:
        return objects.decode_review(body)
    except objects.NotAReview as exc:
        raise BadReview(str(exc)) from None
    except (ValueError, RecursionError) as error:  # msgspec.DecodeError, UnicodeDecodeError: ValueErrors
        raise NotJSON(f"the body is not JSON: {str(error)[:200]}") from None


# ------------------------------------------------------------------ responses


def allow(
    uid: str, *, patch: list[mutations.Op] | None = None, warnings: list[str] | None = None
) -> objects.Answer:
    """An allowing answer; ``patch`` and ``patchType`` only when the patch is not empty."""
    response = objects.Response(
        uid=uid,
        allowed=True,
        patch_type="JSONPatch" if patch else None,
        patch=objects.encode(patch) if patch else None,
        warnings=warnings or None,
    )
    return objects.Answer(response=response)


def deny(uid: str, message: str, *, code: int = 403, reason: str = "Forbidden") -> objects.Answer:
    """A denying answer; the API server shows ``message`` to the user."""
    status = objects.Status(code=code, reason=reason, message=message)
    return objects.Answer(response=objects.Response(uid=uid, allowed=False, status=status))


def _invalid(uid: str, message: str) -> Decision:
    return Decision(answer=deny(uid, message, code=400, reason="BadRequest"), outcome=INVALID)


def _denied(uid: str, message: str, *, code: int = 403, reason: str = "Forbidden") -> Decision:
    return Decision(answer=deny(uid, message, code=code, reason=reason), outcome=DENIED)


def _quote(message: str) -> str:
    message = " ".join(message.split())
    if len(message) > _MESSAGE_LIMIT:
        message = message[: _MESSAGE_LIMIT - 1] + "…"
    return json.dumps(message, ensure_ascii=False)


# ------------------------------------------------------------------ parsing


def request_uid(review: objects.AnyReview) -> str:
    """The ``request.uid`` to echo; raises BadReview when there is none."""
    request = review.request
    if request is None:
        raise BadReview("the AdmissionReview has no request object")
    uid = request.uid
    if not isinstance(uid, str) or not uid:
        raise BadReview("the AdmissionReview request has no uid")
    return uid


def prepare(review: objects.AnyReview, uid: str) -> PodCreate | Decision:
    """The Pod CREATE with a claim annotation to decide on, or the answer for everything else."""
    if review.api_version != objects.API_VERSION or review.kind != objects.KIND:
        got = f"apiVersion {review.api_version!r} kind {review.kind!r}"
        expected = f"expected apiVersion {objects.API_VERSION} kind {objects.KIND}"
        return _invalid(uid, f"{expected}, got {got}"[:300])
    request = review.request
    assert request is not None  # request_uid checked it
    kind = request.kind
    if kind != _CORE_POD:  # the usual kind compared first, as a whole
        if not isinstance(kind, dict) or not isinstance(kind.get("kind"), str):
            return _invalid(uid, "request.kind must be an object with a kind (group, version, kind)")
        if (kind.get("group") or "") != "" or kind["kind"] != "Pod":
            return Decision(answer=allow(uid), outcome=ALLOWED)
    if request.sub_resource:
        return Decision(answer=allow(uid), outcome=ALLOWED)
    operation = request.operation
    if not isinstance(operation, str):
        return _invalid(uid, "request.operation must be a string")
    if operation != "CREATE":
        return Decision(answer=allow(uid), outcome=ALLOWED)
    try:
        pod = objects.pod_of(request)
    except objects.PodShapeError as exc:
        return _invalid(uid, f"request.object is not a Pod: {exc}"[:400])
    if pod is None:
        return _invalid(uid, "request.object is not a Pod: it is missing or null")
    if pod.kind is not None and pod.kind != "Pod":
        return _invalid(uid, f"request.object is not a Pod: it is a {pod.kind[:60]!r}")
    claim_name = mutations.pod_annotations(pod).get(constants.ANNOTATION_CLAIM)
    if claim_name is None:
        return Decision(answer=allow(uid), outcome=ALLOWED)
    if not _valid_name(claim_name):
        annotation = f"annotation {constants.ANNOTATION_CLAIM}"
        if "/" in claim_name:
            return _denied(
                uid,
                f"{annotation}: {claim_name[:100]!r} names a namespace; claims are looked up in the pod's "
                "own namespace, so give the claim's name only",
            )
        if not claim_name:
            return _denied(uid, f"{annotation} is empty; give the name of a GpuClaim in the pod's namespace")
        return _denied(uid, f"{annotation}: {claim_name[:100]!r} is not a valid GpuClaim name")
    namespace = request.namespace or (pod.metadata.namespace if pod.metadata is not None else None)
    if not isinstance(namespace, str) or not namespace:
        return _invalid(uid, "the request names no namespace for the pod")
    gpu_free = isinstance(request, objects.Request)  # the fast pass decoded it (objects.decode_review)
    return PodCreate(uid=uid, namespace=namespace, pod=pod, claim_name=claim_name, gpu_free=gpu_free)


# ------------------------------------------------------------------ deciding


def decide(parsed: PodCreate | Decision, claims: ClaimLookup, options: Options = Options()) -> Decision:
    """The decision for what ``decode`` returned."""
    if isinstance(parsed, Decision):
        return parsed
    uid, pod = parsed.uid, parsed.pod
    users = [] if options.allow_device_plugin or parsed.gpu_free else mutations.device_plugin_requests(pod)
    if users:
        return _denied(
            uid,
            f"the pod uses {parsed.claim_words} and also requests {mutations.GPU_RESOURCE} from the NVIDIA "
            f"device plugin (containers: {', '.join(users)[:200]}); the device plugin would pick GPUs of "
            f"its own that may be the ones the claim holds. Remove the {mutations.GPU_RESOURCE} request, "
            "or run the webhook with --allow-device-plugin",
        )

    try:
        claim = claims(parsed.namespace, parsed.claim_name)
    except ClaimUnavailable as exc:
        return _denied(
            uid,
            f"could not read {parsed.claim_words}: {exc}; try again",
            code=503,
            reason="ServiceUnavailable",
        )
    except codecs.DecodeError as error:
        return _denied(uid, f"{parsed.claim_words} could not be read: {error}")

    if claim is not None:
        if claim.metadata.deletion_timestamp:
            return _denied(uid, f"{parsed.claim_words} is being deleted")
        if claim.status.phase == constants.PHASE_RELEASED:
            return _denied(
                uid,
                f"{parsed.claim_words} was released when its work was done "
                f"(release: {claim.spec.release}); create a new claim",
            )
        if claim.status.phase == constants.PHASE_PREEMPTED:
            return _denied(
                uid,
                f"{parsed.claim_words} was preempted by {claim.status.preempted_by or 'another claim'};"
                " create a new claim",
            )
        if claim.releasing:
            fence = next(c for c in claim.status.conditions if c.type == constants.CONDITION_RELEASING)
            return _denied(uid, f"{parsed.claim_words} is giving its GPUs back: {fence.message}")
        taken = _taken(claim)
        if taken is not None:
            return _denied(uid, _taken_message(parsed, taken))
        if claim.status.phase == constants.PHASE_ALLOCATED:
            return _allocated(parsed, claim, options)

    if claim is None:
        why = f"{parsed.claim_words} does not exist"
    else:
        status_message = claim.status.message or "(no status message yet)"
        why = f"{parsed.claim_words} is {claim.status.phase}, not Allocated: {_quote(status_message)}"
    if options.pending == "deny":
        return _denied(uid, f"{why}; the pod can be created once the claim is Allocated")
    return _gated(parsed, claim, why, options)


def _taken(claim: models.GpuClaim) -> str | None:
    """The message of the claim's DevicesLost condition if True with reason DevicesTaken, else None.

    Other reasons (DeviceUnhealthy, DevicesMissing) give None: those pods are admitted as before.
    """
    for condition in claim.status.conditions:
        if condition.type == constants.CONDITION_DEVICES_LOST:
            if condition.status != "True" or condition.reason != constants.REASON_DEVICES_TAKEN:
                return None
            message = " ".join(condition.message.split())
            if len(message) > _MESSAGE_LIMIT:
                message = message[: _MESSAGE_LIMIT - 1] + "…"
            return message
    return None


def _taken_message(req: PodCreate, taken: str) -> str:
    """The denial for a pod of a claim whose devices another claim holds (DevicesLost, DevicesTaken)."""
    return (
        f"claim {req.namespace}/{req.claim_name} lost devices to another claim: "
        f"{taken or '(the condition gives no details)'}; delete and re-create the claim"
    )


def _replica(req: PodCreate, claim: models.GpuClaim) -> int | str:
    """The replica index for this pod, or a denial message."""
    annotations, labels = mutations.pod_annotations(req.pod), mutations.pod_labels(req.pod)
    replicas = claim.spec.replicas
    if (
        replicas == 1
        and annotations.keys().isdisjoint(pods.REPLICA_ANNOTATIONS)
        and labels.keys().isdisjoint(pods.REPLICA_LABELS)
    ):
        return 0  # the common case: one replica, and the pod names none
    try:
        replica = pods.replica_of({"annotations": annotations, "labels": labels})
    except pods.ReplicaError as exc:
        return str(exc)
    if replica is None:
        if replicas == 1:
            return 0
        sources = ", ".join(words for _, _, words in pods.REPLICA_SOURCES)
        return (
            f"{req.claim_words} has {replicas} replicas and the pod does not say which one it is; "
            f"set one of: {sources}"
        )
    if replica.index >= replicas:
        return (
            f"replica {replica.index} (from {replica.source}) is out of range: {req.claim_words} has "
            f"{replicas} replica{'s' if replicas != 1 else ''} (0..{replicas - 1})"
        )
    return replica.index


def _allocation(claim: models.GpuClaim, replica: int) -> models.Allocation | None:
    """The replica's allocation if it holds devices (a replica's first allocation is the one that counts)."""
    for allocation in claim.status.allocations:
        if allocation.replica == replica:
            return allocation if allocation.devices else None
    return None


_NODE_NAME_WHY = (
    "the pod sets spec.nodeName, which cannot be combined with the scheduling gate the pod "
    "waits behind; remove spec.nodeName"
)


def _sets_node_name(req: PodCreate) -> bool:
    return req.pod.spec is not None and bool(req.pod.spec.node_name)


def _allocated(req: PodCreate, claim: models.GpuClaim, options: Options) -> Decision:
    uid, pod = req.uid, req.pod
    if _sets_node_name(req):
        return _denied(uid, f"{req.claim_words} is Allocated; {_NODE_NAME_WHY}")
    replica = _replica(req, claim)
    if isinstance(replica, str):
        return _denied(uid, replica)
    allocation = _allocation(claim, replica)
    if allocation is None:
        return _denied(uid, f"{req.claim_words} is Allocated but holds no devices for replica {replica}")
    node = allocation.node_name
    pin = mutations.node_pin(pod)
    if pin is not None and pin[1] != node:
        how, pinned = pin
        return _denied(
            uid,
            f"pod {mutations.display_name(pod)} is pinned to node {pinned!r} by {how}, but {req.claim_words} "
            f"(replica {replica}) holds GPUs on node {node!r}; remove the pin or use another claim",
        )
    excluded = pods.affinity_excludes(pod.spec.affinity if pod.spec is not None else None, node)
    if excluded is not None:
        return _denied(
            uid,
            f"pod {mutations.display_name(pod)} is kept off node {node!r} by its {excluded}, but "
            f"{req.claim_words} (replica {replica}) holds GPUs on that node; "
            "remove the pin or use another claim",
        )
    resource_claim = ""
    if options.dra:
        resource_claim = constants.resource_claim_name(req.claim_name, replica)
        foreign = _foreign_claim(req, resource_claim)
        if foreign is not None:
            return _denied(uid, foreign)
    ops, replaced = recipe.edits(pod, claim, allocation, options.device_ids, resource_claim)
    warnings = (
        [f"gpualloc replaced {', '.join(replaced)[:200]} with the devices of {req.claim_words}"]
        if replaced
        else None
    )
    return Decision(answer=allow(uid, patch=ops, warnings=warnings), outcome=MUTATED)


def _gated(req: PodCreate, claim: models.GpuClaim | None, why: str, options: Options = Options()) -> Decision:
    uid, pod = req.uid, req.pod
    if _sets_node_name(req):
        return _denied(uid, f"{why}; {_NODE_NAME_WHY}")
    replica: int | str = 0
    if claim is not None:
        replica = _replica(req, claim)
    elif options.dra:  # the claim is not made yet: the pod's own word, else replica 0
        replica = _named_replica(req)
    if isinstance(replica, str):
        return _denied(uid, replica)
    resource_claim = ""
    if options.dra:
        # spec.resourceClaims cannot be changed once the pod exists: it names its replica's now.
        resource_claim = constants.resource_claim_name(req.claim_name, replica)
        foreign = _foreign_claim(req, resource_claim)
        if foreign is not None:
            return _denied(uid, foreign)
    ops, _ = recipe.edits(pod, claim, resource_claim=resource_claim)
    return Decision(answer=allow(uid, patch=ops), outcome=GATED)


def _named_replica(req: PodCreate) -> int | str:
    """The replica the pod names (0 when it names none), or a denial message."""
    meta = {"annotations": mutations.pod_annotations(req.pod), "labels": mutations.pod_labels(req.pod)}
    try:
        replica = pods.replica_of(meta)
    except pods.ReplicaError as exc:
        return str(exc)
    return 0 if replica is None else replica.index


def _foreign_claim(req: PodCreate, resource_claim: str) -> str | None:
    """The denial for a pod whose own ``spec.resourceClaims`` entry ``gpualloc-gpus`` stands for
    something else than its replica's ResourceClaim ``resource_claim``; None when it has none (or
    that very one: the webhook's reinvocation)."""
    other = mutations.foreign_pod_claim(req.pod, resource_claim)
    if other is None:
        return None
    return (
        f"pod {mutations.display_name(req.pod)} names {other} as spec.resourceClaims entry "
        f"{constants.DRA_POD_CLAIM!r}, the name gpualloc gives the ResourceClaim of {req.claim_words} "
        f"({resource_claim}); remove that entry (gpualloc adds it) or use another name for your own claim"
    )
