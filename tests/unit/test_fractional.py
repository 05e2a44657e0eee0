"""Milli-GPU shares (issue 39), the pure parts: the ledger format, the plan, screening, the views,
preemption's arithmetic and what a share's pods get."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest

from controller import allocator, asks, locking, locks, preemption, views
from gpualloc.api import leases, models, pods
from tests.unit.test_allocator import claim, node, nvswitch
from webhook import objects, recipe

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def share(milli: int, *, strategy: str = "TimeSlicing", **kw: Any) -> models.GpuClaim:
    request = models.SharingRequest(strategy=strategy, milli=milli)
    return claim(1, exclusivity="Shared", sharing=request, **kw)


def used(view: allocator.NodeView, milli: dict[int, int]) -> allocator.NodeView:
    """The view with these GPUs (by index) holding shares of that many milli-GPU."""
    assert view.inventory is not None
    by_index = {d.index: d.uuid for d in view.inventory.devices}
    shared = {by_index[i]: m for i, m in milli.items()}
    return dataclasses.replace(view, taken=view.taken | shared.keys(), milli_used=shared)


def placed(decision: allocator.Decision) -> list[tuple[str, int, int | None]]:
    return [(a.node_name, d.index, d.milli) for a in decision.allocations for d in a.devices]


# ------------------------------------------------------------------ the ledger format


def test_a_share_ledger_round_trips_and_reads_as_entries_held_by_each_claim() -> None:
    entry = leases.share_entry(milli=460, claim_namespace="ns", claim_name="a", claim_resource_version="7")
    raw = leases.share_lease("gpualloc-system", uuid="GPU-x", node="n0", entries={"uid-a": entry}, now=NOW)
    assert raw["metadata"]["name"] == "gpu-gpu-x"
    assert raw["metadata"]["labels"][leases.SHARE_LABEL_PREFIX + "uid-a"] == "460"
    second = leases.share_entry(milli=500, claim_namespace="ns", claim_name="b", claim_resource_version="9")
    raw = leases.with_ledger(raw, {**leases.ledger(raw), "uid-b": second})
    info = leases.parse(raw)
    assert info.ledger and info.holder == "" and info.used_milli == 960
    assert [(s.holder, s.milli, s.claim_name, s.claim_resource_version) for s in info.shares] == [
        ("uid-a", 460, "a", "7"),
        ("uid-b", 500, "b", "9"),
    ]
    held = leases.held_by(raw, "uid-b")
    assert held is not None and held.milli == 500 and held.name == "gpu-gpu-x"
    assert leases.held_by(raw, "uid-c") is None
    dropped = leases.with_ledger(raw, {"uid-b": second})
    assert leases.SHARE_LABEL_PREFIX + "uid-a" not in dropped["metadata"]["labels"]


def test_a_whole_lease_takes_the_whole_gpu_and_a_garbled_ledger_reads_as_full() -> None:
    whole = leases.device_lease(
        "ns",
        lock_id="GPU-x",
        node="n0",
        claim_namespace="a",
        claim_name="c",
        claim_uid="u",
        claim_resource_version="1",
        now=NOW,
    )
    assert leases.parse(whole).used_milli == leases.WHOLE_MILLI and not leases.parse(whole).ledger
    raw = leases.share_lease("ns", uuid="GPU-x", node="n0", entries={}, now=NOW)
    raw["metadata"]["annotations"][leases.ANNOTATION_SHARES] = "{not json"
    assert leases.parse(raw).used_milli == leases.WHOLE_MILLI


@pytest.mark.parametrize(
    ("entries", "deleting", "milli", "fits"),
    [
        ({"a": 500}, False, 500, True),  # exactly the whole GPU
        ({"a": 500}, False, 501, False),  # one past it
        ({"a": 500}, True, 100, False),  # a Lease being deleted takes no new entry
        ({"me": 100}, False, 100, False),  # never adopt an entry of the same claim (rule 1)
    ],
)
def test_a_share_goes_in_only_with_room_into_a_live_ledger_without_its_claim(
    entries: dict[str, int], deleting: bool, milli: int, fits: bool
) -> None:
    shares = tuple(
        leases.LeaseInfo(
            name="gpu-x",
            uid="l",
            holder=uid,
            claim_namespace="ns",
            claim_name=uid,
            claim_resource_version="1",
            node="n0",
            deleting=deleting,
            milli=m,
        )
        for uid, m in entries.items()
    )
    ledger = dataclasses.replace(shares[0], holder="", milli=0, shares=shares, ledger=True)
    assert locking.fits(ledger, "me", milli) is fits


def test_a_share_never_goes_into_a_whole_claims_lease() -> None:
    whole = leases.LeaseInfo(
        name="gpu-x",
        uid="l",
        holder="other",
        claim_namespace="ns",
        claim_name="o",
        claim_resource_version="1",
        node="n0",
        deleting=False,
    )
    assert not locking.fits(whole, "me", 1)


# ------------------------------------------------------------------ the plan and the views


def test_a_share_is_planned_as_an_entry_of_its_gpus_own_lease() -> None:
    device = models.DeviceRef(index=3, minor=3, uuid="GPU-x", milli=250)
    allocation = models.Allocation(replica=0, node_name="n0", devices=(device,))
    (item,) = locks.lock_plan([allocation])
    assert (item.lease, item.milli) == ("gpu-gpu-x", 250)
    status = models.GpuClaimStatus(phase="Allocated", allocations=(allocation,))
    listed = dataclasses.replace(share(250), status=status)
    assert locks.listed_shares(listed) == {"GPU-x": 250} and not locks.listed_whole(listed)
    assert locks.recorded(listed) == {"gpu-gpu-x"}


def test_views_count_the_shares_of_a_gpu_and_a_whole_holder_as_all_of_it() -> None:
    inventory = nvswitch("n", 2)
    a, b = (d.uuid for d in inventory.devices)
    listed = [
        dataclasses.replace(
            share(m),
            status=models.GpuClaimStatus(
                allocations=(
                    models.Allocation(
                        replica=0,
                        node_name="n",
                        devices=(models.DeviceRef(index=0, minor=0, uuid=a, milli=m),),
                    ),
                )
            ),
        )
        for m in (300, 450)
    ]
    whole = dataclasses.replace(
        claim(1),
        status=models.GpuClaimStatus(
            allocations=(
                models.Allocation(
                    replica=0, node_name="n", devices=(models.DeviceRef(index=1, minor=1, uuid=b),)
                ),
            )
        ),
    )
    taken, milli_used = views.held_by_claims([*listed, whole])
    assert taken == {a, b}
    assert views.shares_on(inventory, frozenset(taken), milli_used) == {a: 750}


# ------------------------------------------------------------------ screening


def test_a_share_goes_to_the_gpu_it_fits_best_and_a_whole_claim_never_to_a_shared_gpu() -> None:
    view = used(node("n", nvswitch("n", 4)), {0: 300, 1: 600, 2: 900})
    assert placed(allocator.allocate(share(400), [view])) == [("n", 1, 400)]  # 600 + 400: nothing left
    assert placed(allocator.allocate(share(100), [view])) == [("n", 2, 100)]
    assert placed(allocator.allocate(share(800), [view])) == [("n", 3, 800)]  # only the free one
    assert placed(allocator.allocate(claim(1), [view])) == [("n", 3, None)]
    assert not allocator.allocate(claim(2), [view]).ok


def ranked_share(milli: int, strategy: str) -> models.GpuClaim:
    return claim(1, exclusivity="Shared", sharing=models.SharingRequest(milli=milli), strategy=strategy)


@pytest.mark.parametrize("strategy", ["binpack", "bestFit"])
def test_packing_strategies_put_a_share_on_the_gpu_it_fills_best_on_any_node_then_the_first_node(
    strategy: str,
) -> None:
    a = used(node("a", nvswitch("a", 4)), {0: 300})  # 700 left on GPU 0
    b = used(node("b", nvswitch("b", 2)), {0: 550})  # 450 left on GPU 0
    c = node("c", nvswitch("c", 2))
    assert placed(allocator.allocate(ranked_share(400, strategy), [c, b, a])) == [("b", 0, 400)]
    assert placed(allocator.allocate(ranked_share(600, strategy), [c, b, a])) == [("a", 0, 600)]
    # Only free GPUs hold 800: one on the first node by name, not the emptiest or the fullest.
    assert placed(allocator.allocate(ranked_share(800, strategy), [c, b, a])) == [("a", 1, 800)]
    spread = allocator.allocate(ranked_share(400, "spread"), [c, b, a])
    assert placed(spread) == [("a", 0, 400)]  # spread ranks by load (a has the most free GPUs) first


def test_a_share_that_fits_nowhere_says_how_much_the_roomiest_gpu_has() -> None:
    view = used(node("n", nvswitch("n", 2)), {0: 700, 1: 650})
    decision = allocator.allocate(share(400), [view])
    assert not decision.ok
    assert "no GPU with 400 milli-GPU free" in decision.reason, decision.reason
    assert decision.per_node["n"] == (
        "2 of 2 GPUs free or shared, the most free has 350 milli-GPU (0 with room); need 400"
    )


def test_a_gangs_shares_go_on_different_gpus() -> None:
    view = node("n", nvswitch("n", 2))
    assert sorted(placed(allocator.allocate(share(200, replicas=2), [view]))) == [
        ("n", 0, 200),
        ("n", 1, 200),
    ]
    assert not allocator.allocate(share(200, replicas=3), [view]).ok


@pytest.mark.parametrize(
    ("count", "milli", "most", "error"),
    [
        (2, 500, None, "devices.count must be 1"),
        (1, 1000, None, "sharing.milli must be 1..999"),
        (1, 500, 2, "do not go together"),
    ],
)
def test_a_share_of_more_than_one_gpu_or_of_a_whole_one_is_refused(
    count: int, milli: int, most: int | None, error: str
) -> None:
    request = models.SharingRequest(milli=milli, max_claims_per_gpu=most)
    parsed = asks.parse(claim(count, exclusivity="Shared", sharing=request))
    assert isinstance(parsed, str) and error in parsed, parsed


# ------------------------------------------------------------------ preemption


def test_preempting_a_share_frees_its_milli_and_the_gpu_only_when_no_share_is_left() -> None:
    view = used(node("n", nvswitch("n", 1)), {0: 700})
    uuid = view.inventory.devices[0].uuid if view.inventory else ""

    def victim(m: int) -> models.GpuClaim:
        ref = models.DeviceRef(index=0, minor=0, uuid=uuid, milli=m)
        allocation = models.Allocation(replica=0, node_name="n", devices=(ref,))
        return dataclasses.replace(share(m), status=models.GpuClaimStatus(allocations=(allocation,)))

    (partly,) = preemption._freed([view], [victim(300)])
    assert partly.milli_used == {uuid: 400} and uuid in partly.taken
    (wholly,) = preemption._freed([view], [victim(300), victim(400)])
    assert wholly.milli_used == {} and uuid not in wholly.taken


# ------------------------------------------------------------------ what the pods get


def _allocation(memory: int | None) -> models.Allocation:
    ref = models.DeviceRef(index=2, minor=2, uuid="GPU-x", milli=460, memory_mib=memory)
    return models.Allocation(replica=0, node_name="n0", devices=(ref,))


def test_an_mps_shares_pods_get_its_thread_percentage_and_memory_limit() -> None:
    spec = share(460, strategy="MPS").spec
    env = {e["name"]: e for e in recipe.sharing_env(spec, _allocation(37516))}
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]["value"] == "46"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]["value"] == "0=37516M"
    gated = {e["name"]: e for e in recipe.sharing_env(spec)}
    assert gated["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['gpu.scheduling/mps-memory-limit']"
    )
    assert recipe.sharing_env(share(460).spec, _allocation(37516)) == []  # time-slicing: no limits
    assert pods.share_thread_percentage(5) == 1 and pods.share_thread_percentage(999) == 100


def test_an_allocated_share_gets_its_gpu_by_uuid_and_the_share_of_its_memory() -> None:
    view = node("n", nvswitch("n", 1))
    (allocation,) = allocator.allocate(share(460, strategy="MPS"), [view]).allocations
    (device,) = allocation.devices
    assert device.memory_mib == 81559 * 460 // 1000
    pod = objects.decode_pod(
        b'{"metadata": {"name": "p", "namespace": "default"},'
        b' "spec": {"containers": [{"name": "main", "image": "x"}]}}'
    )
    assert pod is not None
    ops, _ = recipe.edits(pod, share(460, strategy="MPS"), allocation)
    env = {
        e["name"]: e.get("value") for op in ops if op.get("path", "").endswith("/env") for e in op["value"]
    }
    assert env["CUDA_VISIBLE_DEVICES"] == device.uuid
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={device.memory_mib}M"
