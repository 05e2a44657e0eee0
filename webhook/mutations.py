"""Edits to a Pod's JSON, and questions asked of it. Pure: no I/O, no clock.

Every function here works on the plain dict the API server sent (a deep copy
owned by the caller when it mutates). ``admission`` decides which edits to make
and diffs the result into a JSON Patch; nothing here builds patch paths.

All edits are idempotent: applying one to a pod it was already applied to
changes nothing, which is what makes the webhook's reinvocation (and the
API server's ``reinvocationPolicy: IfNeeded``) yield an empty second patch.

Sharing: the edits change the pod's ``metadata``, ``spec`` and container
objects in place, but anything below them (annotations, nodeSelector,
schedulingGates, env lists and their entries) is replaced by a new object,
never changed. So an edit of ``touched_parts(pod)`` leaves the pod alone, and
a diff of the parts before and after may skip what they still share.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gpualloc.api import constants
from webhook import patches

ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ENV_NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
DEVICE_ENV_NAMES = (ENV_CUDA_VISIBLE_DEVICES, ENV_NVIDIA_VISIBLE_DEVICES)

GPU_RESOURCE = "nvidia.com/gpu"
DEVICES_FIELD_PATH = f"metadata.annotations['{constants.ANNOTATION_DEVICES}']"

# Container lists present in a Pod CREATE. Ephemeral containers are only ever
# added later through the pods/ephemeralcontainers subresource.
CONTAINER_LISTS = ("initContainers", "containers")


class PodShapeError(ValueError):
    """The object does not have the shape of a Pod (a section has the wrong type)."""


# ------------------------------------------------------------------ reading


def section(obj: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``obj[key]`` as a mapping: absent or null reads as empty; any other type is a shape error."""
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PodShapeError(f"{key} must be an object, not {type(value).__name__}")
    return value


def check_shape(pod: Any) -> None:
    """Raise PodShapeError unless ``pod`` has the sections a Pod has, with the right types.

    The API server only ever sends real Pods; this guards the webhook against
    hand-made reviews, so the code after it may index without ``isinstance`` at
    every step.
    """
    if not isinstance(pod, dict):
        raise PodShapeError(f"the object must be a JSON object, not {type(pod).__name__}")
    kind = pod.get("kind")
    if kind is not None and kind != "Pod":
        raise PodShapeError(f"the object is a {kind!r}, not a Pod")
    meta = section(pod, "metadata")
    for key in ("annotations", "labels"):
        for k, v in section(meta, key).items():
            if not isinstance(v, str):
                raise PodShapeError(f"metadata.{key}[{k!r}] must be a string")
    for key in ("name", "generateName", "namespace"):
        if meta.get(key) is not None and not isinstance(meta.get(key), str):
            raise PodShapeError(f"metadata.{key} must be a string")
    spec = section(pod, "spec")
    if spec.get("nodeName") is not None and not isinstance(spec.get("nodeName"), str):
        raise PodShapeError("spec.nodeName must be a string")
    for k, v in section(spec, "nodeSelector").items():
        if not isinstance(v, str):
            raise PodShapeError(f"spec.nodeSelector[{k!r}] must be a string")
    for key in (*CONTAINER_LISTS, "schedulingGates"):
        value = spec.get(key)
        if value is not None and not isinstance(value, list):
            raise PodShapeError(f"spec.{key} must be a list")
    for key in CONTAINER_LISTS:
        for i, container in enumerate(spec.get(key) or ()):
            if not isinstance(container, dict):
                raise PodShapeError(f"spec.{key}[{i}] must be an object")
            env = container.get("env")
            if env is not None and not isinstance(env, list):
                raise PodShapeError(f"spec.{key}[{i}].env must be a list")
            resources = section(container, "resources")
            section(resources, "limits")
            section(resources, "requests")


def pod_annotations(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return section(section(pod, "metadata"), "annotations")


def display_name(pod: Mapping[str, Any]) -> str:
    """The pod's name for messages. Controllers create pods with only ``generateName``."""
    meta = section(pod, "metadata")
    name = meta.get("name")
    if isinstance(name, str) and name:
        return name
    generate = meta.get("generateName")
    if isinstance(generate, str) and generate:
        return generate + "<generated>"
    return "<unnamed pod>"


def containers(pod: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Init containers then containers: every container of a Pod CREATE."""
    spec = section(pod, "spec")
    for key in CONTAINER_LISTS:
        for container in spec.get(key) or ():
            if isinstance(container, dict):
                yield container


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


def device_plugin_requests(pod: Mapping[str, Any]) -> list[str]:
    """Names of the containers that request ``nvidia.com/gpu`` (limits or requests, non-zero)."""
    found: list[str] = []
    spec = section(pod, "spec")
    pod_resources = spec.get("resources")
    sources: list[tuple[str, Any]] = [("<pod>", pod_resources)] if isinstance(pod_resources, dict) else []
    sources += [(str(c.get("name") or "<unnamed>"), c.get("resources")) for c in containers(pod)]
    for name, resources in sources:
        if not isinstance(resources, dict):
            continue
        for kind in ("limits", "requests"):
            amounts = resources.get(kind)
            if isinstance(amounts, dict) and GPU_RESOURCE in amounts and not _is_zero(amounts[GPU_RESOURCE]):
                found.append(name)
                break
    return found


def node_pin(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(how, node)`` when the pod is already tied to a node by spec.nodeName or a hostname selector."""
    spec = section(pod, "spec")
    node_name = spec.get("nodeName")
    if isinstance(node_name, str) and node_name:
        return ("spec.nodeName", node_name)
    hostname = section(spec, "nodeSelector").get(constants.HOSTNAME_LABEL)
    if isinstance(hostname, str) and hostname:
        return (f"nodeSelector {constants.HOSTNAME_LABEL}", hostname)
    return None


# ------------------------------------------------------------------ the parts edited

# Everything the edits below may change: diffing only these keeps a patch cheap on big pods.
TOUCHED_METADATA = ("annotations", "labels")
TOUCHED_SPEC = ("nodeSelector", "schedulingGates")
TOUCHED_CONTAINER = ("name", "env")  # the name only for messages


def touched_parts(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of ``pod`` the edits here may change, at the same paths, and no more.

    A key is in the result exactly when it is in the pod, and container lists
    keep their length and order (each container cut down to its name and
    env), so an edit of a copy of the result, diffed against the result,
    gives a JSON Patch with the same effect on the whole pod. The result
    shares its values with ``pod``: copy it before editing.
    """
    view: dict[str, Any] = {}
    meta = pod.get("metadata")
    if isinstance(meta, dict):
        view["metadata"] = {k: meta[k] for k in TOUCHED_METADATA if k in meta}
    spec = pod.get("spec")
    if isinstance(spec, dict):
        part = {k: spec[k] for k in TOUCHED_SPEC if k in spec}
        for key in CONTAINER_LISTS:
            if key not in spec:
                continue
            items = spec[key]
            if isinstance(items, list):
                part[key] = [
                    {k: c[k] for k in TOUCHED_CONTAINER if k in c} if isinstance(c, dict) else c
                    for c in items
                ]
            else:
                part[key] = items
        view["spec"] = part
    return view


# ------------------------------------------------------------------ editing


def value_env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def annotation_env(name: str) -> dict[str, Any]:
    """An env var the kubelet fills from the ``gpu.scheduling/devices`` annotation when the container starts.

    ``apiVersion: v1`` is written out because the API server defaults it: a
    reinvoked webhook then sees exactly what it wrote and changes nothing.
    """
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": DEVICES_FIELD_PATH}}}


def set_env(container: dict[str, Any], entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Make ``entries`` the container's definitions of their names.

    A user's entry of the same name (``value`` or ``valueFrom``) is replaced in
    place, so later entries referring to it with ``$(NAME)`` still see it;
    duplicates are dropped; names not present are appended; a missing ``env``
    is created. The container gets a new list (see the module's note on
    sharing); entries that stay are the same objects. Returns the names whose
    user-set definition was different.
    """
    env = container.get("env")
    if not isinstance(env, list):
        env = []
    wanted = {str(e["name"]): e for e in entries}
    placed: set[str] = set()
    replaced: list[str] = []
    out: list[Any] = []
    for item in env:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name not in wanted:
            out.append(item)
            continue
        if name in placed:
            continue
        if patches.same(item, wanted[name]):
            out.append(item)
        else:
            replaced.append(name)
            out.append(dict(wanted[name]))
        placed.add(name)
    out.extend(dict(e) for e in entries if e["name"] not in placed)
    if "env" not in container or not patches.same(env, out):
        container["env"] = out
    return replaced


def set_env_everywhere(pod: dict[str, Any], entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """``set_env`` on every container and init container; returns ``container/NAME`` for each replacement."""
    replaced: list[str] = []
    for container in containers(pod):
        names = set_env(container, entries)
        cname = str(container.get("name") or "<unnamed>")
        replaced += [f"{cname}/{n}" for n in names]
    return replaced


def _ensure_section(obj: dict[str, Any], key: str) -> dict[str, Any]:
    """``obj[key]``, created when missing: only for ``metadata`` and ``spec`` (changed in place)."""
    value = obj.get(key)
    if not isinstance(value, dict):
        value = {}
        obj[key] = value
    return value


def _with(mapping: Any, key: str, value: str) -> dict[str, Any]:
    return {**(mapping if isinstance(mapping, dict) else {}), key: value}


def set_annotation(pod: dict[str, Any], key: str, value: str) -> None:
    meta = _ensure_section(pod, "metadata")
    current = meta.get("annotations")
    if not (isinstance(current, dict) and current.get(key) == value):
        meta["annotations"] = _with(current, key, value)


def set_label(pod: dict[str, Any], key: str, value: str) -> None:
    meta = _ensure_section(pod, "metadata")
    current = meta.get("labels")
    if not (isinstance(current, dict) and current.get(key) == value):
        meta["labels"] = _with(current, key, value)


def remove_annotation(pod: dict[str, Any], key: str) -> None:
    meta = pod.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("annotations"), dict) and key in meta["annotations"]:
        meta["annotations"] = {k: v for k, v in meta["annotations"].items() if k != key}


def pin_to_node(pod: dict[str, Any], node: str) -> None:
    """Add ``nodeSelector kubernetes.io/hostname=<node>`` (other selector keys are kept)."""
    spec = _ensure_section(pod, "spec")
    current = spec.get("nodeSelector")
    if not (isinstance(current, dict) and current.get(constants.HOSTNAME_LABEL) == node):
        spec["nodeSelector"] = _with(current, constants.HOSTNAME_LABEL, node)


def add_scheduling_gate(pod: dict[str, Any], name: str = constants.SCHEDULING_GATE) -> None:
    spec = _ensure_section(pod, "spec")
    gates = spec.get("schedulingGates")
    gates = gates if isinstance(gates, list) else []
    if not any(isinstance(g, dict) and g.get("name") == name for g in gates):
        spec["schedulingGates"] = [*gates, {"name": name}]


def remove_scheduling_gate(pod: dict[str, Any], name: str = constants.SCHEDULING_GATE) -> None:
    spec = pod.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("schedulingGates"), list):
        return
    gates = [g for g in spec["schedulingGates"] if not (isinstance(g, dict) and g.get("name") == name)]
    if len(gates) == len(spec["schedulingGates"]):
        return
    if gates:
        spec["schedulingGates"] = gates
    else:
        del spec["schedulingGates"]
