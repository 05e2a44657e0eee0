"""Quantities and what a pod requests, as kube-scheduler counts them (gpualloc.api.quantities,
gpualloc.api.requests)."""

from __future__ import annotations

from typing import Any

import pytest

from gpualloc.api import quantities, requests

GI, MI = 2**30, 2**20


# ------------------------------------------------------------------ quantities


@pytest.mark.parametrize(
    ("text", "cpu_millis", "whole_units"),
    [
        ("500m", 500, 1),
        ("1", 1000, 1),
        ("1.5", 1500, 2),
        (".5", 500, 1),
        ("5.", 5000, 5),
        ("+2", 2000, 2),
        ("0", 0, 0),
        ("000", 0, 0),
        ("100n", 1, 1),
        ("1u", 1, 1),
        ("0.1m", 1, 1),
        ("1k", 1_000_000, 1000),
        ("1M", 10**9, 10**6),
        ("1G", 10**12, 10**9),
        ("1T", 10**15, 10**12),
        ("1P", 10**18, 10**15),
        ("1E", 10**21, 10**18),
        ("1Ki", 1_024_000, 1024),
        ("16Gi", 16 * GI * 1000, 16 * GI),
        ("1.5Gi", int(1.5 * GI) * 1000, int(1.5 * GI)),
        ("1Ti", 2**40 * 1000, 2**40),
        ("1Ei", 2**60 * 1000, 2**60),
        ("1e3", 10**6, 1000),
        ("1E3", 10**6, 1000),
        ("25e-1", 2500, 3),
        ("1e-100", 1, 1),
    ],
)  # fmt: skip
def test_a_quantity_counts_in_millicores_for_cpu_and_whole_units_otherwise_rounded_up(
    text: str, cpu_millis: int, whole_units: int
) -> None:
    assert quantities.parse_units("cpu", text) == cpu_millis
    assert quantities.parse_units("memory", text) == whole_units


def test_an_integer_is_a_plain_number() -> None:
    assert quantities.parse_units("cpu", 4) == 4000
    assert quantities.parse_units("pods", 110) == 110


def test_a_quantity_beyond_int64_units_is_capped_as_kubernetes_caps_it() -> None:
    assert quantities.parse_units("memory", "1e1000000000") == 2**63 - 1
    assert quantities.parse_units("memory", "99999999999999999999Ei") == 2**63 - 1
    assert quantities.parse_units("memory", 10**30) == 2**63 - 1


@pytest.mark.parametrize(
    "text",
    ["", ".", "+", "-.", "abc", "1e1.5", "1e", "1.5.5", "Ki", "1 Gi", "1ki", "1K", "1Gb", " 1", "0x10",
     "1e99999999999999999999"],
)  # fmt: skip
def test_what_is_not_a_quantity_is_refused(text: str) -> None:
    with pytest.raises(quantities.QuantityError):
        quantities.parse_nanos(text)


@pytest.mark.parametrize("value", [1.5, None, True, [1], {"a": 1}])
def test_a_value_that_is_neither_a_string_nor_an_integer_is_refused(value: Any) -> None:
    with pytest.raises(quantities.QuantityError):
        quantities.parse_nanos(value)


def test_a_very_long_string_is_refused_without_parsing_it() -> None:
    with pytest.raises(quantities.QuantityError, match="characters"):
        quantities.parse_nanos("1" * 100_000)


def test_a_negative_quantity_parses_negative() -> None:
    assert quantities.parse_units("cpu", "-1") == -1000


def test_a_unit_value_is_written_as_a_quantity_that_reads_back_the_same() -> None:
    assert quantities.unit_quantity("cpu", 500) == "500m"
    assert quantities.unit_quantity("memory", 16 * GI) == 16 * GI
    assert quantities.parse_units("cpu", quantities.unit_quantity("cpu", 1500)) == 1500


# --------------------------------------------------------------- pod requests


def _container(
    requests_: dict[str, Any] | None = None, limits: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if requests_ is not None:
        resources["requests"] = requests_
    if limits is not None:
        resources["limits"] = limits
    return {"name": "c", "image": "i", "resources": resources, **extra}


def _pod(
    containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None, **spec: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"containers": containers, **spec}
    if init is not None:
        body["initContainers"] = init
    return {"metadata": {"name": "p"}, "spec": body}


def test_plain_containers_are_summed_and_the_pod_is_one_pod() -> None:
    pod = _pod([_container({"cpu": "500m", "memory": "1Gi"}), _container({"cpu": "1", "memory": "512Mi"})])
    assert requests.pod_requests(pod) == {"cpu": 1500, "memory": GI + 512 * MI, "pods": 1}


def test_a_pod_that_requests_nothing_takes_one_pod_slot() -> None:
    assert requests.pod_requests(_pod([_container()])) == {"pods": 1}
    assert requests.pod_requests({"metadata": {"name": "p"}}) == {"pods": 1}


def test_an_init_container_bigger_than_the_containers_sum_sets_the_request() -> None:
    pod = _pod(
        [_container({"cpu": "1", "memory": "1Gi"})],
        init=[_container({"cpu": "4", "memory": "256Mi"}), _container({"cpu": "2"})],
    )
    # cpu: max(1, 4, 2) = 4; memory: max(1Gi, 256Mi) = 1Gi. Per resource, not per container.
    assert requests.pod_requests(pod) == {"cpu": 4000, "memory": GI, "pods": 1}


def test_a_sidecar_adds_to_the_containers_and_to_every_init_container_after_it() -> None:
    sidecar = _container({"cpu": "100m", "memory": "64Mi"}, restartPolicy="Always")
    pod = _pod(
        [_container({"cpu": "500m", "memory": "1Gi"})],
        init=[_container({"cpu": "1"}), sidecar, _container({"cpu": "950m"})],
    )
    # running: 500m + 100m = 600m; init 0 alone: 1000m; init 2 with the sidecar: 1050m.
    assert requests.pod_requests(pod)["cpu"] == 1050
    assert requests.pod_requests(pod)["memory"] == GI + 64 * MI


def test_a_sidecar_declared_after_an_init_container_does_not_add_to_it() -> None:
    pod = _pod(
        [_container({"cpu": "100m"})],
        init=[_container({"cpu": "1"}), _container({"cpu": "500m"}, restartPolicy="Always")],
    )
    # init 0 runs before the sidecar starts: 1000m; running: 100m + 500m = 600m.
    assert requests.pod_requests(pod)["cpu"] == 1000


def test_several_sidecars_accumulate() -> None:
    sidecars = [_container({"cpu": "300m"}, restartPolicy="Always") for _ in range(3)]
    pod = _pod([_container({"cpu": "100m"})], init=[*sidecars, _container({"cpu": "200m"})])
    # running: 100m + 3 x 300m = 1000m; the last init container: 200m + 900m = 1100m.
    assert requests.pod_requests(pod)["cpu"] == 1100


def test_an_init_container_with_restart_policy_other_than_always_is_no_sidecar() -> None:
    pod = _pod([_container({"cpu": "1"})], init=[_container({"cpu": "500m"}, restartPolicy="OnFailure")])
    assert requests.pod_requests(pod)["cpu"] == 1000


def test_the_overhead_is_added_once() -> None:
    pod = _pod(
        [_container({"cpu": "1", "memory": "1Gi"})],
        init=[_container({"cpu": "2"})],
        overhead={"cpu": "250m", "memory": "120Mi"},
    )
    assert requests.pod_requests(pod) == {"cpu": 2250, "memory": GI + 120 * MI, "pods": 1}


def test_a_limit_stands_for_a_missing_request_and_never_overrides_a_stated_one() -> None:
    pod = _pod([_container({"cpu": "250m"}, limits={"cpu": "2", "memory": "4Gi"})])
    assert requests.pod_requests(pod) == {"cpu": 250, "memory": 4 * GI, "pods": 1}
    init_only_limits = _pod([_container()], init=[_container(limits={"cpu": "3"})])
    assert requests.pod_requests(init_only_limits)["cpu"] == 3000


def test_pod_level_requests_replace_the_containers_for_cpu_memory_and_hugepages_only() -> None:
    pod = _pod(
        [_container({"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"})],
        resources={
            "requests": {"cpu": "3", "memory": "2Gi", "ephemeral-storage": "5Gi", "hugepages-2Mi": "4Mi"}
        },
        overhead={"cpu": "100m"},
    )
    assert requests.pod_requests(pod) == {
        "cpu": 3100,
        "memory": 2 * GI,
        "ephemeral-storage": GI,  # not a pod-level resource: the containers' sum stands
        "hugepages-2Mi": 4 * MI,
        "pods": 1,
    }


def test_sums_are_exact_before_rounding_up_as_the_scheduler_sums_quantities() -> None:
    pod = _pod([_container({"cpu": "0.5m"}), _container({"cpu": "0.5m"}), _container({"cpu": "0.5m"})])
    assert requests.pod_requests(pod)["cpu"] == 2  # 1.5m, rounded up once; not 3 x 1m


def test_every_resource_is_summed_extended_ones_included() -> None:
    pod = _pod(
        [_container({"nvidia.com/gpu": "1", "example.com/foo": "2"}), _container({"example.com/foo": "3"})]
    )
    assert requests.pod_requests(pod) == {"nvidia.com/gpu": 1, "example.com/foo": 5, "pods": 1}


def test_a_malformed_quantity_is_ignored_as_if_not_stated() -> None:
    pod = _pod(
        [_container({"cpu": "lots", "memory": "1Gi"}, limits={"cpu": "2x"}), _container({"cpu": "500m"})],
        init=[_container({"cpu": 1.5})],
    )
    assert requests.pod_requests(pod) == {"cpu": 500, "memory": GI, "pods": 1}


@pytest.mark.parametrize(
    "spec",
    [
        {"containers": "none"},
        {"containers": [None, 7, {"resources": None}, {"resources": {"requests": ["cpu"]}}]},
        {"containers": [], "initContainers": {"a": 1}, "overhead": "big", "resources": 3},
    ],
)
def test_a_pod_of_the_wrong_shape_requests_only_its_slot(spec: Any) -> None:
    assert requests.pod_requests({"spec": spec}) == {"pods": 1}


def test_zero_requests_are_left_out() -> None:
    assert requests.pod_requests(_pod([_container({"cpu": "0", "memory": "0"})])) == {"pods": 1}


# ------------------------------------------------------------ node free space


def test_a_node_has_free_its_allocatable_minus_its_pods_requests() -> None:
    allocatable = {"cpu": 4000, "memory": 16 * GI, "pods": 110}
    requested = {"cpu": 4500, "memory": GI, "pods": 3, "nvidia.com/gpu": 1}
    assert requests.node_free(allocatable, requested) == {"cpu": -500, "memory": 15 * GI, "pods": 107}


def test_a_running_sum_adds_and_takes_off_pods_and_forgets_zeroes() -> None:
    total: dict[str, int] = {}
    a = {"cpu": 500, "pods": 1}
    b = {"cpu": 250, "memory": GI, "pods": 1}
    requests.add(total, a)
    requests.add(total, b)
    assert total == {"cpu": 750, "memory": GI, "pods": 2}
    requests.add(total, b, times=-1)
    assert total == a


def test_shortfall_names_each_resource_asked_beyond_what_is_free_sorted() -> None:
    asked = {"pods": 1, "memory": 2 * GI, "cpu": 1000, "ephemeral-storage": 0}
    free = {"cpu": 0, "memory": 2 * GI, "pods": 0}
    assert requests.shortfall(asked, free) == [
        requests.Shortfall(resource="cpu", asked=1000, free=0),
        requests.Shortfall(resource="pods", asked=1, free=0),
    ]


def test_shortfall_is_empty_when_everything_fits_exactly() -> None:
    assert requests.shortfall({"cpu": 1000, "memory": GI}, {"cpu": 1000, "memory": GI, "pods": 5}) == []


def test_a_resource_the_node_does_not_report_has_nothing_free() -> None:
    assert requests.shortfall({"hugepages-2Mi": 2 * MI}, {"cpu": 4000}) == [
        requests.Shortfall(resource="hugepages-2Mi", asked=2 * MI, free=0)
    ]


def test_the_message_says_what_was_asked_and_what_is_free_of_how_much() -> None:
    allocatable = {"cpu": 4000, "memory": 64 * GI, "pods": 110}
    free = requests.node_free(allocatable, {"cpu": 4000, "memory": 62 * GI, "pods": 110})
    shortfalls = requests.shortfall({"cpu": 1000, "memory": 16 * GI, "pods": 1}, free)
    assert requests.describe("gpu-node-a", shortfalls, allocatable) == (
        "gpu-node-a: 1 CPU asked, 0 of 4 free; 16Gi memory asked, 2Gi of 64Gi free; "
        "1 pod asked, 0 of 110 free"
    )


def test_an_overcommitted_node_shows_nothing_free_not_a_negative_amount() -> None:
    allocatable = {"cpu": 4000}
    shortfalls = requests.shortfall({"cpu": 2500}, requests.node_free(allocatable, {"cpu": 5000}))
    assert requests.describe("n", shortfalls, allocatable) == "n: 2.5 CPU asked, 0 of 4 free"


@pytest.mark.parametrize(
    ("resource", "units", "shown"),
    [
        ("cpu", 0, "0"),
        ("cpu", 1, "0.001"),
        ("cpu", 250, "0.25"),
        ("cpu", 1500, "1.5"),
        ("cpu", 64000, "64"),
        ("memory", 1023, "1023"),
        ("memory", 1024, "1Ki"),
        ("memory", 512 * MI, "512Mi"),
        ("memory", GI + GI // 2, "1.5Gi"),
        ("memory", 80 * GI, "80Gi"),
        ("ephemeral-storage", 10 * GI, "10Gi"),
        ("hugepages-2Mi", 4 * MI, "4Mi"),
        ("pods", 110, "110"),
        ("example.com/foo", 3, "3"),
    ],
)
def test_amounts_are_shown_in_cores_and_binary_sizes(resource: str, units: int, shown: str) -> None:
    assert requests.format_amount(resource, units) == shown


@pytest.mark.parametrize(
    ("resource", "counted"),
    [("cpu", True), ("memory", True), ("ephemeral-storage", True), ("pods", True), ("hugepages-1Gi", True),
     ("nvidia.com/gpu", False), ("example.com/foo", False)],
)  # fmt: skip
def test_the_counted_resources_are_those_a_claim_may_state(resource: str, counted: bool) -> None:
    assert requests.counted(resource) is counted
