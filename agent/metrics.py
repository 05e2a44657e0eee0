"""The agent's Prometheus metrics, named so a DCGM-exporter user finds their way.

Per-GPU gauges carry the labels ``gpu`` (host index), ``uuid``, ``product`` and
``node``; they are produced at scrape time from the agent's latest inventory,
samples and Leases (a custom collector), so a GPU that disappears stops being
reported instead of freezing at its last value.

=========================================  ===================================
gpualloc_gpu_utilization_percent           like DCGM_FI_DEV_GPU_UTIL
gpualloc_gpu_memory_used_bytes             like DCGM_FI_DEV_FB_USED (bytes)
gpualloc_gpu_memory_total_bytes            FB_USED + FB_FREE (bytes)
gpualloc_gpu_temperature_celsius           like DCGM_FI_DEV_GPU_TEMP
gpualloc_gpu_power_watts                   like DCGM_FI_DEV_POWER_USAGE
gpualloc_gpu_health                        1 Healthy, 0 Unhealthy
gpualloc_gpu_allocated                     1 when a device Lease holds it
gpualloc_gpu_lease_info                    1 per leased GPU, with the claim
gpualloc_agent_scan_duration_seconds       histogram of one source scan
gpualloc_agent_publish_errors_total        failed writes to the API server
gpualloc_agent_status_writes_total{kind}   create, status, refresh, heartbeat (Lease), owner
gpualloc_agent_nvml_ready                  1 when the source can be read
=========================================  ===================================
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent import inventory
from gpualloc.api import constants, models

GPU_LABELS = ("gpu", "uuid", "product", "node")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeaseHolder:
    """Who holds a device, as its Lease says (``gpualloc.api.leases.parse``)."""

    claim_namespace: str
    claim_name: str
    claim_uid: str


class AgentMetrics:
    """Holds the registry and the state the per-GPU collector reads."""

    def __init__(self, node_name: str, registry: prometheus_client.CollectorRegistry | None = None) -> None:
        self.node_name = node_name
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.inventory = models.NodeInventory()
        self.samples: Sequence[inventory.DeviceSample] = ()
        self.leases: Mapping[str, LeaseHolder] = {}  # lock id (Device.lock_ids) -> holder
        # GPU UUID -> the claims holding milli-GPU shares of it (its Lease's ledger); such a GPU is in
        # ``leases`` too, under its first share's claim.
        self.shares: Mapping[str, tuple[LeaseHolder, ...]] = {}
        self.unexpected: Sequence[models.UnexpectedProcess] = ()  # the usage audit's last findings
        self.source_ready = False
        self.scan_duration = prometheus_client.Histogram(
            "gpualloc_agent_scan_duration_seconds",
            "Time to read the devices from the source (NVML or simulated).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=self.registry,
        )
        self.publish_errors = prometheus_client.Counter(
            "gpualloc_agent_publish_errors",
            "Writes of the GpuNodeStatus that failed.",
            registry=self.registry,
        )
        self.status_writes = prometheus_client.Counter(
            "gpualloc_agent_status_writes",
            "GpuNodeStatus writes (create, status, refresh, owner), heartbeat Lease renewals (heartbeat).",
            ["kind"],
            registry=self.registry,
        )
        self.registry.register(_GpuCollector(self))

    def gpu_labels(self, device: models.Device) -> list[str]:
        return [str(device.index), device.uuid, device.product, self.node_name]


class _GpuCollector(Collector):
    def __init__(self, owner: AgentMetrics) -> None:
        self._owner = owner

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # produced at scrape time; nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        owner = self._owner
        devices = {d.uuid: d for d in owner.inventory.devices}
        samples = {s.uuid: s for s in owner.samples}
        families = {
            "utilization": GaugeMetricFamily(
                "gpualloc_gpu_utilization_percent", "GPU utilisation (%).", labels=GPU_LABELS
            ),
            "mem_used": GaugeMetricFamily(
                "gpualloc_gpu_memory_used_bytes", "Framebuffer memory in use (bytes).", labels=GPU_LABELS
            ),
            "mem_total": GaugeMetricFamily(
                "gpualloc_gpu_memory_total_bytes", "Framebuffer memory in total (bytes).", labels=GPU_LABELS
            ),
            "temperature": GaugeMetricFamily(
                "gpualloc_gpu_temperature_celsius", "GPU temperature (degrees C).", labels=GPU_LABELS
            ),
            "power": GaugeMetricFamily("gpualloc_gpu_power_watts", "Power draw (W).", labels=GPU_LABELS),
        }
        health = GaugeMetricFamily("gpualloc_gpu_health", "1 when the GPU is Healthy.", labels=GPU_LABELS)
        allocated = GaugeMetricFamily(
            "gpualloc_gpu_allocated", "1 when a device Lease holds the GPU.", labels=GPU_LABELS
        )
        strays = GaugeMetricFamily(
            "gpualloc_gpu_unexpected_processes",
            "Processes on the GPU that no claim holding it accounts for (the usage audit).",
            labels=GPU_LABELS,
        )
        stray_counts = collections.Counter(p.uuid for p in owner.unexpected)
        lease_info = GaugeMetricFamily(
            "gpualloc_gpu_lease_info",
            "The claim whose Lease holds the GPU (value 1).",
            labels=[*GPU_LABELS, "claim_namespace", "claim_name", "claim_uid"],
        )
        for uuid, device in devices.items():  # derive's order: by index
            labels = owner.gpu_labels(device)
            health.add_metric(labels, 1.0 if device.health == constants.HEALTHY else 0.0)
            # Its own Lease, else the first of its MIG instances' (the GPU is as allocated).
            holder = next((owner.leases[u] for u in device.lock_ids if u in owner.leases), None)
            allocated.add_metric(labels, 1.0 if holder else 0.0)
            strays.add_metric(labels, float(stray_counts[uuid]))
            for each in owner.shares.get(uuid) or ((holder,) if holder else ()):
                lease_info.add_metric([*labels, each.claim_namespace, each.claim_name, each.claim_uid], 1.0)
            sample = samples.get(uuid)
            if sample is None:
                continue
            for key, value in (
                ("utilization", sample.utilization_percent),
                ("mem_used", sample.memory_used_bytes),
                ("mem_total", sample.memory_total_bytes),
                ("temperature", sample.temperature_celsius),
                ("power", sample.power_watts),
            ):
                if value is not None:
                    families[key].add_metric(labels, float(value))
        yield from families.values()
        yield health
        yield allocated
        yield strays
        yield lease_info
        ready = GaugeMetricFamily(
            "gpualloc_agent_nvml_ready", "1 when the device source can be read.", labels=["node"]
        )
        ready.add_metric([owner.node_name], 1.0 if owner.source_ready else 0.0)
        yield ready
