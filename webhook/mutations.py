"""Questions asked of a Pod, and the JSON Patch operations that edit it. Pure: no I/O, no clock.

The pod is the typed view ``objects.Pod[Any]`` of the object in the review. The
edits do not change it: each appends RFC 6902 operations to a list, computed
against the pod as it came. ``admission`` decides which edits to make; the
operations of one decision touch disjoint parts of the pod (scheduling gates,
the node selector, each container's env, one annotation, one label), so their
order between edits does not matter. Within the env edit it does: a container
after the first may get the entries by ``copy`` operations from an earlier
container, which follow the operations that put them there.

All edits are idempotent: on a pod the patch was already applied to, they add
no operation, which is what makes the webhook's reinvocation (and the API
server's ``reinvocationPolicy: IfNeeded``) yield an empty second patch.

The two traps of hand-made paths: keys with ``/`` or ``~`` are escaped
(``patches.escape``: ``gpu.scheduling/devices`` is ``gpu.scheduling~1devices``),
and a missing map or ``env`` list is added whole, never appended to. The
property tests apply every patch with ``jsonpatch`` and compare the result
with what a plain dict editor makes of the pod.

Why the common case is written out as it is: in the server every line of
Python an admission runs costs several times what it does in a warm loop
(BENCHMARKS.md), and editing the env of every container is the largest part
of the decision. So the entries come encoded once per claim (an ``Env``, kept
in the claim's ``plans.Target``), a container that has none of their names
gets its operations from one ``str.join`` of pieces made with the ``Env``,
and only a container whose user set one of the names goes through the
general ``set_env``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from gpualloc.api import constants
from webhook import objects, patches

ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ENV_NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
DEVICE_ENV_NAMES: tuple[str, str] = (ENV_CUDA_VISIBLE_DEVICES, ENV_NVIDIA_VISIBLE_DEVICES)

GPU_RESOURCE = "nvidia.com/gpu"
DEVICES_FIELD_PATH = f"metadata.annotations['{constants.ANNOTATION_DEVICES}']"

_EMPTY: Mapping[str, str] = {}

# Env entries by name, each with its JSON text (encoded once per claim: ``Env``).
Wanted = dict[str, tuple[dict[str, Any], str]]


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
    """``(how, node)`` when the pod is already tied to a node by spec.nodeName or a hostname selector."""
    spec = pod.spec
    if spec is None:
        return None
    if spec.node_name:
        return ("spec.nodeName", spec.node_name)
    hostname = (spec.node_selector or _EMPTY).get(constants.HOSTNAME_LABEL)
    if hostname:
        return (f"nodeSelector {constants.HOSTNAME_LABEL}", hostname)
    return None


# ------------------------------------------------------------------ env entries


def value_env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


class Env(msgspec.Struct, frozen=True, gc=False):
    """Env entries to write into every container, encoded once (per claim: ``plans.Target``)."""

    entries: Wanted  # name -> (the entry, its JSON text), in order
    create: tuple[str, ...]  # ``container_path.join(create)``: the op adding an env list of them all
    append: tuple[str, ...]  # ``container_path.join(append)``: the ops appending each to an env list


def env(entries: list[dict[str, Any]]) -> Env:
    """An Env of entries such as ``value_env(...)`` or ``annotation_env(...)``."""
    by_name = {entry["name"]: (entry, patches.text(entry)) for entry in entries}
    texts = [text for _, text in by_name.values()]
    return Env(
        entries=by_name,
        create=patches.adds("/env", ["[" + ",".join(texts) + "]"]),
        append=patches.adds("/env/-", texts),
    )


def annotation_env(name: str) -> dict[str, Any]:
    """An env var the kubelet fills from the ``gpu.scheduling/devices`` annotation when the container starts.

    ``apiVersion: v1`` is written out because the API server defaults it: a
    reinvoked webhook then sees exactly what it wrote and changes nothing.
    """
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": DEVICES_FIELD_PATH}}}


_GATED_SOURCE = annotation_env("")["valueFrom"]


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
    """Whether the entry is the one gate mode writes (read from the devices annotation): not the user's."""
    return item.value is None and bool(msgspec.json.decode(item.value_from) == _GATED_SOURCE)


def set_env(
    path: str,
    env: Sequence[objects.EnvVar],
    ops: list[patches.Op],
    wanted: Wanted,
    start: int = 0,
) -> list[str]:
    """Operations making the entries in ``wanted`` the definitions of their names in the env list at ``path``.

    A user's entry of the same name (``value`` or ``valueFrom``) is replaced in
    place, so later entries referring to it with ``$(NAME)`` still see it;
    later duplicates are removed; names not present are appended. Returns the
    names whose user-set definition differed (an entry gate mode wrote is not the
    user's: a gated pod reinvoked once its claim is Allocated gets its devices
    without a warning). ``wanted`` maps each name to its
    entry and the entry's JSON text; ``path`` is made of fixed keys and
    indices, written into the operations as it is. ``start`` is the index of the
    first entry that may have one of the names (those before it have none).
    """
    placed: set[str] = set()
    replaced: list[str] = []
    duplicates: list[int] = []
    for i in range(start, len(env)):
        item = env[i]
        name = item.name
        if name not in wanted:
            continue
        if name in placed:
            duplicates.append(i)
            continue
        placed.add(name)
        entry, text = wanted[name]
        if not _defines(item, entry):
            if not _ours(item):
                replaced.append(name)
            ops.append(patches.replace_json(f"{path}/env/{i}", text))
    # Replacements first (indices as they came), removals from the end, then appends.
    for i in reversed(duplicates):
        ops.append(patches.remove(f"{path}/env/{i}"))
    for name, (_, text) in wanted.items():
        if name not in placed:
            ops.append(patches.add_json(f"{path}/env/-", text))
    return replaced


def set_env_everywhere(pod: objects.Pod[Any], env: Env, ops: list[patches.Op]) -> list[str]:
    """``set_env`` on every init container and container; returns ``container/NAME`` for each replacement.

    Most containers have none of the names. The first of them gets the entries
    with operations that come whole from ``env`` (the paths are fixed keys and
    indices, nothing to escape); each later one with an env list gets them by
    JSON Patch ``copy`` operations from it, about 90 bytes each instead of the
    whole entry (the benchmark's patch is a third smaller: less to encode,
    send and apply). ``set_env`` takes a container whose user set one of them.
    """
    spec = pod.spec
    if spec is None:
        return []
    wanted = env.entries
    replaced: list[str] = []
    source: tuple[str, int] | None = None  # where the first container's new entries are: (list path, index)
    copies: tuple[str, ...] = ()  # the pieces copying them, made when a second container needs them
    for prefix, containers in (
        ("/spec/initContainers/", spec.init_containers),
        ("/spec/containers/", spec.containers),
    ):
        for i, container in enumerate(containers or ()):
            path = f"{prefix}{i}"
            current = container.env
            if current is None:
                ops.append(path.join(env.create))
                source = source or (f"{path}/env/", 0)  # the entries are the whole new list
                continue
            for item in current:
                if item.name in wanted:  # the user set one of ours: replace it in place
                    for name in set_env(path, current, ops, wanted, current.index(item)):
                        replaced.append(f"{container.name or '<unnamed>'}/{name}")
                    break
            else:
                if source is None:  # the entries are appended after the user's
                    ops.append(path.join(env.append))
                    source = (f"{path}/env/", len(current))
                    continue
                copies = copies or patches.copies(*source, len(wanted), "/env/-")
                ops.append(path.join(copies))
    return replaced


MemberOps = tuple[patches.Op, patches.Op]  # setting a key: (when its map is missing, when it is there)


def member_ops(path: str, key: str, value: str) -> MemberOps:
    """The two operations that set ``key`` to ``value`` in the string map at ``path``."""
    return (patches.add(path, {key: value}), patches.add(f"{path}/{patches.escape(key)}", value))


def _put(
    ops: list[patches.Op],
    parent: str,
    parent_present: bool,
    member: str,
    mapping: Mapping[str, str] | None,
    key: str,
    value: str,
    prepared: MemberOps | None = None,
) -> None:
    """Set ``key`` in the string map ``parent/member`` (now ``mapping``), creating what is missing.

    ``prepared`` is ``member_ops(f"{parent}/{member}", key, value)``, made once for many pods.
    """
    if mapping is None and not parent_present:
        ops.append(patches.add(parent, {member: {key: value}}))
    elif mapping is None or mapping.get(key) != value:  # add replaces a member
        missing, present = prepared or member_ops(f"{parent}/{member}", key, value)
        ops.append(missing if mapping is None else present)


def set_annotation(
    pod: objects.Pod[Any], key: str, value: str, ops: list[patches.Op], prepared: MemberOps | None = None
) -> None:
    meta = pod.metadata
    current = meta.annotations if meta is not None else None
    _put(ops, "/metadata", meta is not None, "annotations", current, key, value, prepared)


def set_label(pod: objects.Pod[Any], key: str, value: str, ops: list[patches.Op]) -> None:
    meta = pod.metadata
    current = meta.labels if meta is not None else None
    _put(ops, "/metadata", meta is not None, "labels", current, key, value)


def remove_annotation(pod: objects.Pod[Any], key: str, ops: list[patches.Op]) -> None:
    if key in pod_annotations(pod):
        ops.append(patches.remove(f"/metadata/annotations/{patches.escape(key)}"))


def pin_to_node(
    pod: objects.Pod[Any], node: str, ops: list[patches.Op], prepared: MemberOps | None = None
) -> None:
    """Add ``nodeSelector kubernetes.io/hostname=<node>`` (other selector keys are kept)."""
    spec = pod.spec
    selector = spec.node_selector if spec is not None else None
    _put(ops, "/spec", spec is not None, "nodeSelector", selector, constants.HOSTNAME_LABEL, node, prepared)


def add_scheduling_gate(pod: objects.Pod[Any], ops: list[patches.Op]) -> None:
    """Add the gate ``gpu.scheduling/claim-allocated`` unless the pod has it."""
    name = constants.SCHEDULING_GATE
    spec = pod.spec
    gate = {"name": name}
    if spec is None:
        ops.append(patches.add("/spec", {"schedulingGates": [gate]}))
    elif spec.scheduling_gates is None:
        ops.append(patches.add("/spec/schedulingGates", [gate]))
    elif not any(g.name == name for g in spec.scheduling_gates):
        ops.append(patches.add("/spec/schedulingGates/-", gate))


def remove_scheduling_gate(pod: objects.Pod[Any], ops: list[patches.Op]) -> None:
    """Remove the gate ``gpu.scheduling/claim-allocated``; the whole list when no other gate is left."""
    name = constants.SCHEDULING_GATE
    gates = pod.spec.scheduling_gates if pod.spec is not None else None
    if not gates:
        return
    ours = [i for i, g in enumerate(gates) if g.name == name]
    if len(ours) == len(gates):
        ops.append(patches.remove("/spec/schedulingGates"))
    else:
        ops.extend(patches.remove(f"/spec/schedulingGates/{i}") for i in reversed(ours))
