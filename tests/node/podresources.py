"""A client of the kubelet's PodResources API (podresources v1 ``List``), as monitoring reads it.

The kubelet serves ``v1.PodResourcesLister`` on ``<kubelet root>/pod-resources/kubelet.sock``
(the vendored ``agent/kubeletapi/podresources_v1.proto``); ``List`` says, for each running pod's
containers, the device plugins' devices and the DRA claims' devices (``dynamic_resources``: the
claim's name and namespace and, per device, its driver, pool, name and CDI device IDs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc

from agent.kubeletapi import podresources_v1_pb2 as pb

LIST = "/v1.PodResourcesLister/List"


@dataclasses.dataclass(frozen=True)
class ClaimDevices:
    """One DRA claim of a container, as the kubelet reports it."""

    claim: str
    namespace: str
    devices: tuple[str, ...]  # driver/pool/device of each
    cdi_devices: tuple[str, ...]


def socket_path(kubelet_root: Path) -> Path:
    return kubelet_root / "pod-resources" / "kubelet.sock"


def list_claims(socket: Path, *, timeout: float = 10.0) -> dict[tuple[str, str, str], list[ClaimDevices]]:
    """(pod namespace, pod, container) -> its DRA claims' devices, for every container ``List`` names."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        call = channel.unary_unary(
            LIST,
            request_serializer=pb.ListPodResourcesRequest.SerializeToString,
            response_deserializer=pb.ListPodResourcesResponse.FromString,
        )
        response = call(pb.ListPodResourcesRequest(), timeout=timeout)
    found: dict[tuple[str, str, str], list[ClaimDevices]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            found[(pod.namespace, pod.name, container.name)] = [
                ClaimDevices(
                    claim=dynamic.claim_name,
                    namespace=dynamic.claim_namespace,
                    devices=tuple(
                        f"{r.driver_name}/{r.pool_name}/{r.device_name}" for r in dynamic.claim_resources
                    ),
                    cdi_devices=tuple(d.name for r in dynamic.claim_resources for d in r.cdi_devices),
                )
                for dynamic in container.dynamic_resources
            ]
    return found
