"""What a pod requests, as kube-scheduler sums it, and whether a node can take it. Pure.

kube-scheduler's NodeResourcesFit filter lets a pod onto a node only when, for
each resource the pod requests, the request is at most the node's allocatable
minus the requests of the pods already bound there; and the pod is one more of
the node's ``pods``. A pod's request of a resource (``PodRequests`` in
k8s.io/component-helpers/resource, the sidecar rules of KEP-753) is::

    max(sum of the containers' requests + sum of the sidecars' requests,
        max over init containers i of (i's request + the sidecars declared before i))
    replaced by spec.resources.requests where set (cpu, memory, hugepages-*),
    plus spec.overhead

where a sidecar is an init container with ``restartPolicy: Always`` (its
"use" while it starts is itself plus the sidecars before it). A container's
limit stands for a request it does not state, as the API server's defaulting
makes it.

Values are integers in the unit kube-scheduler counts each resource in
(``quantities.to_units``): millicores for cpu, bytes for memory, storage and
hugepages, a count for pods. Sums are exact (billionths) and rounded up once, as
the scheduler sums ``resource.Quantity`` values before ``MilliValue()``.

A value that is not a quantity (never in a pod the API server stored, which
writes every quantity in canonical form) is ignored, as if the container did not
state it: a watch event must not stop the controller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from gpualloc.api import quantities

# What NodeResourcesFit checks and a claim's spec.podResources may state.
STANDARD = (quantities.CPU, quantities.MEMORY, quantities.EPHEMERAL_STORAGE, quantities.PODS)
_POD_LEVEL = (quantities.CPU, quantities.MEMORY)  # and hugepages-*: spec.resources may set them


def counted(resource: str) -> bool:
    """A resource gpualloc counts on a node: cpu, memory, ephemeral-storage, pods, hugepages-*."""
    return resource in STANDARD or resource.startswith(quantities.HUGEPAGES_PREFIX)


def _list(raw: Any) -> dict[str, int]:
    """A ResourceList (name -> quantity) in billionths; values that are not quantities left out."""
    out: dict[str, int] = {}
    if not isinstance(raw, Mapping):
        return out
    for name, value in raw.items():
        try:
            out[str(name)] = quantities.parse_nanos(value)
        except quantities.QuantityError:
            continue
    return out


def _container_requests(container: Any) -> dict[str, int]:
    """A container's requests in billionths; a limit stands for a request it does not state."""
    resources = container.get("resources") if isinstance(container, Mapping) else None
    if not isinstance(resources, Mapping):
        return {}
    requests = _list(resources.get("requests"))
    for name, value in _list(resources.get("limits")).items():
        requests.setdefault(name, value)
    return requests


def _add(into: dict[str, int], more: Mapping[str, int]) -> None:
    for name, value in more.items():
        into[name] = into.get(name, 0) + value


def _max(into: dict[str, int], more: Mapping[str, int]) -> None:
    for name, value in more.items():
        into[name] = max(into.get(name, value), value)


def _sidecar(container: Any) -> bool:
    return isinstance(container, Mapping) and container.get("restartPolicy") == "Always"


def _containers(spec: Mapping[str, Any], key: str) -> list[Any]:
    value = spec.get(key)
    return list(value) if isinstance(value, list) else []


def pod_request_nanos(pod: Mapping[str, Any]) -> dict[str, int]:
    """What a pod requests, in billionths of each resource's unit (see the module docstring);
    without the pod's own ``pods: 1``."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return {}
    total: dict[str, int] = {}
    for container in _containers(spec, "containers"):
        _add(total, _container_requests(container))
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for container in _containers(spec, "initContainers"):
        requests = _container_requests(container)
        if _sidecar(container):
            _add(total, requests)
            _add(sidecars, requests)
            use = dict(sidecars)
        else:
            use = dict(requests)
            _add(use, sidecars)
        _max(init_peak, use)
    _max(total, init_peak)
    pod_level = spec.get("resources")
    if isinstance(pod_level, Mapping):
        for name, value in _list(pod_level.get("requests")).items():
            if name in _POD_LEVEL or name.startswith(quantities.HUGEPAGES_PREFIX):
                total[name] = value
    _add(total, _list(spec.get("overhead")))
    return total


def pod_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """What a pod requests, in the unit kube-scheduler counts each resource in (millicores for
    cpu, bytes, a count), plus ``pods: 1``: what it takes of a node it is bound to. Resources
    it requests nothing of are left out."""
    out = {
        name: units
        for name, nanos in pod_request_nanos(pod).items()
        if (units := quantities.to_units(name, nanos)) != 0
    }
    out[quantities.PODS] = out.get(quantities.PODS, 0) + 1
    return out


def parse_resource_list(raw: Any) -> dict[str, int]:
    """A ResourceList (a Node's ``status.allocatable``, a claim's podResources) in each
    resource's unit; values that are not quantities left out."""
    return {name: quantities.to_units(name, nanos) for name, nanos in _list(raw).items()}


def add(into: dict[str, int], more: Mapping[str, int], times: int = 1) -> None:
    """Add ``times`` x ``more`` to ``into`` (a node's running sum: ``times=-1`` takes a pod off)."""
    for name, value in more.items():
        into[name] = into.get(name, 0) + times * value
        if into[name] == 0:
            del into[name]


def node_free(allocatable: Mapping[str, int], requested: Mapping[str, int]) -> dict[str, int]:
    """What a node has left of each resource it reports: allocatable minus what its pods
    request (negative when the pods already ask for more, e.g. after allocatable shrank)."""
    return {name: value - requested.get(name, 0) for name, value in allocatable.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class Shortfall:
    """One resource a node lacks: ``asked`` of it, only ``free`` left (as NodeResourcesFit)."""

    resource: str
    asked: int
    free: int


def shortfall(asked: Mapping[str, int], free: Mapping[str, int]) -> list[Shortfall]:
    """The resources of ``asked`` a node with ``free`` left cannot give, sorted by name:
    NodeResourcesFit's test, ``asked > free``, for each resource asked for (more than 0). A
    resource the node does not report has nothing free (the scheduler's allocatable is 0)."""
    return [
        Shortfall(resource=name, asked=value, free=free.get(name, 0))
        for name, value in sorted(asked.items())
        if value > 0 and value > free.get(name, 0)
    ]


def format_amount(resource: str, units: int) -> str:
    """A value as people read it: cpu in cores (``0.25``, ``4``), byte counts in Gi, Mi or Ki
    (``1.5Gi``, ``512Mi``), anything else as the number."""
    if resource == quantities.CPU:
        return _decimal(units, 1000, 3)
    if resource in (quantities.MEMORY, quantities.EPHEMERAL_STORAGE) or resource.startswith(
        quantities.HUGEPAGES_PREFIX
    ):
        for suffix, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
            if abs(units) >= size:
                return _decimal(units, size, 2) + suffix
    return str(units)


def _decimal(value: int, scale: int, places: int) -> str:
    """``value / scale`` with at most ``places`` decimals (rounded half up), trailing zeros cut."""
    step = 10**places
    scaled = (abs(value) * step * 2 + scale) // (2 * scale)
    whole, frac = divmod(scaled, step)
    text = f"{whole}.{frac:0{places}d}".rstrip("0").rstrip(".")
    return f"-{text}" if value < 0 and scaled else text


def lacking(shortfalls: Iterable[Shortfall], allocatable: Mapping[str, int]) -> str:
    """What a node lacks, as people read it: ``1 CPU asked, 0 of 4 free; 16Gi memory asked, 2Gi
    of 64Gi free``."""
    parts = []
    for short in shortfalls:
        noun = {quantities.CPU: "CPU", quantities.PODS: "pod" if short.asked == 1 else "pods"}.get(
            short.resource, short.resource
        )
        asked = format_amount(short.resource, short.asked)
        free = format_amount(short.resource, max(short.free, 0))
        total = format_amount(short.resource, allocatable.get(short.resource, 0))
        parts.append(f"{asked} {noun} asked, {free} of {total} free")
    return "; ".join(parts)


def describe(node: str, shortfalls: Iterable[Shortfall], allocatable: Mapping[str, int]) -> str:
    """Why ``node`` cannot take the pods, as ``explain`` and the claim's message say it:
    ``gpu-node-a: 1 CPU asked, 0 of 4 free; 16Gi memory asked, 2Gi of 64Gi free``."""
    return f"{node}: {lacking(shortfalls, allocatable)}"
