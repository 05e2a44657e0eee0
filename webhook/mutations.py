"""Questions asked of a Pod, and the JSON Patch operations that edit it. Pure: no I/O, no clock.

The pod is the typed view ``objects.Pod[Any]`` of the object in the review. The
edits do not change it: each appends RFC 6902 operations (plain dicts) to a
list, computed against the pod as it came; the answer carries the list
json-encoded. ``recipe`` says which edits a pod gets; the operations of one
decision touch disjoint parts of the pod (scheduling gates, the node selector,
each container's env, one annotation, one label), so their order between edits
does not matter. Within the env edit it does: a container after the first may
get the entries by ``copy`` operations from an earlier container, which follow
the operations that put them there.

All edits are idempotent: on a pod the patch was already applied to, they add
no operation, which is what makes the webhook's reinvocation (and the API
server's ``reinvocationPolicy: IfNeeded``) yield an empty second patch.

Why not ``jsonpatch.make_patch`` of an edited copy: it costs about half a
millisecond for a three-container pod, more than the rest of an admission
together. The two traps of hand-made paths are handled here: keys with ``/``
or ``~`` are escaped (``gpu.scheduling/devices`` is
``gpu.scheduling~1devices``), and a missing map or ``env`` list is added whole,
never appended to. The property tests apply every patch with ``jsonpatch`` and
compare the result with what a plain dict editor makes of the pod.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec

from gpualloc.api import codecs, constants, models
from webhook import objects

ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ENV_NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
DEVICE_ENV_NAMES: tuple[str, str] = (ENV_CUDA_VISIBLE_DEVICES, ENV_NVIDIA_VISIBLE_DEVICES)
ENV_MPS_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_MPS_MEMORY_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

GPU_RESOURCE = "nvidia.com/gpu"
DEVICES_FIELD_PATH = f"metadata.annotations['{constants.ANNOTATION_DEVICES}']"

_EMPTY: Mapping[str, str] = {}

Op = dict[str, Any]  # one RFC 6902 operation


# ------------------------------------------------------------------ operations


def escape(key: str) -> str:
    """One JSON Pointer reference token (RFC 6901): ``~`` -> ``~0``, ``/`` -> ``~1``."""
    return key.replace("~", "~0").replace("/", "~1")


def add(path: str, value: Any) -> Op:
    """Add ``value`` at ``path`` (replacing an existing object member); ``.../-`` appends to an array."""
    return {"op": "add", "path": path, "value": value}


def replace(path: str, value: Any) -> Op:
    return {"op": "replace", "path": path, "value": value}


def remove(path: str) -> Op:
    return {"op": "remove", "path": path}


def copy(source: str, path: str) -> Op:
    return {"op": "copy", "from": source, "path": path}


def add_member(ops: list[Op], parent: str, member: str, value: Any) -> None:
    """Add ``{member: value}`` as ``parent``, which the pod lacks: into the object an earlier
    operation of ``ops`` added there, if one did (a second ``add`` would replace it)."""
    for op in ops:
        if op["op"] == "add" and op["path"] == parent:
            op["value"][member] = value
            return
    ops.append(add(parent, {member: value}))


# ------------------------------------------------------------------ reading


def pod_annotations(pod: objects.Pod[Any]) -> Mapping[str, str]:
    meta = pod.metadata
    return (meta.annotations or _EMPTY) if meta is not None else _EMPTY


def pod_labels(pod: objects.Pod[Any]) -> Mapping[str, str]:
    meta = pod.metadata
    return (meta.labels or _EMPTY) if meta is not None else _EMPTY


def display_name(pod: objects.Pod[Any]) -> str:
    """The pod's name for messages. Controllers create pods with only ``generateName``."""
    meta = pod.metadata or objects.ObjectMeta()
    if meta.name:
        return meta.name
    if meta.generate_name:
        return meta.generate_name + "<generated>"
    return "<unnamed pod>"


def _is_zero(quantity: Any) -> bool:
    if isinstance(quantity, bool):
        return False
    if isinstance(quantity, int | float):
        return quantity == 0
    if isinstance(quantity, str):
        try:
            return float(quantity) == 0
        except ValueError:
            return False
    return False


def _requests_gpu(resources: objects.Resources[Any] | None) -> bool:
    if resources is None:
        return False
    limits, requests = resources.limits, resources.requests
    return (limits is not None and limits.gpu is not None and not _is_zero(limits.gpu)) or (
        requests is not None and requests.gpu is not None and not _is_zero(requests.gpu)
    )


def device_plugin_requests(pod: objects.Pod[Any]) -> list[str]:
    """Names of the containers that request ``nvidia.com/gpu`` (limits or requests, non-zero)."""
    spec = pod.spec
    if spec is None:
        return []
    found = ["<pod>"] if _requests_gpu(spec.resources) else []
    for items in (spec.init_containers, spec.containers):
        for c in items or ():
            if _requests_gpu(c.resources):
                found.append(c.name or "<unnamed>")
    return found


def node_pin(pod: objects.Pod[Any]) -> tuple[str, str] | None:
    """``(how, node)`` when the pod is already tied to a node by a hostname selector (a claim pod
    cannot set spec.nodeName: it waits behind a scheduling gate)."""
    spec = pod.spec
    if spec is None:
        return None
    hostname = (spec.node_selector or _EMPTY).get(constants.HOSTNAME_LABEL)
    if hostname:
        return (f"nodeSelector {constants.HOSTNAME_LABEL}", hostname)
    return None


# ------------------------------------------------------------------ env entries


def value_env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def annotation_env(name: str, annotation: str = constants.ANNOTATION_DEVICES) -> dict[str, Any]:
    """An env var the kubelet fills from the pod's annotation (``gpu.scheduling/devices`` unless
    told) when the container starts.

    ``apiVersion: v1`` is written out because the API server defaults it: a
    reinvoked webhook then sees exactly what it wrote and changes nothing.
    """
    path = f"metadata.annotations['{annotation}']"
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


_GATED_SOURCES = [
    annotation_env("")["valueFrom"],
    annotation_env("", constants.ANNOTATION_MPS_MEMORY_LIMIT)["valueFrom"],  # an MPS share's memory limit
]


# ------------------------------------------------------------------ editing


def _defines(item: objects.EnvVar, entry: Mapping[str, Any]) -> bool:
    """Whether the user's entry already says what ``entry`` says."""
    if item.value != entry.get("value"):
        return False
    source = entry.get("valueFrom")
    if source is None:
        return bytes(item.value_from) == b"null"
    return bool(msgspec.json.decode(item.value_from) == source)


def _ours(item: objects.EnvVar) -> bool:
    """Whether the entry is one gate mode writes (read from an annotation the controller sets): not
    the user's."""
    return item.value is None and msgspec.json.decode(item.value_from) in _GATED_SOURCES


def set_env(
    path: str, env: Sequence[objects.EnvVar], wanted: Mapping[str, dict[str, Any]], ops: list[Op]
) -> list[str]:
    """Operations making the entries in ``wanted`` (by name) the definitions of their names in ``path``'s env.

    A user's entry of the same name (``value`` or ``valueFrom``) is replaced in
    place, so later entries referring to it with ``$(NAME)`` still see it;
    later duplicates are removed; names not present are appended. Returns the
    names whose user-set definition differed (an entry gate mode wrote is not the
    user's: a gated pod reinvoked once its claim is Allocated gets its devices
    without a warning).
    """
    placed: set[str] = set()
    replaced: list[str] = []
    duplicates: list[int] = []
    for i, item in enumerate(env):
        name = item.name
        if name not in wanted:
            continue
        if name in placed:
            duplicates.append(i)
            continue
        placed.add(name)
        entry = wanted[name]
        if not _defines(item, entry):
            if not _ours(item):
                replaced.append(name)
            ops.append(replace(f"{path}/env/{i}", entry))
    # Replacements first (indices as they came), removals from the end, then appends.
    for i in reversed(duplicates):
        ops.append(remove(f"{path}/env/{i}"))
    for name, entry in wanted.items():
        if name not in placed:
            ops.append(add(f"{path}/env/-", entry))
    return replaced


def containers_of(spec: objects.PodSpec[Any]) -> Iterator[tuple[str, objects.Container[Any]]]:
    """Each init container, then each container, with its JSON Pointer (``/spec/containers/0``)."""
    for i, container in enumerate(spec.init_containers or ()):
        yield f"/spec/initContainers/{i}", container
    for i, container in enumerate(spec.containers or ()):
        yield f"/spec/containers/{i}", container


def set_env_everywhere(pod: objects.Pod[Any], entries: list[dict[str, Any]], ops: list[Op]) -> list[str]:
    """``set_env`` on every init container and container; returns ``container/NAME`` for each replacement.

    A container without an env list gets one holding the entries. The first
    container whose list has none of the names gets them appended; each later
    one gets them by JSON Patch ``copy`` from it, about 90 bytes an operation
    instead of the whole entry.
    """
    spec = pod.spec
    if spec is None:
        return []
    wanted = {entry["name"]: entry for entry in entries}
    replaced: list[str] = []
    sources: list[str] | None = None  # where an earlier container's new entries are, one path each
    for path, container in containers_of(spec):
        env = container.env
        if env is None:
            ops.append(add(f"{path}/env", entries))
            sources = sources or [f"{path}/env/{k}" for k in range(len(entries))]
        elif not wanted.keys().isdisjoint([item.name for item in env]):
            name = container.name or "<unnamed>"
            for var in set_env(path, env, wanted, ops):
                replaced.append(f"{name}/{var}")
        elif sources is None:
            for entry in entries:
                ops.append(add(f"{path}/env/-", entry))
            sources = [f"{path}/env/{k}" for k in range(len(env), len(env) + len(entries))]
        else:
            end = f"{path}/env/-"
            for source in sources:
                ops.append(copy(source, end))
    return replaced


def _put(
    ops: list[Op],
    parent: str,
    parent_present: bool,
    member: str,
    mapping: Mapping[str, str] | None,
    key: str,
    value: str,
) -> None:
    """Set ``key`` in the string map ``parent/member`` (now ``mapping``), creating what is missing."""
    if mapping is None and not parent_present:
        add_member(ops, parent, member, {key: value})
    elif mapping is None:
        ops.append(add(f"{parent}/{member}", {key: value}))
    elif mapping.get(key) != value:  # add replaces a member
        ops.append(add(f"{parent}/{member}/{escape(key)}", value))


def set_annotation(pod: objects.Pod[Any], key: str, value: str, ops: list[Op]) -> None:
    meta = pod.metadata
    current = meta.annotations if meta is not None else None
    _put(ops, "/metadata", meta is not None, "annotations", current, key, value)


def set_label(pod: objects.Pod[Any], key: str, value: str, ops: list[Op]) -> None:
    meta = pod.metadata
    current = meta.labels if meta is not None else None
    _put(ops, "/metadata", meta is not None, "labels", current, key, value)


def remove_annotation(pod: objects.Pod[Any], key: str, ops: list[Op]) -> None:
    if key in pod_annotations(pod):
        ops.append(remove(f"/metadata/annotations/{escape(key)}"))


def pin_to_node(pod: objects.Pod[Any], node: str, ops: list[Op]) -> None:
    """Add ``nodeSelector kubernetes.io/hostname=<node>`` (other selector keys are kept)."""
    spec = pod.spec
    selector = spec.node_selector if spec is not None else None
    _put(ops, "/spec", spec is not None, "nodeSelector", selector, constants.HOSTNAME_LABEL, node)


def add_scheduling_gate(pod: objects.Pod[Any], ops: list[Op]) -> None:
    """Add the gate ``gpu.scheduling/claim-allocated`` unless the pod has it."""
    name = constants.SCHEDULING_GATE
    spec = pod.spec
    gate = {"name": name}
    if spec is None:
        add_member(ops, "/spec", "schedulingGates", [gate])
    elif spec.scheduling_gates is None:
        ops.append(add("/spec/schedulingGates", [gate]))
    elif not any(g.name == name for g in spec.scheduling_gates):
        ops.append(add("/spec/schedulingGates/-", gate))


def foreign_pod_claim(pod: objects.Pod[Any], resource_claim: str) -> str | None:
    """What the pod's own ``spec.resourceClaims`` entry named ``gpualloc-gpus`` stands for, when it is
    not the ResourceClaim ``resource_claim`` (the entry ``add_resource_claim`` writes); None when the
    pod has no such entry, or has exactly that one (a reinvocation)."""
    spec = pod.spec
    for entry in (spec.resource_claims if spec is not None else None) or ():
        if entry.name != constants.DRA_POD_CLAIM:
            continue
        if entry.resource_claim_name == resource_claim and entry.resource_claim_template_name is None:
            return None
        if entry.resource_claim_template_name is not None:
            return f"ResourceClaimTemplate {entry.resource_claim_template_name!r}"
        return f"ResourceClaim {entry.resource_claim_name!r}"
    return None


def add_resource_claim(pod: objects.Pod[Any], resource_claim: str, ops: list[Op]) -> None:
    """Add ``{name: gpualloc-gpus, resourceClaimName: resource_claim}`` to ``spec.resourceClaims`` unless
    the pod has an entry of that name (``foreign_pod_claim`` says whether it is another)."""
    entry = {"name": constants.DRA_POD_CLAIM, "resourceClaimName": resource_claim}
    spec = pod.spec
    if spec is None:
        add_member(ops, "/spec", "resourceClaims", [entry])
    elif spec.resource_claims is None:
        ops.append(add("/spec/resourceClaims", [entry]))
    elif not any(c.name == constants.DRA_POD_CLAIM for c in spec.resource_claims):
        ops.append(add("/spec/resourceClaims/-", entry))


def use_resource_claim_everywhere(pod: objects.Pod[Any], ops: list[Op]) -> None:
    """Add ``{name: gpualloc-gpus}`` to ``resources.claims`` of every init container and container (those
    the device env goes to, ``set_env_everywhere``) that does not list it."""
    if pod.spec is None:
        return
    ref = {"name": constants.DRA_POD_CLAIM}
    for path, container in containers_of(pod.spec):
        resources = container.resources
        if resources is None:
            ops.append(add(f"{path}/resources", {"claims": [ref]}))
        elif resources.claims is None:
            ops.append(add(f"{path}/resources/claims", [ref]))
        elif not any(c.name == constants.DRA_POD_CLAIM for c in resources.claims):
            ops.append(add(f"{path}/resources/claims/-", ref))


def add_tolerations(pod: objects.Pod[Any], wanted: Sequence[models.Toleration], ops: list[Op]) -> None:
    """Add each of ``wanted`` that the pod does not carry already (the claim's, and the defaults)."""
    spec = pod.spec
    have = {
        (t.key, t.operator or "Equal", t.value, t.effect, t.toleration_seconds)
        for t in (spec.tolerations if spec is not None else None) or ()
    }
    missing = [
        codecs.encode(w)
        for w in wanted
        if (w.key, w.operator, w.value, w.effect, w.toleration_seconds) not in have
    ]
    if not missing:
        return
    if spec is None:
        add_member(ops, "/spec", "tolerations", missing)
    elif spec.tolerations is None:
        ops.append(add("/spec/tolerations", missing))
    else:
        ops.extend(add("/spec/tolerations/-", t) for t in missing)
