"""packing.defaultStrategy as the chart installs it, against the real kube-apiserver: the
MutatingAdmissionPolicy that gives a GpuClaim created without ``spec.strategy`` the cluster's
default, and leaves a claim's own strategy alone.

The release is the e2e fixtures' (tests/e2e/conftest.py), with ``HELM_VALUES`` on top. Claims are
created by the tenant (``edit`` in its namespace, its own token) as dry runs: the API server runs
the policy on them all the same and stores nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpualloc.api import codecs
from tests.e2e.tenants import Setup, call, claim_body, claims_path, eventually

HELM_VALUES = ("packing.defaultStrategy=leastFragmentation",)
DRY = [("dryRun", "All")]


async def admitted(s: Setup, body: dict[str, Any]) -> dict[str, Any]:
    """The claim as the API server would store it, created by the tenant (a dry run)."""
    stored: dict[str, Any] = await call(s.tenant, "POST", claims_path(s.tenant_ns), body=body, query=DRY)
    return stored


@pytest.fixture(scope="module")
async def defaulting(setup: Setup) -> Setup:
    async def in_force() -> bool:
        stored = await admitted(setup, claim_body("probe"))
        return stored["spec"].get("strategy") == "leastFragmentation"

    await eventually("the default-strategy MutatingAdmissionPolicy", in_force)
    return setup


async def test_a_tenants_claim_without_a_strategy_gets_the_charts_default(defaulting: Setup) -> None:
    stored = await admitted(defaulting, claim_body("plain"))
    assert stored["spec"]["strategy"] == "leastFragmentation"
    assert codecs.parse_claim(stored).spec.strategy == "leastFragmentation"


@pytest.mark.parametrize("own", ["binpack", "spread", "leastFragmentation"])
async def test_a_claims_own_strategy_is_kept(defaulting: Setup, own: str) -> None:
    body = claim_body("own")
    body["spec"]["strategy"] = own
    assert (await admitted(defaulting, body))["spec"]["strategy"] == own
