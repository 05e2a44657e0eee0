"""Hypothesis: quantities parse to the exact value a rational reference gives, and a pod's
requests follow kube-scheduler's sum (additive over containers, bounded below by every
container and init container, order of containers irrelevant, sidecars only add)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpualloc.api import quantities, requests

SETTINGS = settings(max_examples=300, deadline=None)

DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
RESOURCES = ("cpu", "memory", "ephemeral-storage", "pods", "hugepages-2Mi", "example.com/foo")


@st.composite
def quantity_texts(draw: st.DrawFn) -> tuple[str, Fraction]:
    """A quantity string and its exact value, built independently of the parser."""
    sign = draw(st.sampled_from(("", "+", "-")))
    whole = draw(st.text("0123456789", max_size=12))
    frac = draw(st.none() | st.text("0123456789", max_size=12))
    if not whole and not frac:
        whole = "0"
    number = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    kind = draw(st.sampled_from(("decimal", "binary", "exponent")))
    if kind == "decimal":
        suffix = draw(st.sampled_from(sorted(DECIMAL)))
        factor = Fraction(10) ** DECIMAL[suffix]
    elif kind == "binary":
        suffix = draw(st.sampled_from(sorted(BINARY)))
        factor = Fraction(2) ** BINARY[suffix]
    else:
        exponent = draw(st.integers(-40, 40))
        suffix = (
            draw(st.sampled_from(("e", "E")))
            + draw(st.sampled_from(("", "+") if exponent >= 0 else ("",)))
            + str(exponent)
        )
        factor = Fraction(10) ** exponent
    text = f"{sign}{whole}{'.' + frac if frac is not None else ''}{suffix}"
    value = number * factor * (-1 if sign == "-" else 1)
    return text, value


def reference_nanos(value: Fraction) -> int:
    """Kubernetes' rule: round up, away from zero, to a billionth; cap at 2^63-1 units."""
    magnitude = min(math.ceil(abs(value) * quantities.NANO), quantities.MAX_NANOS)
    return -magnitude if value < 0 else magnitude


@SETTINGS
@given(quantity_texts())
def test_a_quantity_parses_to_its_exact_value_rounded_up_to_a_billionth(case: tuple[str, Fraction]) -> None:
    text, value = case
    assert quantities.parse_nanos(text) == reference_nanos(value)


@SETTINGS
@given(quantity_texts())
def test_units_are_the_value_rounded_up_to_a_millicore_or_a_whole_unit(case: tuple[str, Fraction]) -> None:
    text, value = case
    nanos = Fraction(reference_nanos(value), quantities.NANO)
    assert quantities.parse_units("cpu", text) == math.ceil(nanos * 1000)
    assert quantities.parse_units("memory", text) == math.ceil(nanos)


@SETTINGS
@given(st.sampled_from(RESOURCES), st.integers(0, 2**62))
def test_a_unit_value_written_as_a_quantity_reads_back_unchanged(resource: str, units: int) -> None:
    assert quantities.parse_units(resource, quantities.unit_quantity(resource, units)) == units


# ------------------------------------------------------------------ pods

amounts = st.integers(0, 10**6)


@st.composite
def resource_lists(draw: st.DrawFn) -> dict[str, str]:
    names = draw(st.lists(st.sampled_from(RESOURCES[:3]), max_size=3, unique=True))
    return {name: f"{draw(amounts)}m" if name == "cpu" else str(draw(amounts)) for name in names}


def containers(sidecar: bool | None = None) -> st.SearchStrategy[dict[str, Any]]:
    policies = (
        st.sampled_from((None, "Always")) if sidecar is None else st.just("Always" if sidecar else None)
    )

    def build(reqs: dict[str, str], limits: dict[str, str], policy: str | None) -> dict[str, Any]:
        container: dict[str, Any] = {"name": "c", "resources": {"requests": reqs, "limits": limits}}
        if policy is not None:
            container["restartPolicy"] = policy
        return container

    return st.builds(build, resource_lists(), resource_lists(), policies)


def pod(main: list[dict[str, Any]], init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"spec": {"containers": main, "initContainers": init or []}}


def without_slot(reqs: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in reqs.items() if k != "pods"}


@SETTINGS
@given(st.lists(containers(sidecar=False), max_size=4), st.lists(containers(sidecar=False), max_size=4))
def test_plain_containers_are_additive(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    both = dict(without_slot(requests.pod_requests(pod(a))))
    requests.add(both, without_slot(requests.pod_requests(pod(b))))
    assert without_slot(requests.pod_requests(pod(a + b))) == both


@SETTINGS
@given(st.lists(containers(), max_size=4), st.lists(containers(), max_size=5), st.randoms())
def test_the_order_of_the_containers_does_not_matter(
    main: list[dict[str, Any]], init: list[dict[str, Any]], rng: Any
) -> None:
    shuffled = list(main)
    rng.shuffle(shuffled)
    assert requests.pod_requests(pod(shuffled, init)) == requests.pod_requests(pod(main, init))


@SETTINGS
@given(st.lists(containers(), max_size=4), st.lists(containers(), max_size=5))
def test_the_pod_requests_at_least_each_container_and_each_init_container(
    main: list[dict[str, Any]], init: list[dict[str, Any]]
) -> None:
    total = requests.pod_requests(pod(main, init))
    assert total["pods"] == 1
    for container in [*main, *init]:
        alone = without_slot(requests.pod_requests(pod([container])))
        assert all(total.get(name, 0) >= value for name, value in alone.items())


@SETTINGS
@given(st.lists(containers(), max_size=4), st.lists(containers(), max_size=5), containers(sidecar=True))
def test_a_sidecar_declared_last_asks_no_more_than_declared_first(
    main: list[dict[str, Any]], init: list[dict[str, Any]], sidecar: dict[str, Any]
) -> None:
    first = requests.pod_requests(pod(main, [sidecar, *init]))
    last = requests.pod_requests(pod(main, [*init, sidecar]))
    assert all(first.get(name, 0) >= value for name, value in last.items())


@SETTINGS
@given(
    st.dictionaries(st.sampled_from(RESOURCES), st.integers(-5, 10**9), max_size=6),
    st.dictionaries(st.sampled_from(RESOURCES), st.integers(0, 10**9), max_size=6),
    st.dictionaries(st.sampled_from(RESOURCES), st.integers(0, 10**9), max_size=6),
)
def test_shortfall_is_empty_exactly_when_everything_asked_fits(
    asked: dict[str, int], allocatable: dict[str, int], used: dict[str, int]
) -> None:
    free = requests.node_free(allocatable, used)
    fits = all(value <= 0 or value <= free.get(name, 0) for name, value in asked.items())
    short = requests.shortfall(asked, free)
    assert (short == []) == fits
    assert all(s.asked > s.free for s in short)
