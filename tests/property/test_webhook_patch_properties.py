"""The hand-built patches, checked against a plain dict editor with ``jsonpatch`` applying them.

``recipe.edit_allocated`` and ``recipe.edit_gated`` build RFC 6902 operations
against the pod as it came. The oracle here edits a deep copy of the pod the
obvious way; ``jsonpatch.apply_patch`` of the webhook's operations must give
exactly that document, for pods with and without metadata, spec, env lists
(absent, null, with duplicates), node selectors, scheduling gates and
annotations, and with keys that need escaping.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpualloc.api import constants, models
from webhook import mutations, objects, recipe

GATE = constants.SCHEDULING_GATE
ENTRIES = [
    mutations.value_env("CUDA_VISIBLE_DEVICES", "GPU-1"),
    mutations.value_env("NVIDIA_VISIBLE_DEVICES", "GPU-1"),
]
TARGET = models.Allocation(
    replica=0, node_name="n1", devices=(models.DeviceRef(index=0, minor=0, uuid="GPU-1"),)
)
GATED_ENTRIES = [mutations.annotation_env(name) for name in mutations.DEVICE_ENV_NAMES]

env_entry = st.one_of(
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "X"]),
            "value": st.sampled_from(["GPU-1", "0", ""]),
        }
    ),
    st.sampled_from(GATED_ENTRIES),
)
containers = st.lists(
    st.fixed_dictionaries(
        {"name": st.text(max_size=3), "image": st.just("i")},
        optional={"env": st.none() | st.lists(env_entry, max_size=4)},
    ),
    max_size=3,
)
string_maps = st.dictionaries(
    st.sampled_from(["gpu.scheduling/devices", "gpu.scheduling/gated", "k", "a~b", "kubernetes.io/hostname"]),
    st.sampled_from(["", "n1", "true", "GPU-1"]),
)
pods = st.fixed_dictionaries(
    {},
    optional={
        "metadata": st.fixed_dictionaries(
            {"name": st.just("p")},
            optional={"annotations": st.none() | string_maps, "labels": st.none() | string_maps},
        ),
        "spec": st.fixed_dictionaries(
            {},
            optional={
                "containers": containers,
                "initContainers": containers,
                "nodeSelector": st.none() | string_maps,
                "schedulingGates": st.none()
                | st.lists(st.builds(dict, name=st.sampled_from(["g", GATE])), max_size=3),
                "volumes": st.lists(st.builds(dict, name=st.text(max_size=3)), max_size=2),
            },
        ),
    },
)


# ------------------------------------------------------------------ the oracle: a plain dict editor


def set_env(container: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    wanted = {e["name"]: e for e in entries}
    out: list[dict[str, Any]] = []
    placed: set[str] = set()
    for item in container.get("env") or []:
        name = item["name"]
        if name not in wanted:
            out.append(item)
        elif name not in placed:
            out.append(wanted[name])
            placed.add(name)
    out += [e for e in entries if e["name"] not in placed]
    container["env"] = out


def put(obj: dict[str, Any], member: str, key: str, value: str) -> None:
    if obj.get(member) is None:
        obj[member] = {}
    obj[member][key] = value


def gate(pod: dict[str, Any]) -> None:
    spec = pod.setdefault("spec", {})
    if spec.get("schedulingGates") is None:
        spec["schedulingGates"] = []
    if {"name": GATE} not in spec["schedulingGates"]:
        spec["schedulingGates"].append({"name": GATE})
    put(pod.setdefault("metadata", {}), "labels", constants.LABEL_GATED, "true")


def edit_allocated(pod: dict[str, Any]) -> None:
    put(pod.setdefault("spec", {}), "nodeSelector", constants.HOSTNAME_LABEL, "n1")
    for key in ("initContainers", "containers"):
        for container in pod["spec"].get(key) or []:
            set_env(container, ENTRIES)
    put(pod.setdefault("metadata", {}), "annotations", constants.ANNOTATION_DEVICES, "GPU-1")
    gate(pod)


def edit_gated(pod: dict[str, Any]) -> None:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    annotations.pop(constants.ANNOTATION_DEVICES, None)
    gate(pod)
    spec = pod["spec"]
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or []:
            set_env(container, GATED_ENTRIES)


# ------------------------------------------------------------------ properties


def typed(pod: dict[str, Any]) -> objects.Pod:
    decoded = objects.decode_pod(json.dumps(pod).encode())
    assert decoded is not None
    return decoded


@settings(max_examples=400, deadline=None)
@given(pod=pods, gated=st.booleans())
def test_patch_applied_by_jsonpatch_equals_editing_the_pod(pod: dict[str, Any], gated: bool) -> None:
    if gated:
        ops = recipe.edit_gated(typed(pod))
    else:
        ops, _ = recipe.edit_allocated(typed(pod), TARGET)
    want = copy.deepcopy(pod)
    (edit_gated if gated else edit_allocated)(want)
    assert jsonpatch.apply_patch(pod, ops) == want, ops


@settings(max_examples=200, deadline=None)
@given(pod=pods, gated=st.booleans())
def test_patch_of_a_patched_pod_is_empty(pod: dict[str, Any], gated: bool) -> None:
    def ops_for(p: dict[str, Any]) -> list[mutations.Op]:
        if gated:
            return recipe.edit_gated(typed(p))
        return recipe.edit_allocated(typed(p), TARGET)[0]

    once = jsonpatch.apply_patch(pod, ops_for(pod))
    assert ops_for(once) == []


@settings(max_examples=200, deadline=None)
@given(pod=pods)
def test_replaced_names_are_the_user_entries_that_differed(pod: dict[str, Any]) -> None:
    _, replaced = recipe.edit_allocated(typed(pod), TARGET)
    expected = []
    for key in ("initContainers", "containers"):
        for container in (pod.get("spec") or {}).get(key) or []:
            seen: set[str] = set()
            for item in container.get("env") or []:
                name = item["name"]
                if name in {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"} and name not in seen:
                    seen.add(name)
                    gate_mode_wrote_it = item == mutations.annotation_env(name)  # not the user's entry
                    if item != {"name": name, "value": "GPU-1"} and not gate_mode_wrote_it:
                        expected.append(f"{container['name'] or '<unnamed>'}/{name}")
    assert replaced == expected
