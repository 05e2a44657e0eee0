"""The whole stack on the real node, as `gpualloc dev up --real-node` runs it, for the node tier's
scenarios: a control plane with kube-scheduler and kube-controller-manager, the node with its
simulated 8-GPU agent as the kubelet's DRA plugin, and the controller and the webhook with
``--dra`` (``gpualloc.devcluster.components``); and what the scenarios do with it: GpuClaims,
busybox pods naming them, what a container saw read from its log through the API server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpualloc.api import constants
from gpualloc.devcluster import binaries, cluster, components, images, node
from tests.conftest import CRD_DIR, wait_until

RESOURCE = "/apis/resource.k8s.io/v1"
LISTED = "end-of-listing"
LIST_DEVICES = f"ls /dev; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; echo {LISTED}"


@dataclasses.dataclass
class Stack:
    plane: cluster.ControlPlane
    real: node.RealNode
    namespace: str
    left_by_teardown: list[str] = dataclasses.field(default_factory=list)

    # paths
    @property
    def claims(self) -> str:
        return f"/apis/gpu.scheduling/v1/namespaces/{self.namespace}/gpuclaims"

    @property
    def pods(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    def resource_claim(self, claim: str) -> str:
        return (
            f"{RESOURCE}/namespaces/{self.namespace}/resourceclaims/{constants.resource_claim_name(claim, 0)}"
        )

    def get(self, path: str) -> dict[str, Any]:
        found: dict[str, Any] = self.plane.request("GET", path)
        return found

    def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return self.get(path)
        except cluster.RequestError as exc:
            if exc.status == 404:
                return None
            raise

    # claims
    def create_claim(
        self, name: str, count: int = 1, *, release: str = "OnDelete", priority: int = 0
    ) -> None:
        spec = {"devices": {"count": count}, "release": release, "priority": priority}
        body = {
            "apiVersion": "gpu.scheduling/v1",
            "kind": "GpuClaim",
            "metadata": {"name": name},
            "spec": spec,
        }
        self.plane.request("POST", self.claims, body)

    def claim_phase(self, name: str) -> str:
        return str((self.get(f"{self.claims}/{name}").get("status") or {}).get("phase", ""))

    def wait_phase(self, name: str, phase: str, within: float = 60.0) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            claim = self.get(f"{self.claims}/{name}")
            return claim if (claim.get("status") or {}).get("phase") == phase else None

        found: dict[str, Any] = wait_until(f"GpuClaim {name} {phase}", reached, within=within)
        return found

    def wait_allocated(self, name: str) -> dict[str, Any]:
        """The claim once Allocated and its ResourceClaim allocated (the controller's --dra mirror)."""
        claim = self.wait_phase(name, constants.PHASE_ALLOCATED)

        def mirrored() -> bool:
            found = self.get_or_none(self.resource_claim(name))
            return bool(found and (found.get("status") or {}).get("allocation"))

        wait_until(f"the ResourceClaim of {name} allocated", mirrored, within=60)
        return claim

    # pods
    def create_pod(self, name: str, command: str, *, claim: str | None, **labels: str) -> float:
        """Create a busybox pod (naming ``claim``, or asking NVIDIA_VISIBLE_DEVICES=all without one)
        and wait until it is Running or done; the seconds from create to that."""
        container: dict[str, Any] = {
            "name": "main",
            "image": images.TOOLBOX_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["sh", "-c", command],
        }
        metadata: dict[str, Any] = {"name": name, "labels": {"app": name, **labels}}
        if claim is None:
            container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
        else:
            metadata["annotations"] = {constants.ANNOTATION_CLAIM: claim}
        spec = {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        }
        created = time.monotonic()
        self.plane.request(
            "POST", self.pods, {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
        )

        def started() -> bool:
            phase = (self.get(f"{self.pods}/{name}").get("status") or {}).get("phase")
            if phase == "Failed":
                raise AssertionError(f"pod {name} failed: {self.get(f'{self.pods}/{name}').get('status')}")
            return phase in ("Running", "Succeeded")

        wait_until(f"pod {name} Running", started, within=90, every=0.05)
        return time.monotonic() - created

    def seen(self, pod: str) -> Seen:
        """What the pod's container printed with LIST_DEVICES."""

        def listed() -> str | None:
            text: str = self.plane.request("GET", f"{self.pods}/{pod}/log", accept="*/*")
            return text if LISTED in text else None

        words: list[str] = wait_until(f"pod {pod} to list /dev", listed, within=60).split()
        cuda = next((w.split("=", 1)[1] for w in words if w.startswith("CUDA_VISIBLE_DEVICES=")), "")
        return Seen(
            nvidia=sorted(w for w in words if w.startswith("nvidia")),
            cuda_visible_devices=cuda,
            pod=self.get(f"{self.pods}/{pod}"),
        )

    def wait_pod_gone(self, name: str, within: float = 60.0) -> None:
        wait_until(f"pod {name} gone", lambda: self.get_or_none(f"{self.pods}/{name}") is None, within=within)


@dataclasses.dataclass(kw_only=True)
class Seen:
    """What one pod's container saw, from its log."""

    nvidia: list[str]  # the nvidia* names in its /dev
    cuda_visible_devices: str
    pod: dict[str, Any]


def devices(claim: dict[str, Any]) -> list[dict[str, Any]]:
    """The devices (index, minor, uuid) of a one-replica claim's allocation."""
    (allocation,) = claim["status"]["allocations"]
    found: list[dict[str, Any]] = allocation["devices"]
    return found


@contextlib.contextmanager
def running_stack(directory: Path, namespace: str, say: Any) -> Iterator[Stack]:
    """The whole stack up in ``directory`` (short: the DRA plugin's socket path must fit 107
    bytes), with ``namespace`` made; stopped on exit, what the node left in ``left_by_teardown``."""
    programs = node.ensure_programs(say)
    paths = binaries.ensure(
        ["etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"], progress=say
    )
    plane = cluster.ControlPlane(directory, binaries=paths, progress=say, real_node=True)
    plane.start()
    real: node.RealNode | None = None
    stack: Stack | None = None
    try:
        plane.apply_crds(CRD_DIR)
        plane.ensure_scheduler()
        plane.ensure_controller_manager()
        real = node.RealNode(plane, programs, progress=say, gpu_profile="h100-sxm-8")
        real.start()
        components.start(plane, dra=True)
        plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        plane.ensure_service_account(namespace)
        stack = Stack(plane, real, namespace)
        yield stack
    finally:
        try:
            components.stop(plane)
            if real is not None:
                left = real.stop()
                if stack is not None:
                    stack.left_by_teardown = left
        finally:
            plane.stop()
