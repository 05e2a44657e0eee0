"""The CRDs in helm/gpualloc/crds/, as the real kube-apiserver enforces them.

Every test here talks to the local control plane (etcd + kube-apiserver built from
the pinned Kubernetes modules), through kubernetes_asyncio directly.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpualloc.api import codecs, constants
from tests.conftest import generated_client

GROUP, VERSION = constants.GROUP, constants.VERSION
MERGE_PATCH = "application/merge-patch+json"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"

UUID_A = "GPU-5f1c0c2e-8f3a-4b7e-9d21-0a1b2c3d4e5f"
UUID_B = "GPU-6a2d1d3f-9a4b-4c8f-8e32-1b2c3d4e5f60"


def claim_body(name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name},
        "spec": spec if spec is not None else {"devices": {"count": 1}},
    }


def node_status_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.NODE_STATUS_KIND,
        "metadata": {"name": name},
        "spec": {"nodeName": name},
    }


def valid_inventory() -> dict[str, Any]:
    device = {
        "index": 0,
        "minor": 0,
        "uuid": UUID_A,
        "product": "NVIDIA H100 80GB HBM3",
        "memoryMiB": 81559,
        "computeCapability": "9.0",
        "pciBusId": "0000:18:00.0",
        "numaNode": 0,
        "health": "Healthy",
        "healthReason": "",
    }
    return {
        "source": "simulated",
        "driverVersion": "580.159.04",
        "cudaVersion": "13.0",
        "product": "NVIDIA H100 80GB HBM3",
        "devices": [device, {**device, "index": 1, "minor": 1, "uuid": UUID_B, "pciBusId": "0000:2a:00.0"}],
        "links": [{"a": 0, "b": 1, "type": "NV18", "nvlinks": 18, "bandwidthGBps": 900}],
        "islands": [[0, 1]],
        "total": 2,
        "healthy": 2,
        "allocated": 0,
        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Published",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def rejected(call: Awaitable[Any]) -> tuple[int, str]:
    """Await a call that must fail; return (HTTP status, the Status message)."""
    with pytest.raises(ApiException) as info:
        await call
    body = info.value.body
    try:
        message = json.loads(body)["message"]
    except (TypeError, ValueError, KeyError):
        message = str(body)
    return info.value.status, message


@pytest.fixture
async def api(kubeconfig: str) -> AsyncIterator[client.ApiClient]:
    """kubernetes_asyncio's own generated client, not gpualloc's: the CRDs are checked as any
    other client of the API server would meet them."""
    async with await generated_client(kubeconfig) as api_client:
        yield api_client


@pytest.fixture
def objects(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


NewNodeStatus = Callable[[str], Awaitable[str]]


@pytest.fixture
async def new_node_status(objects: client.CustomObjectsApi) -> AsyncIterator[NewNodeStatus]:
    """``await new_node_status("prefix")``: a cluster-scoped GpuNodeStatus of a unique name (its
    spec only), created; its name. Each is deleted after the test."""
    names: list[str] = []

    async def create(prefix: str) -> str:
        name = unique(prefix)
        names.append(name)
        await objects.create_cluster_custom_object(
            GROUP, VERSION, constants.NODE_STATUS_PLURAL, node_status_body(name)
        )
        return name

    yield create
    for name in names:
        try:
            await objects.delete_cluster_custom_object(GROUP, VERSION, constants.NODE_STATUS_PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise


def patch_node_status(objects: client.CustomObjectsApi, name: str, status: dict[str, Any]) -> Awaitable[Any]:
    """A merge patch of the GpuNodeStatus's status subresource."""
    return objects.patch_cluster_custom_object_status(
        GROUP, VERSION, constants.NODE_STATUS_PLURAL, name, {"status": status}, _content_type=MERGE_PATCH
    )


async def create_claim(objects: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> Any:
    return await objects.create_namespaced_custom_object(
        GROUP, VERSION, namespace, constants.CLAIM_PLURAL, body
    )


async def patch_claim(
    objects: client.CustomObjectsApi, namespace: str, name: str, patch: dict[str, Any]
) -> Any:
    return await objects.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, constants.CLAIM_PLURAL, name, patch, _content_type=MERGE_PATCH
    )


async def patch_claim_status(
    objects: client.CustomObjectsApi, namespace: str, name: str, patch: dict[str, Any]
) -> Any:
    return await objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, constants.CLAIM_PLURAL, name, patch, _content_type=MERGE_PATCH
    )


ALLOCATED_STATUS = {
    "status": {
        "phase": "Allocated",
        "allocations": [
            {
                "replica": 0,
                "nodeName": "gpu-node-3",
                "devices": [{"index": 4, "minor": 4, "uuid": UUID_A}],
                "minBandwidthGBps": 0,
            }
        ],
        "nodes": "gpu-node-3",
        "devices": "4",
        "message": "allocated",
        "observedGeneration": 1,
    }
}


# ------------------------------------------------------------------ version


async def test_api_server_reports_the_pinned_kubernetes_version(api: client.ApiClient) -> None:
    info = await client.VersionApi(api).get_code()
    assert info.git_version == "v1.36.3"


# ------------------------------------------------------------- valid claims


async def test_minimal_claim_is_accepted_with_every_default_applied(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    created = await create_claim(objects, namespace, claim_body("minimal", {"devices": {"count": 2}}))

    spec = created["spec"]
    assert spec["devices"] == {"count": 2, "exclusivity": "Exclusive", "policy": "packed"}
    assert spec["topology"] == {"mode": "Preferred"}
    assert "strategy" not in spec  # the cluster's default (the chart's packing.defaultStrategy)
    assert spec["replicas"] == 1
    assert spec["priority"] == 0
    assert spec["retryPolicy"] == {"maxRetries": 0, "backoffSeconds": 5}
    assert spec["unschedulableGracePeriodSeconds"] == 60
    assert (spec["onDeviceFailure"], spec["deviceFailureGracePeriodSeconds"]) == ("Keep", 30)
    assert "podResources" not in spec
    parsed = codecs.parse_claim(created)
    assert parsed.spec.devices.count == 2
    assert parsed.spec.strategy == "binpack"  # where none is set
    assert parsed.spec.topology.mode == "Preferred"


async def test_claim_using_every_spec_field_is_accepted_and_decodes(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    spec = {
        "devices": {
            "count": 2,
            "exclusivity": "Exclusive",
            "policy": "preferIds",
            "preferIds": [0, 1],
            "product": "NVIDIA H100*",
            "minMemoryMiB": 40000,
            "minComputeCapability": "8.0",
        },
        "selector": {
            "matchLabels": {"pool": "training"},
            "matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a", "b"]},
                {"key": "gpu.count", "operator": "Gt", "values": ["3"]},
                {"key": "cordoned", "operator": "DoesNotExist"},
            ],
        },
        "nodeName": "gpu-node-3",
        "topology": {
            "mode": "Required",
            "minBandwidthGBps": 600,
            "sameNodeLabel": "nvidia.com/gpu.clique",
            "sameNodeLabelMode": "Preferred",
        },
        "strategy": "costOptimized",
        "priority": 10,
        "replicas": 2,
        "retryPolicy": {"maxRetries": 3, "backoffSeconds": 10},
        "release": "OnPodsCompleted",
        "onNodeLoss": "Reallocate",
        "nodeLossGracePeriodSeconds": 60,
        "preemptionPolicy": "Never",
        "gangRef": "podgroup-a",
        "podResources": {
            "cpu": "1500m",
            "memory": "16Gi",
            "ephemeral-storage": "1e10",
            "pods": 2,
            "hugepages-2Mi": "1Gi",
        },
        "unschedulableGracePeriodSeconds": 120,
        "onDeviceFailure": "Reallocate",
        "deviceFailureGracePeriodSeconds": 45,
        "tolerations": [
            {
                "key": "team",
                "operator": "Equal",
                "value": "ml",
                "effect": "NoExecute",
                "tolerationSeconds": 30,
            },
            {"operator": "Exists"},
        ],
    }
    created = await create_claim(objects, namespace, claim_body("everything", spec))

    assert created["spec"] == spec
    parsed = codecs.parse_claim(created)
    assert parsed.spec.devices.prefer_ids == (0, 1)
    assert parsed.spec.devices.min_memory_mib == 40000
    assert parsed.spec.topology.min_bandwidth_gbps == 600
    assert (parsed.spec.on_device_failure, parsed.spec.device_failure_grace_period_seconds) == (
        "Reallocate",
        45,
    )
    assert parsed.spec.retry_policy.max_retries == 3
    assert parsed.spec.release == "OnPodsCompleted"
    assert parsed.spec.topology.same_node_label_mode == "Preferred"
    assert (parsed.spec.on_node_loss, parsed.spec.node_loss_grace_period_seconds) == ("Reallocate", 60)
    assert (parsed.spec.preemption_policy, parsed.spec.gang_ref) == ("Never", "podgroup-a")
    assert (
        parsed.spec.tolerations[0].toleration_seconds == 30
        and parsed.spec.tolerations[1].operator == "Exists"
    )
    assert parsed.spec.pod_resources == {
        "cpu": 1500,
        "memory": 16 * 2**30,
        "ephemeral-storage": 10**10,
        "pods": 2,
        "hugepages-2Mi": 2**30,
    }
    assert parsed.spec.unschedulable_grace_period_seconds == 120


# ----------------------------------------------------------- invalid claims

INVALID_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("count-0", {"devices": {"count": 0}}, "spec.devices.count"),
    ("count-65", {"devices": {"count": 65}}, "spec.devices.count"),
    ("count-missing", {"devices": {"policy": "packed"}}, "spec.devices.count"),
    ("unknown-policy", {"devices": {"count": 1, "policy": "tightest"}}, "spec.devices.policy"),
    (
        "unknown-topology-mode",
        {"devices": {"count": 1}, "topology": {"mode": "Sometimes"}},
        "spec.topology.mode",
    ),
    (
        "bad-selector-operator",
        {"devices": {"count": 1}, "selector": {"matchExpressions": [{"key": "zone", "operator": "Like"}]}},
        "spec.selector.matchExpressions[0].operator",
    ),
    (
        "in-without-values",
        {"devices": {"count": 1}, "selector": {"matchExpressions": [{"key": "zone", "operator": "In"}]}},
        "spec.selector.matchExpressions[0]",
    ),
    (
        "gt-with-non-integer",
        {
            "devices": {"count": 1},
            "selector": {"matchExpressions": [{"key": "n", "operator": "Gt", "values": ["many"]}]},
        },
        "spec.selector.matchExpressions[0]",
    ),
    ("negative-priority", {"devices": {"count": 1}, "priority": -1}, "spec.priority"),
    (
        "malformed-min-compute-capability",
        {"devices": {"count": 1, "minComputeCapability": "8"}},
        "spec.devices.minComputeCapability",
    ),
    (
        "prefer-ids-without-policy",
        {"devices": {"count": 2, "preferIds": [0, 1]}},
        "spec.devices.preferIds",
    ),
    (
        "policy-prefer-ids-without-ids",
        {"devices": {"count": 2, "policy": "preferIds"}},
        "spec.devices.preferIds",
    ),
    (
        "sharing-without-shared",
        {"devices": {"count": 1, "sharing": {"strategy": "MPS"}}},
        "spec.devices.sharing",
    ),
    (
        "unknown-sharing-strategy",
        {"devices": {"count": 1, "exclusivity": "Shared", "sharing": {"strategy": "Fair"}}},
        "spec.devices.sharing.strategy",
    ),
    (
        "milli-share-of-two-gpus",
        {"devices": {"count": 2, "exclusivity": "Shared", "sharing": {"milli": 500}}},
        "spec.devices.count",
    ),
    (
        "milli-a-whole-gpu",
        {"devices": {"count": 1, "exclusivity": "Shared", "sharing": {"milli": 1000}}},
        "spec.devices.sharing.milli",
    ),
    (
        "milli-with-max-claims-per-gpu",
        {"devices": {"count": 1, "exclusivity": "Shared", "sharing": {"milli": 500, "maxClaimsPerGPU": 2}}},
        "spec.devices.sharing",
    ),
    (
        "milli-with-hand-set-mps-limits",
        {
            "devices": {
                "count": 1,
                "exclusivity": "Shared",
                "sharing": {"strategy": "MPS", "milli": 500, "computePercent": 50},
            }
        },
        "spec.devices.sharing",
    ),
    ("zero-replicas", {"devices": {"count": 1}, "replicas": 0}, "spec.replicas"),
    ("unknown-strategy", {"devices": {"count": 1}, "strategy": "cheapest"}, "spec.strategy"),
    ("bad-node-name", {"devices": {"count": 1}, "nodeName": "Not_A_Node"}, "spec.nodeName"),
    ("unknown-release", {"devices": {"count": 1}, "release": "OnFriday"}, "spec.release"),
    (
        "toleration-exists-with-value",
        {"devices": {"count": 1}, "tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]},
        "value must be empty when operator is Exists",
    ),
    (
        "toleration-without-key-or-exists",
        {"devices": {"count": 1}, "tolerations": [{"value": "b"}]},
        "an empty key needs operator Exists",
    ),
    (
        "pod-resources-unknown-key",
        {"devices": {"count": 1}, "podResources": {"cpu": "1", "nvidia.com/gpu": "1"}},
        "podResources takes only cpu, memory, ephemeral-storage, pods and hugepages-<size>",
    ),
    (
        "pod-resources-bad-hugepages-key",
        {"devices": {"count": 1}, "podResources": {"hugepages-": "1Gi"}},
        "podResources takes only cpu, memory, ephemeral-storage, pods and hugepages-<size>",
    ),
    (
        "pod-resources-malformed-quantity",
        {"devices": {"count": 1}, "podResources": {"cpu": "two cores"}},
        'spec.podResources[cpu]: Invalid value: "two cores": must be a non-negative Kubernetes quantity',
    ),
    (
        "pod-resources-fractional-exponent",
        {"devices": {"count": 1}, "podResources": {"memory": "1e1.5"}},
        'spec.podResources[memory]: Invalid value: "1e1.5": must be a non-negative Kubernetes quantity',
    ),
    (
        "pod-resources-negative",
        {"devices": {"count": 1}, "podResources": {"memory": -5}},
        "spec.podResources[memory]: Invalid value: -5: must be a non-negative Kubernetes quantity",
    ),
    (
        "pod-resources-fraction-number",
        {"devices": {"count": 1}, "podResources": {"cpu": 1.5}},
        "spec.podResources.cpu",
    ),
    (
        "unschedulable-grace-period-too-long",
        {"devices": {"count": 1}, "unschedulableGracePeriodSeconds": 86401},
        "spec.unschedulableGracePeriodSeconds",
    ),
    (
        "unknown-device-failure-policy",
        {"devices": {"count": 1}, "onDeviceFailure": "Retry"},
        'spec.onDeviceFailure: Unsupported value: "Retry": supported values: "Keep", "Reallocate"',
    ),
    (
        "device-failure-grace-period-negative",
        {"devices": {"count": 1}, "deviceFailureGracePeriodSeconds": -1},
        "spec.deviceFailureGracePeriodSeconds",
    ),
    (
        "unknown-same-node-label-mode",
        {"devices": {"count": 1}, "topology": {"sameNodeLabel": "rack", "sameNodeLabelMode": "Mostly"}},
        "spec.topology.sameNodeLabelMode",
    ),
]


@pytest.mark.parametrize(
    ("spec", "field"), [(s, f) for _, s, f in INVALID_SPECS], ids=[i for i, _, _ in INVALID_SPECS]
)
async def test_invalid_claim_is_rejected_with_422_naming_the_field(
    objects: client.CustomObjectsApi, namespace: str, spec: dict[str, Any], field: str
) -> None:
    status, message = await rejected(create_claim(objects, namespace, claim_body(unique("bad"), spec)))

    assert status == 422, message
    assert field in message


async def test_unknown_field_under_devices_is_rejected_by_strict_field_validation(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    body = claim_body("colourful", {"devices": {"count": 1, "colour": "green"}})

    status, message = await rejected(
        objects.create_namespaced_custom_object(
            GROUP, VERSION, namespace, constants.CLAIM_PLURAL, body, field_validation="Strict"
        )
    )

    assert status == 400, message  # what kubectl (strict by default) gets: a BadRequest naming the field
    assert 'unknown field "spec.devices.colour"' in message


async def test_unknown_field_under_devices_is_pruned_without_strict_validation(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    body = claim_body("pruned", {"devices": {"count": 1, "colour": "green"}})

    created = await create_claim(objects, namespace, body)

    assert "colour" not in created["spec"]["devices"]


# ------------------------------------------------------------- CEL: frozen spec


async def test_pending_claim_spec_can_be_changed(objects: client.CustomObjectsApi, namespace: str) -> None:
    await create_claim(objects, namespace, claim_body("pending"))
    await patch_claim_status(objects, namespace, "pending", {"status": {"phase": "Pending"}})

    patched = await patch_claim(objects, namespace, "pending", {"spec": {"devices": {"count": 4}}})

    assert patched["spec"]["devices"]["count"] == 4


async def test_allocated_claim_spec_is_rejected_with_422_naming_spec(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    await create_claim(objects, namespace, claim_body("allocated"))
    allocated = await patch_claim_status(objects, namespace, "allocated", ALLOCATED_STATUS)
    assert allocated["status"]["phase"] == "Allocated"

    status, message = await rejected(
        patch_claim(objects, namespace, "allocated", {"spec": {"devices": {"count": 4}}})
    )

    assert status == 422, message
    assert "spec" in message
    assert "immutable" in message
    current = await objects.get_namespaced_custom_object(
        GROUP, VERSION, namespace, constants.CLAIM_PLURAL, "allocated"
    )
    assert current["spec"]["devices"]["count"] == 1


async def test_allocated_claim_metadata_and_status_can_still_change(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    await create_claim(objects, namespace, claim_body("held"))
    await patch_claim_status(objects, namespace, "held", ALLOCATED_STATUS)

    labelled = await patch_claim(
        objects,
        namespace,
        "held",
        {"metadata": {"labels": {"team": "a"}, "finalizers": [constants.FINALIZER]}},
    )
    released = await patch_claim(objects, namespace, "held", {"metadata": {"finalizers": None}})
    failed = await patch_claim_status(objects, namespace, "held", {"status": {"phase": "Failed"}})

    assert labelled["metadata"]["labels"] == {"team": "a"}
    assert labelled["metadata"]["finalizers"] == [constants.FINALIZER]
    assert "finalizers" not in released["metadata"]
    assert failed["status"]["phase"] == "Failed"


# ---------------------------------------------------------- status subresource


async def test_claim_status_is_written_only_through_the_status_subresource(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    body = claim_body("sub")
    body["status"] = {"phase": "Allocated", "message": "set at create"}
    created = await create_claim(objects, namespace, body)
    assert "status" not in created or created["status"].get("phase") is None

    via_main = await patch_claim(objects, namespace, "sub", {"status": {"phase": "Failed", "message": "x"}})
    assert "status" not in via_main or via_main["status"].get("phase") is None

    via_status = await patch_claim_status(
        objects,
        namespace,
        "sub",
        {"spec": {"devices": {"count": 9}}, "status": {"phase": "Pending", "message": "waiting"}},
    )
    assert via_status["status"] == {"phase": "Pending", "message": "waiting"}
    assert via_status["spec"]["devices"]["count"] == 1  # spec is ignored on /status
    assert via_status["metadata"]["generation"] == created["metadata"]["generation"]


async def test_claim_status_schema_is_enforced_on_the_status_subresource(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    await create_claim(objects, namespace, claim_body("badstatus"))
    bad = copy.deepcopy(ALLOCATED_STATUS)
    bad["status"]["allocations"][0]["devices"][0]["uuid"] = "5f1c"

    status, message = await rejected(patch_claim_status(objects, namespace, "badstatus", bad))
    phase_status, phase_message = await rejected(
        patch_claim_status(objects, namespace, "badstatus", {"status": {"phase": "Done"}})
    )

    assert status == 422, message
    assert "status.allocations[0].devices[0].uuid" in message
    assert phase_status == 422, phase_message
    assert "status.phase" in phase_message


# ------------------------------------------------------------------ tables


async def get_table(api: client.ApiClient, path: str) -> Any:
    """GET ``path`` as a server-side Table: the columns ``kubectl get`` prints."""
    return await api.call_api(
        path,
        "GET",
        header_params={"Accept": TABLE},
        response_types_map={200: "object"},
        _return_http_data_only=True,
    )


def _column_names(table: dict[str, Any]) -> list[str]:
    return [c["name"] for c in table["columnDefinitions"] if c.get("priority", 0) == 0]


async def test_claim_table_has_count_replicas_phase_node_devices_age(
    api: client.ApiClient, objects: client.CustomObjectsApi, namespace: str
) -> None:
    await create_claim(objects, namespace, claim_body("shown", {"devices": {"count": 1}, "replicas": 1}))
    await patch_claim_status(objects, namespace, "shown", ALLOCATED_STATUS)

    table = await get_table(api, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{constants.CLAIM_PLURAL}")

    assert table["kind"] == "Table"
    assert _column_names(table) == ["Name", "Count", "Replicas", "Phase", "Node", "Devices", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:6] == ["shown", 1, 1, "Allocated", "gpu-node-3", "4"]


async def test_node_status_table_has_total_healthy_allocated_product_age(
    api: client.ApiClient, objects: client.CustomObjectsApi, new_node_status: NewNodeStatus
) -> None:
    name = await new_node_status("table-node")
    await patch_node_status(objects, name, valid_inventory())

    table = await get_table(api, f"/apis/{GROUP}/{VERSION}/{constants.NODE_STATUS_PLURAL}/{name}")

    assert _column_names(table) == ["Name", "Total", "Healthy", "Allocated", "Product", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:5] == [name, 2, 2, 0, "NVIDIA H100 80GB HBM3"]


# ------------------------------------------------------------ GpuNodeStatus


async def test_schema_valid_node_status_is_accepted_and_decodes(
    objects: client.CustomObjectsApi, new_node_status: NewNodeStatus
) -> None:
    name = await new_node_status("good-node")

    updated = await patch_node_status(objects, name, valid_inventory())

    assert updated["status"] == valid_inventory()
    parsed = codecs.parse_node_status(updated)
    assert parsed.spec.node_name == name
    assert [d.uuid for d in parsed.status.devices] == [UUID_A, UUID_B]
    assert parsed.status.links[0].bandwidth_gbps == 900


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: s["devices"][0].update(uuid="GPU-not-a-uuid"), "status.devices[0].uuid"),
        (lambda s: s["devices"][1].update(pciBusId="0000:2A:00.0"), "status.devices[1].pciBusId"),
        (lambda s: s["devices"][0].update(health="Sick"), "status.devices[0].health"),
        (lambda s: s["links"][0].update(a=1, b=1), "status.links[0]"),
        (lambda s: s["links"][0].update(a=1, b=0), "status.links[0]"),
        (lambda s: s["links"][0].update(type="NVLINK"), "status.links[0].type"),
        (lambda s: s.update(source="guess"), "status.source"),
    ],
    ids=[
        "bad-uuid",
        "upper-case-pci-bus-id",
        "unknown-health",
        "link-a-equals-b",
        "link-a-above-b",
        "unknown-link-type",
        "unknown-source",
    ],
)
async def test_invalid_node_status_is_rejected_with_422_naming_the_field(
    objects: client.CustomObjectsApi,
    new_node_status: NewNodeStatus,
    mutate: Any,
    field: str,
) -> None:
    name = await new_node_status("bad-node")
    inventory = valid_inventory()
    mutate(inventory)

    status, message = await rejected(patch_node_status(objects, name, inventory))

    assert status == 422, message
    assert field in message


async def test_node_status_node_name_is_immutable(
    objects: client.CustomObjectsApi, new_node_status: NewNodeStatus
) -> None:
    name = await new_node_status("pinned-node")

    status, message = await rejected(
        objects.patch_cluster_custom_object(
            GROUP,
            VERSION,
            constants.NODE_STATUS_PLURAL,
            name,
            {"spec": {"nodeName": "elsewhere"}},
            _content_type=MERGE_PATCH,
        )
    )

    assert status == 422, message
    assert "nodeName is immutable" in message
