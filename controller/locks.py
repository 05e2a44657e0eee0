"""The pure side of the device locks: which Leases a plan takes, and which leftovers may go.

The rules these apply, and why no GPU is ever held by two claims, are argued in ``locking``,
which makes the API calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from gpualloc.api import constants, leases, models


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LockItem:
    lock_id: str  # the device's UUID, or a shared GPU's slot (``models.DeviceRef.lock_id``)
    lease: str
    node: str
    milli: int = 0  # a share of the GPU, an entry of its Lease's ledger; 0: the whole Lease


def lock_plan(allocations: Iterable[models.Allocation]) -> tuple[LockItem, ...]:
    """The Leases to hold for these allocations, sorted by lock id (the acquisition order)."""
    items = {
        device.lock_id: LockItem(
            lock_id=device.lock_id,
            lease=constants.lease_name(device.lock_id),
            node=alloc.node_name,
            milli=device.milli or 0,
        )
        for alloc in allocations
        for device in alloc.devices
    }
    return tuple(items[lock_id] for lock_id in sorted(items))


def listed_devices(claim: models.GpuClaim) -> frozenset[str]:
    """The lock ids (device UUIDs, or shared GPUs' slots) a claim's status lists, its shares'
    GPUs included."""
    return frozenset(d.lock_id for a in claim.status.allocations for d in a.devices)


def listed_whole(claim: models.GpuClaim) -> frozenset[str]:
    """The lock ids a claim's status lists whole: not as a milli-GPU share."""
    return frozenset(d.lock_id for a in claim.status.allocations for d in a.devices if not d.milli)


def listed_shares(claim: models.GpuClaim) -> dict[str, int]:
    """The GPUs (UUIDs) a claim's status lists a share of, and the share in milli-GPU."""
    return {d.uuid: d.milli for a in claim.status.allocations for d in a.devices if d.milli}


def recorded(claim: models.GpuClaim) -> frozenset[str]:
    """The Lease names of the devices a claim's status lists."""
    return frozenset(constants.lease_name(lock_id) for lock_id in listed_devices(claim))


def locks_device(lease_name: str, uuid: str) -> bool:
    """Whether the Lease ``lease_name`` locks GPU ``uuid``, or a MIG instance with that UUID, or one
    of the GPU's sharing slots (``constants.slot_id``): what a pod given ``uuid`` relies on."""
    name = constants.lease_name(uuid)
    return lease_name == name or lease_name.startswith(f"{name}-s")


def releasable(leftovers: Iterable[leases.LeaseInfo], view: models.GpuClaim) -> list[leases.LeaseInfo]:
    """The leftovers (Leases of ``view``'s claim seen before ``view`` was read) that no attempt can
    still record: not listed by ``view`` and stamped with another resourceVersion (``locking``,
    rule 3)."""
    listed = recorded(view)
    version = view.metadata.resource_version
    return [info for info in leftovers if info.name not in listed and info.claim_resource_version != version]
