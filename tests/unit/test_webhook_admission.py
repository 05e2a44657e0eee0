"""The admission decision, as a pure function: AdmissionReview in, response out."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
from typing import Any

import jsonpatch
import pytest

from gpualloc.api import codecs, constants, models
from tests import admitting, reviews
from webhook import admission, mutations, objects, recipe

NS = "team-a"
UUIDS = ["GPU-aaaaaaaa-0000-0000-0000-000000000001", "GPU-bbbbbbbb-0000-0000-0000-000000000002"]


def make_claim(
    name: str = "train",
    *,
    namespace: str = NS,
    phase: str = constants.PHASE_ALLOCATED,
    replicas: int = 1,
    nodes: tuple[str, ...] = ("gpu-node-1",),
    message: str = "",
    deleting: bool = False,
    conditions: tuple[models.Condition, ...] = (),
) -> models.GpuClaim:
    allocations: tuple[models.Allocation, ...] = ()
    if phase == constants.PHASE_ALLOCATED:
        allocations = tuple(
            models.Allocation(
                replica=r,
                node_name=nodes[r % len(nodes)],
                devices=tuple(
                    models.DeviceRef(index=4 + 2 * r + i, minor=4 + 2 * r + i, uuid=f"{UUIDS[i]}-r{r}")
                    for i in range(2)
                ),
            )
            for r in range(replicas)
        )
    return models.GpuClaim(
        metadata=models.ObjectMeta(
            name=name, namespace=namespace, deletion_timestamp="2025-01-01T00:00:00Z" if deleting else None
        ),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=2), replicas=replicas),
        status=models.GpuClaimStatus(
            phase=phase, allocations=allocations, message=message, conditions=conditions
        ),
    )


def uuids(replica: int = 0) -> str:
    return ",".join(f"{u}-r{replica}" for u in UUIDS)


def make_pod(
    claim: str | None = "train",
    *,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    spec: dict[str, Any] | None = None,
    name: str = "worker",
) -> dict[str, Any]:
    ann = dict(annotations or {})
    if claim is not None:
        ann[constants.ANNOTATION_CLAIM] = claim
    meta: dict[str, Any] = {"name": name, "namespace": NS}
    if ann:
        meta["annotations"] = ann
    if labels:
        meta["labels"] = labels
    pod_spec: dict[str, Any] = {"containers": containers or [{"name": "main", "image": "cuda"}]}
    if init is not None:
        pod_spec["initContainers"] = init
    pod_spec.update(spec or {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def make_review(pod: Any, **fields: Any) -> dict[str, Any]:
    return reviews.pod_review(pod, namespace=NS, **fields)


def lookup(*claims: models.GpuClaim) -> admission.ClaimLookup:
    return admitting.lookup_from({c.key: c for c in claims})


def answer(pod: Any, *claims: models.GpuClaim, options: admission.Options | None = None) -> dict[str, Any]:
    out = admitting.admit(make_review(pod), lookup(*claims), options or admission.Options())
    assert out["apiVersion"] == "admission.k8s.io/v1"
    assert out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == "uid-1"
    return out["response"]


def patch_ops(response: dict[str, Any]) -> list[dict[str, Any]]:
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return ops


def patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = jsonpatch.apply_patch(pod, patch_ops(response))
    return result


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod["spec"].get("initContainers", [])) + list(pod["spec"]["containers"])


# ------------------------------------------------------------ passing through


def test_pod_without_claim_annotation_is_allowed_with_no_patch() -> None:
    response = answer(make_pod(claim=None))
    assert response == {"uid": "uid-1", "allowed": True}


def test_non_pod_kind_is_allowed_with_no_patch() -> None:
    out = admitting.admit(make_review({"kind": "Deployment"}, kind="Deployment"), lookup())
    assert out["response"] == {"uid": "uid-1", "allowed": True}


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE", "CONNECT"])
def test_non_create_operations_are_allowed_with_no_patch(operation: str) -> None:
    out = admitting.admit(make_review(make_pod(), operation=operation), lookup(make_claim()))
    assert out["response"] == {"uid": "uid-1", "allowed": True}


def test_subresource_requests_are_allowed_with_no_patch() -> None:
    review = make_review(make_pod())
    review["request"]["subResource"] = "binding"
    assert admitting.admit(review, lookup(make_claim()))["response"] == {"uid": "uid-1", "allowed": True}


# ------------------------------------------------------------ allocated claims


def test_allocated_claim_pins_node_sets_env_in_every_container_and_records_devices() -> None:
    pod = make_pod(
        containers=[
            {"name": "main", "image": "cuda"},
            {"name": "side", "image": "cuda", "env": [{"name": "A", "value": "1"}]},
        ],
        init=[{"name": "prep", "image": "cuda"}],
    )
    response = answer(pod, make_claim())
    out = patched(pod, response)
    assert out["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "gpu-node-1"}
    assert out["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == uuids()
    for container in all_containers(out):
        env = env_of(container)
        assert env["CUDA_VISIBLE_DEVICES"] == uuids()
        assert env["NVIDIA_VISIBLE_DEVICES"] == uuids()
        assert "CUDA_DEVICE_ORDER" not in env
    side = out["spec"]["containers"][1]
    assert side["env"][0] == {"name": "A", "value": "1"}, "the user's other env entries stay first"


def test_container_without_env_gets_an_env_list_created_by_the_patch() -> None:
    pod = make_pod()
    ops = patch_ops(answer(pod, make_claim()))
    env_ops = [op for op in ops if op["path"].startswith("/spec/containers/0/env")]
    assert env_ops and env_ops[0]["op"] == "add" and env_ops[0]["path"] == "/spec/containers/0/env"
    assert isinstance(env_ops[0]["value"], list)


def test_annotation_and_label_keys_with_slashes_are_escaped_in_patch_paths() -> None:
    pod = make_pod(spec={"nodeSelector": {"zone": "a"}})
    ops = patch_ops(answer(pod, make_claim()))
    paths = {op["path"] for op in ops}
    assert "/metadata/annotations/gpu.scheduling~1devices" in paths
    assert "/spec/nodeSelector/kubernetes.io~1hostname" in paths


def test_node_selector_is_created_when_the_pod_has_none() -> None:
    ops = patch_ops(answer(make_pod(), make_claim()))
    assert {
        "op": "add",
        "path": "/spec/nodeSelector",
        "value": {constants.HOSTNAME_LABEL: "gpu-node-1"},
    } in ops


@pytest.mark.parametrize(
    "user_entry",
    [
        {"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
        {"name": "CUDA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
        {"name": "CUDA_VISIBLE_DEVICES", "value": None, "valueFrom": None},
    ],
)
def test_user_set_cuda_visible_devices_is_replaced_in_place(user_entry: dict[str, Any]) -> None:
    pod = make_pod(
        containers=[
            {
                "name": "main",
                "env": [
                    user_entry,
                    {"name": "USES", "value": "$(CUDA_VISIBLE_DEVICES)"},
                    {"name": "CUDA_VISIBLE_DEVICES", "value": "duplicate"},
                ],
            }
        ]
    )
    response = answer(pod, make_claim())
    env = patched(pod, response)["spec"]["containers"][0]["env"]
    assert env[0] == {"name": "CUDA_VISIBLE_DEVICES", "value": uuids()}
    assert env[1] == {"name": "USES", "value": "$(CUDA_VISIBLE_DEVICES)"}
    assert [e["name"] for e in env].count("CUDA_VISIBLE_DEVICES") == 1
    assert env[-1] == {"name": "NVIDIA_VISIBLE_DEVICES", "value": uuids()}
    assert "main/CUDA_VISIBLE_DEVICES" in response["warnings"][0]


def test_index_mode_writes_host_indices_and_pci_bus_order() -> None:
    pod = make_pod(init=[{"name": "prep"}])
    response = answer(pod, make_claim(), options=admission.Options(device_ids="index"))
    out = patched(pod, response)
    for container in all_containers(out):
        env = env_of(container)
        assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert out["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == uuids(), "the record stays UUIDs"


@pytest.mark.parametrize("device_ids", ["uuid", "index"])
def test_mig_instances_are_given_by_uuid_in_every_mode(device_ids: admission.DeviceIdMode) -> None:
    # An index names a whole GPU: a MIG instance (here on GPU 0) only has its MIG- UUID.
    mig = [models.DeviceRef(index=0, minor=0, uuid="MIG-11111111-2222-3333-4444-555555555555")]
    env = {e["name"]: e["value"] for e in recipe.device_env(mig, device_ids)}
    assert env == {"CUDA_VISIBLE_DEVICES": mig[0].uuid, "NVIDIA_VISIBLE_DEVICES": mig[0].uuid}


def test_pod_already_pinned_to_the_allocated_node_is_admitted() -> None:
    pod = make_pod(spec={"nodeSelector": {constants.HOSTNAME_LABEL: "gpu-node-1"}})
    out = patched(pod, answer(pod, make_claim()))
    assert out["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "gpu-node-1"}


def test_pod_pinned_to_another_node_is_denied_with_a_message_saying_so() -> None:
    response = answer(make_pod(spec={"nodeSelector": {constants.HOSTNAME_LABEL: "other-node"}}), make_claim())
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "other-node" in message and "nodeSelector kubernetes.io/hostname" in message
    assert "gpu-node-1" in message


@pytest.mark.parametrize("node", ["gpu-node-1", "other-node"])
def test_pod_that_sets_node_name_is_denied_because_it_could_not_wait_at_the_gate(node: str) -> None:
    response = answer(make_pod(spec={"nodeName": node}), make_claim())
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "spec.nodeName" in message and "scheduling gate" in message and "is Allocated" in message


def test_pod_kept_off_the_allocated_node_by_required_node_affinity_is_denied_naming_the_rule() -> None:
    response = answer(make_pod(spec={"affinity": reviews.name_affinity("In", "other-node")}), make_claim())
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "required node affinity (metadata.name In [other-node])" in message
    assert "'gpu-node-1'" in message and "GpuClaim team-a/train" in message


@pytest.mark.parametrize(
    "affinity",
    [reviews.name_affinity("In", "gpu-node-1", "other-node"), reviews.name_affinity("NotIn", "other-node")],
)
def test_pod_whose_node_affinity_allows_the_allocated_node_is_admitted_and_keeps_it(
    affinity: dict[str, Any],
) -> None:
    pod = make_pod(spec={"affinity": affinity})
    out = patched(pod, answer(pod, make_claim()))
    assert out["spec"]["affinity"] == affinity
    assert out["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "gpu-node-1"}


def test_generate_name_only_pod_gets_a_message_without_crashing() -> None:
    pod = make_pod(spec={"nodeSelector": {constants.HOSTNAME_LABEL: "other-node"}})
    del pod["metadata"]["name"]
    pod["metadata"]["generateName"] = "job-"
    response = answer(pod, make_claim())
    assert response["allowed"] is False
    assert "job-" in response["status"]["message"]


def test_claim_being_deleted_is_denied() -> None:
    response = answer(make_pod(), make_claim(deleting=True))
    assert response["allowed"] is False and "being deleted" in response["status"]["message"]


GPU_POOL = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.mark.parametrize("phase", [constants.PHASE_ALLOCATED, constants.PHASE_PENDING])
def test_claim_pods_get_the_claims_tolerations_and_the_gpu_pool_default_once(phase: str) -> None:
    claim = make_claim(phase=phase)
    team = models.Toleration(key="team", value="ml", effect="NoExecute", toleration_seconds=30)
    claim = dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, tolerations=(team,)))
    options = admission.Options(pending="gate")
    out = patched(make_pod(), answer(make_pod(), claim, options=options))
    want_team = {
        "key": "team",
        "operator": "Equal",
        "value": "ml",
        "effect": "NoExecute",
        "tolerationSeconds": 30,
    }
    assert out["spec"]["tolerations"] == [want_team, {**GPU_POOL, "value": ""}]
    # A pod that carries one already gets only the other.
    pod = make_pod(
        spec={"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    )
    again = patched(pod, answer(pod, claim, options=options))
    assert again["spec"]["tolerations"] == [GPU_POOL, want_team]


@pytest.mark.parametrize(
    "release", [constants.RELEASE_ON_PODS_COMPLETED, constants.RELEASE_ON_OWNER_COMPLETED]
)
@pytest.mark.parametrize("fenced", [False, True])
def test_a_released_claim_or_one_being_released_admits_no_pod(fenced: bool, release: str) -> None:
    fence = "its work is done; its GPUs are being released"
    if fenced:
        releasing = models.Condition(
            type=constants.CONDITION_RELEASING, status="True", reason="PodsCompleted", message=fence
        )
        claim = make_claim(conditions=(releasing,))
    else:
        claim = make_claim(phase=constants.PHASE_RELEASED)
    claim = dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, release=release))
    for pending in ("deny", "gate"):
        response = answer(make_pod(), claim, options=admission.Options(pending=pending))  # type: ignore[arg-type]
        assert response["allowed"] is False
        assert response["status"]["message"] == (
            f"GpuClaim {NS}/train is giving its GPUs back: {fence}"
            if fenced
            else f"GpuClaim {NS}/train was released when its work was done (release: {release});"
            " create a new claim"
        )


TAKEN = (
    "gpu-5/GPU-bbbbbbbb-0000-0000-0000-000000000002-r0 is held by claim ml/other; "
    "delete and re-create this claim to get other GPUs"
)


def devices_lost(reason: str, message: str = TAKEN, status: str = "True") -> tuple[models.Condition, ...]:
    allocated = models.Condition(type=constants.CONDITION_ALLOCATED, status="True", reason="Allocated")
    lost = models.Condition(
        type=constants.CONDITION_DEVICES_LOST, status=status, reason=reason, message=message
    )
    return (allocated, lost)


@pytest.mark.parametrize("pending", ["deny", "gate"])
def test_claim_that_lost_devices_to_another_claim_is_denied_naming_the_holder(
    pending: admission.PendingMode,
) -> None:
    claim = make_claim(conditions=devices_lost(constants.REASON_DEVICES_TAKEN))
    outcome = admitting.decide(make_review(make_pod()), lookup(claim), admission.Options(pending=pending))
    response = admitting.answer_of(outcome)["response"]
    assert outcome.outcome == admission.DENIED
    assert response["allowed"] is False and "patch" not in response
    assert response["status"]["code"] == 403
    assert response["status"]["message"] == (
        f"claim {NS}/train lost devices to another claim: {TAKEN}; delete and re-create the claim"
    )


def test_pending_claim_that_lost_devices_to_another_claim_is_denied_not_gated() -> None:
    claim = make_claim(phase="Pending", conditions=devices_lost(constants.REASON_DEVICES_TAKEN))
    response = answer(make_pod(), claim, options=admission.Options(pending="gate"))
    assert response["allowed"] is False
    assert "lost devices to another claim: gpu-5/" in response["status"]["message"]


def test_devices_taken_message_is_folded_to_one_line_and_capped() -> None:
    message = "gpu-1/GPU-x is held by\nclaim ml/other " + "x" * 5000
    claim = make_claim(conditions=devices_lost(constants.REASON_DEVICES_TAKEN, message=message))
    denial = answer(make_pod(), claim)["status"]["message"]
    assert "held by claim ml/other" in denial and "\n" not in denial
    assert len(denial) < 700 and denial.endswith("…; delete and re-create the claim")


def test_claim_being_deleted_is_denied_as_deleted_even_when_its_devices_were_taken() -> None:
    claim = make_claim(deleting=True, conditions=devices_lost(constants.REASON_DEVICES_TAKEN))
    response = answer(make_pod(), claim)
    assert response["allowed"] is False and "being deleted" in response["status"]["message"]


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("DeviceUnhealthy", "True"),
        ("DevicesMissing", "True"),
        ("DevicesHealthy", "False"),
        (constants.REASON_DEVICES_TAKEN, "False"),
    ],
)
def test_other_devices_lost_conditions_still_admit_the_pod_with_its_devices(reason: str, status: str) -> None:
    claim = make_claim(conditions=devices_lost(reason, message="gpu-5/GPU-x: XID 79", status=status))
    out = patched(make_pod(), answer(make_pod(), claim))
    assert out["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == uuids()
    assert out["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "gpu-node-1"}


# ------------------------------------------------------------ gangs


@pytest.mark.parametrize(
    ("annotations", "labels"),
    [
        ({constants.ANNOTATION_REPLICA: "2"}, {}),
        ({}, {constants.LABEL_STATEFULSET_POD_INDEX: "2"}),
        ({constants.ANNOTATION_JOB_COMPLETION_INDEX: "2"}, {}),
        ({}, {constants.LABEL_JOB_COMPLETION_INDEX: "2"}),
    ],
    ids=["replica-annotation", "statefulset-pod-index", "job-index-annotation", "job-index-label"],
)
def test_gang_replica_comes_from_each_source(annotations: dict[str, str], labels: dict[str, str]) -> None:
    claim = make_claim(replicas=3, nodes=("n0", "n1", "n2"))
    pod = make_pod(annotations=annotations, labels=labels)
    out = patched(pod, answer(pod, claim))
    assert out["spec"]["nodeSelector"][constants.HOSTNAME_LABEL] == "n2"
    assert env_of(out["spec"]["containers"][0])["CUDA_VISIBLE_DEVICES"] == uuids(2)


def test_replica_annotation_beats_statefulset_and_job_indices() -> None:
    claim = make_claim(replicas=3, nodes=("n0", "n1", "n2"))
    pod = make_pod(
        annotations={constants.ANNOTATION_REPLICA: "1", constants.ANNOTATION_JOB_COMPLETION_INDEX: "0"},
        labels={constants.LABEL_STATEFULSET_POD_INDEX: "2"},
    )
    assert patched(pod, answer(pod, claim))["spec"]["nodeSelector"][constants.HOSTNAME_LABEL] == "n1"


def test_statefulset_index_beats_job_index() -> None:
    claim = make_claim(replicas=3, nodes=("n0", "n1", "n2"))
    pod = make_pod(
        annotations={constants.ANNOTATION_JOB_COMPLETION_INDEX: "0"},
        labels={constants.LABEL_STATEFULSET_POD_INDEX: "2"},
    )
    assert patched(pod, answer(pod, claim))["spec"]["nodeSelector"][constants.HOSTNAME_LABEL] == "n2"


def test_multi_replica_claim_without_a_replica_index_is_denied_naming_the_sources() -> None:
    response = answer(make_pod(), make_claim(replicas=2))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "2 replicas" in message and constants.ANNOTATION_REPLICA in message
    assert constants.LABEL_STATEFULSET_POD_INDEX in message


def test_out_of_range_replica_is_denied() -> None:
    pod = make_pod(annotations={constants.ANNOTATION_REPLICA: "2"})
    response = answer(pod, make_claim(replicas=2))
    assert response["allowed"] is False
    assert "replica 2" in response["status"]["message"] and "out of range" in response["status"]["message"]


@pytest.mark.parametrize("value", ["-1", "one", "", "1.5"])
def test_malformed_replica_value_is_denied(value: str) -> None:
    pod = make_pod(annotations={constants.ANNOTATION_REPLICA: value})
    response = answer(pod, make_claim(replicas=2))
    assert response["allowed"] is False and "non-negative integer" in response["status"]["message"]


def test_single_replica_claim_needs_no_replica_index() -> None:
    response = answer(make_pod(), make_claim(replicas=1))
    assert response["allowed"] is True and "patch" in response


# ------------------------------------------------------------ reinvocation and dry run


@pytest.mark.parametrize("mode", ["uuid", "index"])
def test_reinvocation_on_the_patched_pod_gives_no_patch(mode: str) -> None:
    options = admission.Options(device_ids=mode)
    pod = make_pod(
        containers=[{"name": "a", "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]}, {"name": "b"}],
        init=[{"name": "i"}],
    )
    once = patched(pod, answer(pod, make_claim(), options=options))
    again = answer(once, make_claim(), options=options)
    assert again == {"uid": "uid-1", "allowed": True}


def test_reinvocation_in_gate_mode_gives_no_patch() -> None:
    options = admission.Options(pending="gate")
    pod = make_pod(init=[{"name": "i"}])
    once = patched(pod, answer(pod, make_claim(phase="Pending"), options=options))
    assert answer(once, make_claim(phase="Pending"), options=options) == {"uid": "uid-1", "allowed": True}


def test_dry_run_request_gets_the_same_answer() -> None:
    pod = make_pod()
    wet = admitting.admit(make_review(pod), lookup(make_claim()))
    dry = admitting.admit(make_review(pod, dry_run=True), lookup(make_claim()))
    assert wet == dry


def test_admit_does_not_modify_the_review() -> None:
    review = make_review(make_pod(init=[{"name": "i"}]))
    before = copy.deepcopy(review)
    admitting.admit(review, lookup(make_claim()))
    admitting.admit(review, lookup(make_claim(phase="Pending")), admission.Options(pending="gate"))
    assert review == before


# ------------------------------------------------------------ not allocated


@pytest.mark.parametrize("phase", ["Pending", "Failed"])
def test_unallocated_claim_is_denied_quoting_its_status_message(phase: str) -> None:
    claim = make_claim(phase=phase, message="0/3 nodes fit: 3 have too few free GPUs")
    response = answer(make_pod(), claim)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert f"GpuClaim {NS}/train is {phase}" in message
    assert '"0/3 nodes fit: 3 have too few free GPUs"' in message


def test_missing_claim_is_denied_naming_it() -> None:
    response = answer(make_pod(claim="nope"))
    assert response["allowed"] is False
    assert f"GpuClaim {NS}/nope does not exist" in response["status"]["message"]


def test_gate_mode_admits_with_gate_and_env_from_the_devices_annotation() -> None:
    pod = make_pod(
        containers=[{"name": "main", "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]}],
        init=[{"name": "prep"}],
        annotations={constants.ANNOTATION_DEVICES: "GPU-forged"},
    )
    response = answer(pod, make_claim(phase="Pending"), options=admission.Options(pending="gate"))
    out = patched(pod, response)
    assert out["spec"]["schedulingGates"] == [{"name": constants.SCHEDULING_GATE}]
    assert "nodeSelector" not in out["spec"]
    assert constants.ANNOTATION_DEVICES not in out["metadata"]["annotations"], "a user-set record is dropped"
    field = {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.annotations['gpu.scheduling/devices']"}}
    for container in all_containers(out):
        env = env_of(container)
        assert env["CUDA_VISIBLE_DEVICES"] == field
        assert env["NVIDIA_VISIBLE_DEVICES"] == field


def test_gate_mode_admits_a_pod_whose_claim_does_not_exist_yet() -> None:
    response = answer(make_pod(claim="later"), options=admission.Options(pending="gate"))
    assert response["allowed"] is True
    assert any(op["path"] == "/spec/schedulingGates" for op in patch_ops(response))


def test_gate_mode_denies_a_pod_with_node_name() -> None:
    pod = make_pod(spec={"nodeName": "n1"})
    response = answer(pod, make_claim(phase="Pending"), options=admission.Options(pending="gate"))
    assert response["allowed"] is False and "spec.nodeName" in response["status"]["message"]


def test_gate_mode_still_checks_the_replica_of_an_existing_gang_claim() -> None:
    response = answer(
        make_pod(), make_claim(phase="Pending", replicas=2), options=admission.Options(pending="gate")
    )
    assert response["allowed"] is False and "2 replicas" in response["status"]["message"]


def test_gated_pod_reinvoked_after_allocation_gets_its_devices_without_a_replaced_warning() -> None:
    options = admission.Options(pending="gate")
    pod = make_pod(init=[{"name": "i"}])
    gated = patched(pod, answer(pod, make_claim(phase="Pending"), options=options))
    response = answer(gated, make_claim(), options=options)  # reinvoked: the claim is Allocated now
    assert "warnings" not in response, "the env entries replaced are the webhook's own, not the user's"
    out = patched(gated, response)
    assert out["spec"]["schedulingGates"] == [{"name": constants.SCHEDULING_GATE}], "once, still there"
    assert out["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "gpu-node-1"}
    assert out["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == uuids()
    for container in all_containers(out):
        assert env_of(container)["CUDA_VISIBLE_DEVICES"] == uuids()


def test_pod_of_an_allocated_claim_gets_its_devices_and_waits_at_our_gate_for_the_controller() -> None:
    pod = make_pod(spec={"schedulingGates": [{"name": "other"}]})
    out = patched(pod, answer(pod, make_claim()))
    assert out["spec"]["schedulingGates"] == [{"name": "other"}, {"name": constants.SCHEDULING_GATE}]
    assert out["metadata"]["labels"][constants.LABEL_GATED] == "true"
    assert out["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == uuids()
    assert out["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "gpu-node-1"}


# ------------------------------------------------------------ device plugin


@pytest.mark.parametrize("where", ["limits", "requests"])
@pytest.mark.parametrize("list_name", ["containers", "initContainers"])
def test_pod_requesting_nvidia_gpu_is_denied_explaining_the_conflict(where: str, list_name: str) -> None:
    gpu_user = {"name": "greedy", "resources": {where: {"nvidia.com/gpu": "1"}}}
    pod = make_pod(containers=[{"name": "main"}])
    pod["spec"].setdefault(list_name, []).append(gpu_user)
    response = answer(pod, make_claim())
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "nvidia.com/gpu" in message and "device plugin" in message and "greedy" in message
    assert "--allow-device-plugin" in message


def test_pod_level_nvidia_gpu_request_is_denied_explaining_the_conflict() -> None:
    pod = make_pod(spec={"resources": {"limits": {"nvidia.com/gpu": 2}}})
    response = answer(pod, make_claim())
    assert response["allowed"] is False
    assert "device plugin" in response["status"]["message"] and "<pod>" in response["status"]["message"]


def test_allow_device_plugin_admits_a_pod_requesting_nvidia_gpu() -> None:
    pod = make_pod(containers=[{"name": "main", "resources": {"limits": {"nvidia.com/gpu": 1}}}])
    response = answer(pod, make_claim(), options=admission.Options(allow_device_plugin=True))
    assert response["allowed"] is True and "patch" in response


def test_zero_nvidia_gpu_request_is_not_a_conflict() -> None:
    pod = make_pod(containers=[{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "0"}}}])
    assert answer(pod, make_claim())["allowed"] is True


# ------------------------------------------------------------ names and namespaces


@pytest.mark.parametrize("value", ["other-ns/train", "/train", "train/"])
def test_claim_reference_with_a_namespace_is_denied(value: str) -> None:
    response = answer(make_pod(claim=value), make_claim())
    assert response["allowed"] is False
    assert "claims are looked up in the pod's own namespace" in response["status"]["message"]


def test_claim_is_looked_up_in_the_pods_namespace_only() -> None:
    elsewhere = make_claim(namespace="team-b")
    response = answer(make_pod(), elsewhere)
    assert response["allowed"] is False and f"{NS}/train does not exist" in response["status"]["message"]


@pytest.mark.parametrize("value", ["", "Upper", "under_score", "x" * 254])
def test_invalid_claim_names_are_denied(value: str) -> None:
    assert answer(make_pod(claim=value), make_claim())["allowed"] is False


def test_request_namespace_is_used_when_the_pod_has_none() -> None:
    pod = make_pod()
    del pod["metadata"]["namespace"]
    assert answer(pod, make_claim())["allowed"] is True


# ------------------------------------------------------------ errors


def test_unavailable_claim_lookup_is_denied_with_503() -> None:
    def failing(namespace: str, name: str, /) -> models.GpuClaim | None:
        raise admission.ClaimUnavailable("connection refused")

    out = admitting.admit(make_review(make_pod()), failing)["response"]
    assert out["allowed"] is False and out["status"]["code"] == 503
    assert "connection refused" in out["status"]["message"]


def test_unreadable_claim_is_denied() -> None:
    def broken(namespace: str, name: str, /) -> models.GpuClaim | None:
        raise codecs.DecodeError("spec.devices: required")

    out = admitting.admit(make_review(make_pod()), broken)["response"]
    assert out["allowed"] is False and "spec.devices" in out["status"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        "x",
        {},
        {"request": None},
        {"request": {}},
        {"request": {"uid": ""}},
        {"request": {"uid": 5}},
    ],
)
def test_review_without_a_uid_raises_bad_review(body: Any) -> None:
    with pytest.raises(admission.BadReview):
        admitting.admit(body, lookup())


def test_wrong_api_version_with_a_uid_is_answered_with_a_denial() -> None:
    review = make_review(make_pod())
    review["apiVersion"] = "admission.k8s.io/v1beta1"
    out = admitting.admit(review, lookup(make_claim()))
    assert out["response"]["uid"] == "uid-1" and out["response"]["allowed"] is False
    assert out["response"]["status"]["code"] == 400
    assert "admission.k8s.io/v1" in out["response"]["status"]["message"]


@pytest.mark.parametrize(
    "obj",
    [
        None,
        [],
        "pod",
        {"kind": "Service"},
        {"metadata": "x"},
        {"metadata": {"annotations": {"a": 1}}},
        {"spec": {"containers": {}}},
        {"spec": {"containers": ["x"]}},
        {"spec": {"containers": [{"env": {}}]}},
    ],
)
def test_object_that_is_not_a_pod_is_denied_as_invalid(obj: Any) -> None:
    out = admitting.decide(make_review(obj), lookup())
    assert out.outcome == admission.INVALID
    assert admitting.answer_of(out)["response"]["allowed"] is False
    assert "not a Pod" in admitting.answer_of(out)["response"]["status"]["message"]


def test_decode_names_the_claim_the_server_looks_up() -> None:
    assert admitting.claim_ref(make_review(make_pod())) == (NS, "train")
    assert admitting.claim_ref(make_review(make_pod(claim=None))) is None
    assert admitting.claim_ref(make_review(make_pod(claim="a/b"))) is None
    assert admitting.claim_ref({"nonsense": 1}) is None


def test_outcomes_are_reported() -> None:
    assert admitting.decide(make_review(make_pod(claim=None)), lookup()).outcome == admission.ALLOWED
    assert admitting.decide(make_review(make_pod()), lookup(make_claim())).outcome == admission.MUTATED
    assert admitting.decide(make_review(make_pod()), lookup()).outcome == admission.DENIED
    gate = admission.Options(pending="gate")
    assert admitting.decide(make_review(make_pod()), lookup(), gate).outcome == admission.GATED


def test_mutations_display_name_falls_back_without_name() -> None:
    generated = objects.Pod(metadata=objects.ObjectMeta(generate_name="g-"))
    assert mutations.display_name(generated) == "g-<generated>"
    assert mutations.display_name(objects.Pod()) == "<unnamed pod>"


def mps_claim(phase: str = constants.PHASE_ALLOCATED, **sharing: Any) -> models.GpuClaim:
    claim = make_claim(phase=phase)
    devices = dataclasses.replace(
        claim.spec.devices, exclusivity="Shared", sharing=models.SharingRequest(**sharing)
    )
    return dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, devices=devices))


@pytest.mark.parametrize("phase", [constants.PHASE_ALLOCATED, constants.PHASE_PENDING])
def test_an_mps_claims_pods_get_its_compute_and_memory_limits_in_every_container(phase: str) -> None:
    pod = make_pod(
        containers=[
            {"name": "main", "image": "cuda"},
            {
                "name": "side",
                "image": "cuda",
                "env": [{"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"}],
            },
        ],
        init=[{"name": "prep", "image": "cuda"}],
    )
    claim = mps_claim(phase, strategy="MPS", compute_percent=25, memory_mib=10240)
    out = patched(pod, answer(pod, claim, options=admission.Options(pending="gate")))
    for container in all_containers(out):
        env = env_of(container)
        # A value the pod set itself is replaced: the limit is the claim's.
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", container["name"]
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M,1=10240M", container["name"]


def test_time_sliced_and_limitless_mps_claims_get_no_mps_env() -> None:
    pod = make_pod()
    for claim in (mps_claim(strategy="TimeSlicing"), mps_claim(strategy="MPS"), make_claim()):
        for container in all_containers(patched(pod, answer(pod, claim))):
            assert not [name for name in env_of(container) if name.startswith("CUDA_MPS_")]
