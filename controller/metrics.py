"""The controller's Prometheus metrics, in a registry of its own (served on /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# node, state (free | allocated | unhealthy), count
DeviceCounts = Iterable[tuple[str, str, int]]

DEVICE_STATES = ("free", "allocated", "unhealthy")

# namespace, quota name, used, hard
QuotaFigures = Iterable[tuple[str, str, int, int]]

# (namespace, claim, product, profile), GPU-seconds
UsageFigures = Iterable[tuple[tuple[str, str, str, str], float]]


class _DeviceCollector(Collector):
    """``gpualloc_devices{node,state}``, computed from the caches when scraped."""

    def __init__(self) -> None:
        self.source: Callable[[], DeviceCounts] = lambda: ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gpualloc_devices",
            "GPUs per node by state (free, allocated, unhealthy)",
            labels=["node", "state"],
        )
        for node, state, count in self.source():
            family.add_metric([node, state], count)
        yield family


class _QuotaCollector(Collector):
    """``gpualloc_quota_used_gpus`` and ``gpualloc_quota_hard_gpus`` per GpuQuota, from the caches."""

    def __init__(self) -> None:
        self.source: Callable[[], QuotaFigures] = lambda: ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["namespace", "quota"]
        used = GaugeMetricFamily(
            "gpualloc_quota_used_gpus", "GPUs of the claims a GpuQuota admitted", labels=labels
        )
        hard = GaugeMetricFamily("gpualloc_quota_hard_gpus", "A GpuQuota's limit (spec.gpus)", labels=labels)
        for namespace, name, in_use, limit in self.source():
            used.add_metric([namespace, name], in_use)
            hard.add_metric([namespace, name], limit)
        yield used
        yield hard


class _UsageCollector(Collector):
    """``gpualloc_gpu_seconds_total{namespace,claim,product,profile}``, from the device Leases when
    scraped (``controller.usage``)."""

    def __init__(self) -> None:
        self.source: Callable[[], UsageFigures] = lambda: ()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "gpualloc_gpu_seconds",
            "Seconds each claim held a device (a GPU, MIG instance or share: see profile), from its"
            " Lease's acquireTime to its release",
            labels=["namespace", "claim", "product", "profile"],
        )
        for labels, seconds in self.source():
            family.add_metric(list(labels), seconds)
        yield family


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.claims_allocated = Counter(
            "gpualloc_claims_allocated", "Claims allocated, by strategy", ["strategy"], registry=r
        )
        self.allocation_failures = Counter(
            "gpualloc_allocation_failures",
            "Allocation attempts that failed, by reason",
            ["reason"],
            registry=r,
        )
        self.allocation_retries = Counter(
            "gpualloc_allocation_retries", "Allocation retries scheduled with backoff", registry=r
        )
        self.reconcile_duration = Histogram(
            "gpualloc_reconcile_duration_seconds",
            "Time to reconcile one claim",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.time_to_allocated = Histogram(
            "gpualloc_time_to_allocated_seconds",
            "From a claim's creation to its allocation",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
            registry=r,
        )
        self.events_dropped = Counter(
            "gpualloc_events_dropped", "Events not recorded: too many were waiting to be sent", registry=r
        )
        self.pending_claims = Gauge("gpualloc_pending_claims", "Claims waiting for devices", registry=r)
        self.leader = Gauge("gpualloc_leader", "1 while this controller is the leader", registry=r)
        self._devices = _DeviceCollector()
        r.register(self._devices)
        self._quotas = _QuotaCollector()
        r.register(self._quotas)
        self._usage = _UsageCollector()
        r.register(self._usage)

    def set_device_source(self, source: Callable[[], DeviceCounts]) -> None:
        self._devices.source = source

    def set_quota_source(self, source: Callable[[], QuotaFigures]) -> None:
        self._quotas.source = source

    def set_usage_source(self, source: Callable[[], UsageFigures]) -> None:
        self._usage.source = source

    def set_pending_source(self, source: Callable[[], int]) -> None:
        self.pending_claims.set_function(lambda: float(source()))
