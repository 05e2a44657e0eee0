"""``patches.diff`` checked by jsonpatch as the oracle; patch_for vs editing the whole pod."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
from hypothesis import given, settings
from hypothesis import strategies as st

from webhook import admission, mutations, patches

keys = st.sampled_from(["a", "b", "a/b", "~", "~1", "", "env", "0"]) | st.text(max_size=4)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, 1.0, 2.5]), st.text(max_size=3)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=500, deadline=None)
@given(src=json_values, dst=json_values)
def test_diff_applied_by_jsonpatch_turns_src_into_dst(src: Any, dst: Any) -> None:
    ops = patches.diff(src, dst)
    before = copy.deepcopy(src)
    result = jsonpatch.apply_patch(src, ops)
    assert patches.same(result, dst), (src, dst, ops)
    assert patches.same(src, before), "diff leaves its input alone"
    if patches.same(src, dst):
        assert ops == []


@settings(max_examples=200, deadline=None)
@given(value=json_values)
def test_copy_json_is_equal_and_independent(value: Any) -> None:
    copied = patches.copy_json(value)
    assert patches.same(copied, value)
    if isinstance(copied, dict):
        copied["new key"] = 1
        assert "new key" not in value or isinstance(value.get("new key"), int)


env_entry = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "X"]),
        "value": st.text(max_size=3),
    }
)
containers = st.lists(
    st.fixed_dictionaries(
        {"name": st.text(max_size=3), "image": st.just("i")},
        optional={"env": st.lists(env_entry, max_size=4)},
    ),
    max_size=3,
)
pods = st.fixed_dictionaries(
    {},
    optional={
        "metadata": st.fixed_dictionaries(
            {"name": st.just("p")},
            optional={
                "annotations": st.dictionaries(
                    st.sampled_from(["gpu.scheduling/devices", "k"]), st.text(max_size=3)
                )
            },
        ),
        "spec": st.fixed_dictionaries(
            {"containers": containers},
            optional={
                "initContainers": containers,
                "nodeSelector": st.dictionaries(
                    st.sampled_from(["kubernetes.io/hostname", "z"]), st.text(max_size=3)
                ),
                "schedulingGates": st.lists(
                    st.builds(dict, name=st.sampled_from(["g", "gpu.scheduling/claim-allocated"]))
                ),
                "volumes": st.lists(st.builds(dict, name=st.text(max_size=3)), max_size=2),
            },
        ),
    },
)
ENTRIES = [
    mutations.value_env("CUDA_VISIBLE_DEVICES", "GPU-1"),
    mutations.value_env("NVIDIA_VISIBLE_DEVICES", "GPU-1"),
]


@settings(max_examples=300, deadline=None)
@given(pod=pods, gated=st.booleans())
def test_patch_for_the_touched_parts_equals_editing_the_whole_pod(pod: dict[str, Any], gated: bool) -> None:
    def edit(p: dict[str, Any]) -> None:
        if gated:
            admission.edit_gated(p)
        else:
            admission.edit_allocated(p, node="n1", entries=ENTRIES, uuids="GPU-1")

    before = copy.deepcopy(pod)
    ops, _ = admission.patch_for(pod, edit)
    assert pod == before, "the pod is left alone"
    whole = copy.deepcopy(pod)
    edit(whole)
    assert jsonpatch.apply_patch(pod, ops) == whole
