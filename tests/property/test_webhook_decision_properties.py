"""Properties of the admission decision over generated pods and claims (pure, no HTTP)."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import jsonpatch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpualloc.api import constants, models
from gpualloc.api import pods as pod_rules
from tests import admitting, reviews
from webhook import admission, mutations

NS = "ns"
ENV_NAMES = ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PATH", "A", "B"]

env_entry = st.one_of(
    st.builds(lambda n, v: {"name": n, "value": v}, st.sampled_from(ENV_NAMES), st.text(max_size=8)),
    st.builds(
        lambda n: {"name": n, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        st.sampled_from(ENV_NAMES),
    ),
)


@st.composite
def containers(draw: st.DrawFn, prefix: str) -> list[dict[str, Any]]:
    out = []
    for i in range(draw(st.integers(min_value=0 if prefix == "i" else 1, max_value=4))):
        c: dict[str, Any] = {"name": f"{prefix}{i}", "image": "img"}
        env = draw(st.one_of(st.none(), st.just("absent"), st.lists(env_entry, max_size=5)))
        if env != "absent":
            c["env"] = env
        out.append(c)
    return out


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    annotations = {constants.ANNOTATION_CLAIM: "c"}
    labels: dict[str, str] = {}
    source = draw(st.sampled_from(["none", "annotation", "sts", "job-annotation", "job-label"]))
    index = str(draw(st.integers(min_value=0, max_value=2)))
    if source == "annotation":
        annotations[constants.ANNOTATION_REPLICA] = index
    elif source == "sts":
        labels[constants.LABEL_STATEFULSET_POD_INDEX] = index
    elif source == "job-annotation":
        annotations[constants.ANNOTATION_JOB_COMPLETION_INDEX] = index
    elif source == "job-label":
        labels[constants.LABEL_JOB_COMPLETION_INDEX] = index
    if draw(st.booleans()):
        annotations[constants.ANNOTATION_DEVICES] = "GPU-user"
    meta: dict[str, Any] = {"namespace": NS, "annotations": annotations}
    if draw(st.booleans()):
        meta["name"] = "p"
    else:
        meta["generateName"] = "p-"
    if labels:
        meta["labels"] = labels
    spec: dict[str, Any] = {"containers": draw(containers("c"))}
    init = draw(containers("i"))
    if init or draw(st.booleans()):
        spec["initContainers"] = init
    if draw(st.booleans()):
        spec["nodeSelector"] = draw(
            st.dictionaries(
                st.sampled_from(["zone", "kubernetes.io/hostname"]), st.sampled_from(["n0", "n1"])
            )
        )
    if draw(st.booleans()):
        spec["schedulingGates"] = draw(
            st.lists(st.builds(dict, name=st.sampled_from(["x", constants.SCHEDULING_GATE])), max_size=2)
        )
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def claim(phase: str, replicas: int) -> models.GpuClaim:
    allocations = tuple(
        models.Allocation(
            replica=r,
            node_name=f"n{r % 2}",
            devices=(
                models.DeviceRef(index=r, minor=r, uuid=f"GPU-{r}a"),
                models.DeviceRef(index=7, minor=7, uuid=f"GPU-{r}b"),
            ),
        )
        for r in range(replicas)
        if phase == "Allocated"
    )
    return models.GpuClaim(
        metadata=models.ObjectMeta(name="c", namespace=NS),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=2), replicas=replicas),
        status=models.GpuClaimStatus(phase=phase, allocations=allocations, message="why"),
    )


def review(pod: dict[str, Any]) -> dict[str, Any]:
    return reviews.pod_review(pod, namespace=NS, uid="u")


options_st = st.builds(
    admission.Options,
    pending=st.sampled_from(["deny", "gate"]),
    device_ids=st.sampled_from(["uuid", "index"]),
    allow_device_plugin=st.booleans(),
)


def all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod.get("spec") or {}
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def apply(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    if "patch" not in response:
        return pod
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    return result


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pod=pods(),
    phase=st.sampled_from(["Allocated", "Pending", "Failed", "missing"]),
    replicas=st.integers(min_value=1, max_value=3),
    options=options_st,
)
def test_decision_is_well_formed_idempotent_and_leaves_the_input_alone(
    pod: dict[str, Any], phase: str, replicas: int, options: admission.Options
) -> None:
    claims = {} if phase == "missing" else {f"{NS}/c": claim(phase, replicas)}
    lookup = admitting.lookup_from(claims)
    before = copy.deepcopy(pod)
    decision = admitting.decide(review(pod), lookup, options)
    event(decision.outcome)
    assert pod == before, "the review's pod is never modified"
    response = admitting.answer_of(decision)["response"]
    assert response["uid"] == "u"
    if not response["allowed"]:
        assert decision.outcome == admission.DENIED
        assert response["status"]["message"]
        return
    out = apply(pod, response)
    # Reinvocation: the webhook run again on its own output changes nothing.
    again = admitting.decide(review(out), lookup, options)
    assert admitting.answer_of(again)["response"] == {"uid": "u", "allowed": True}
    every = all_containers(out)
    if decision.outcome == admission.MUTATED:
        replica = pod_rules.replica_of(out["metadata"])
        r = replica.index if replica else 0
        allocation = claims[f"{NS}/c"].status.allocations[r]
        assert out["spec"]["nodeSelector"][constants.HOSTNAME_LABEL] == allocation.node_name
        uuids = ",".join(d.uuid for d in allocation.devices)
        assert out["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == uuids
        # The controller lifts the gate once it has checked the claim against the API server.
        assert {"name": constants.SCHEDULING_GATE} in out["spec"]["schedulingGates"]
        assert out["metadata"]["labels"][constants.LABEL_GATED] == "true"
        want = uuids if options.device_ids == "uuid" else ",".join(str(d.index) for d in allocation.devices)
        for c in every:
            names = [e["name"] for e in c["env"]]
            assert names.count("CUDA_VISIBLE_DEVICES") == 1
            assert {"name": "CUDA_VISIBLE_DEVICES", "value": want} in c["env"]
            if options.device_ids == "index":
                assert {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"} in c["env"]
    else:
        assert decision.outcome == admission.GATED
        assert options.pending == "gate" and phase != "Allocated"
        assert {"name": constants.SCHEDULING_GATE} in out["spec"]["schedulingGates"]
        assert constants.ANNOTATION_DEVICES not in out["metadata"]["annotations"]
        for c in every:
            assert [e for e in c["env"] if e["name"] == "CUDA_VISIBLE_DEVICES"] == [
                mutations.annotation_env("CUDA_VISIBLE_DEVICES")
            ]
    # Entries the webhook does not own are kept, in their order.
    for c_before, c_after in zip(all_containers(pod), every, strict=True):
        owned = {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}
        if decision.outcome == admission.MUTATED and options.device_ids == "index":
            owned.add("CUDA_DEVICE_ORDER")
        kept = [e for e in c_before.get("env") or [] if e["name"] not in owned]
        assert [e for e in c_after["env"] if e["name"] not in owned] == kept


DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@settings(max_examples=2000)
@given(
    st.one_of(
        st.text(alphabet="ab09-._/A\n", max_size=12),
        st.text(max_size=8),
        st.text(alphabet="a.", min_size=250, max_size=256),
    )
)
def test_claim_name_check_is_the_dns_1123_subdomain_rule(name: str) -> None:
    expected = len(name) <= 253 and DNS_1123_SUBDOMAIN.fullmatch(name) is not None
    assert admission._valid_name(name) == expected
