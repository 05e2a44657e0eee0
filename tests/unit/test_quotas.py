"""The quota rules (controller/quotas.py): verdicts, entries that only grow, patches, priority caps."""

from __future__ import annotations

from typing import Any

from controller import allocator, quotas
from gpualloc.api import codecs, models

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


def quota(gpus: int, *, claims: dict[str, dict[str, Any]] | None = None, **spec: Any) -> models.GpuQuota:
    return codecs.parse_quota(
        {
            "metadata": {"name": "default", "namespace": "ml", "resourceVersion": "7"},
            "spec": {"gpus": gpus, **spec},
            "status": {"claims": claims or {}},
        }
    )


def claim(count: int, *, replicas: int = 1, priority: int = 0, uid: str = "u-new") -> models.GpuClaim:
    return codecs.parse_claim(
        {
            "metadata": {
                "name": "job",
                "namespace": "ml",
                "uid": uid,
                "creationTimestamp": "2026-11-25T00:00:00Z",
            },
            "spec": {"devices": {"count": count}, "replicas": replicas, "priority": priority},
        }
    )


def test_a_claim_counts_for_its_gpus_per_replica() -> None:
    assert quotas.claim_gpus(claim(2, replicas=3)) == 6
    assert quotas.claim_milli(claim(2, replicas=3)) == 6000


def test_a_share_counts_for_its_fraction_of_a_gpu_and_its_entry_says_so_exactly() -> None:
    shares = codecs.parse_claim(
        {
            "metadata": {"name": "s", "namespace": "ml", "uid": "u-s"},
            "spec": {
                "devices": {"count": 1, "exclusivity": "Shared", "sharing": {"milli": 460}},
                "replicas": 2,
            },
        }
    )
    assert quotas.claim_milli(shares) == 920
    q = quota(2, claims={"u-a": {"name": "a", "gpus": 1, "milli": 300, "product": H100}})
    entry = quotas.merged(q, "u-s", quotas.claim_milli(shares), H100)
    assert (entry.gpus, entry.milli) == (1, 920)
    assert quotas.verdict(q, "u-s", entry) == ""  # 0.3 + 0.92 of 2 GPUs
    assert quotas.verdict(q, "u-new", quotas.merged(q, "u-new", 1800, H100)) == (
        "namespace ml would use 2.1 of 2 GPUs (quota ml/default)"
    )
    patch = quotas.entry_patch(q, shares, entry)
    assert patch["status"]["used"] == 2 and patch["status"]["usedMilli"] == 1220


def test_the_verdict_names_the_namespace_the_use_the_limit_and_the_quota() -> None:
    q = quota(8, claims={"u-a": {"name": "a", "gpus": 6, "product": H100}})
    assert quotas.verdict(q, "u-new", quotas.merged(q, "u-new", 2000, H100)) == ""
    assert quotas.verdict(q, "u-new", quotas.merged(q, "u-new", 4000, H100)) == (
        "namespace ml would use 10 of 8 GPUs (quota ml/default)"
    )


def test_a_claims_own_entry_is_replaced_not_added_to() -> None:
    q = quota(4, claims={"u-new": {"name": "job", "gpus": 4, "product": H100}})
    assert quotas.verdict(q, "u-new", quotas.merged(q, "u-new", 4000, H100)) == ""


def test_a_product_limit_counts_only_entries_whose_devices_match_it() -> None:
    q = quota(
        16,
        products=[{"pattern": "*H100*", "gpus": 4}],
        claims={
            "u-a": {"name": "a", "gpus": 3, "product": H100},
            "u-b": {"name": "b", "gpus": 8, "product": A100},
        },
    )
    assert quotas.verdict(q, "u-new", quotas.merged(q, "u-new", 2000, A100)) == ""
    assert quotas.verdict(q, "u-new", quotas.merged(q, "u-new", 2000, H100)) == (
        "namespace ml would use 5 of 4 *H100* GPUs (quota ml/default)"
    )
    # Before a plan (no product) only the total is checked.
    assert quotas.verdict(q, "u-new", quotas.merged(q, "u-new", 2000, "")) == ""


def test_an_entry_only_grows_so_it_covers_every_attempt_of_its_claim() -> None:
    q = quota(16, claims={"u-new": {"name": "job", "gpus": 2, "product": H100}})
    grown = quotas.merged(q, "u-new", 1000, A100)
    assert (grown.gpus, grown.product) == (2, f"{A100},{H100}")
    assert quotas.covers(q, "u-new", 2000, H100) and quotas.covers(q, "u-new", 1000, "")
    assert not quotas.covers(q, "u-new", 3000, H100) and not quotas.covers(q, "u-new", 2000, A100)
    assert not quotas.covers(q, "u-other", 1000, H100)


def test_the_patches_keep_used_and_used_by_product_equal_to_the_ledger() -> None:
    q = quota(
        16,
        products=[{"pattern": "*H100*", "gpus": 8}],
        claims={"u-a": {"name": "a", "gpus": 3, "product": H100}},
    )
    entered = quotas.entry_patch(q, claim(2), quotas.merged(q, "u-new", 2000, A100))
    assert entered == {
        "status": {
            "used": 5,
            "usedMilli": 5000,
            "usedByProduct": {"*H100*": 3},
            "claims": {"u-new": {"name": "job", "gpus": 2, "product": A100}},
        }
    }
    assert quotas.removal_patch(q, ["u-a"]) == {
        "status": {"used": 0, "usedMilli": 0, "usedByProduct": {"*H100*": 0}, "claims": {"u-a": None}}
    }


def test_the_products_of_a_plan_come_from_the_node_statuses() -> None:
    status = codecs.parse_node_status(
        {
            "metadata": {"name": "n"},
            "spec": {"nodeName": "n"},
            "status": {
                "devices": [
                    {"index": 0, "minor": 0, "uuid": "GPU-a", "product": H100},
                    {"index": 1, "minor": 1, "uuid": "GPU-b", "product": A100},
                ]
            },
        }
    )
    alloc = models.Allocation(
        replica=0,
        node_name="n",
        devices=(
            models.DeviceRef(index=0, minor=0, uuid="GPU-a"),
            models.DeviceRef(index=1, minor=1, uuid="GPU-b"),
        ),
    )
    assert quotas.products_of([alloc], {"n": status}) == f"{A100},{H100}"


def test_a_claims_priority_is_capped_by_the_lowest_max_priority_of_its_namespace() -> None:
    assert quotas.max_priority([quota(1), quota(1, maxPriority=50), quota(1, maxPriority=10)]) == 10
    assert quotas.max_priority([quota(1)]) is None
    loud, quiet = claim(1, priority=900, uid="u-loud"), claim(1, priority=20, uid="u-quiet")
    assert allocator.order_key(loud) < allocator.order_key(quiet)
    capped = allocator.order_key(loud, priority_cap=10), allocator.order_key(quiet, priority_cap=10)
    assert capped[0][0] == capped[1][0] == -10
