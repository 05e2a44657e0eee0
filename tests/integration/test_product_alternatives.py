"""``spec.devices.products`` (GPU-model alternatives, issue 39 part 2) as the real kube-apiserver
validates it, with the CRD in helm/gpualloc/crds/."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from gpualloc.api import codecs
from tests.conftest import generated_client
from tests.integration.test_crds import claim_body, create_claim, rejected, unique

V100_16 = "Tesla V100-SXM2-16GB"
V100_32 = "Tesla V100-SXM2-32GB"


@pytest.fixture
async def objects(kubeconfig: str) -> AsyncIterator[client.CustomObjectsApi]:
    async with await generated_client(kubeconfig) as api_client:
        yield client.CustomObjectsApi(api_client)


async def test_a_claim_with_alternatives_is_stored_and_decodes_with_each(
    objects: client.CustomObjectsApi, namespace: str
) -> None:
    spec = {"devices": {"count": 1, "products": [V100_16, V100_32]}}
    created = await create_claim(objects, namespace, claim_body(unique("alternatives"), spec))
    assert created["spec"]["devices"]["products"] == [V100_16, V100_32]
    assert codecs.parse_claim(created).spec.devices.products == (V100_16, V100_32)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (
            {"count": 1, "product": V100_16, "products": [V100_32]},
            "product and products both name accepted products; set one",
        ),
        ({"count": 1, "products": []}, "spec.devices.products"),
        ({"count": 1, "products": [V100_16, V100_16]}, "Duplicate value"),
        ({"count": 1, "products": [""]}, "spec.devices.products[0]"),
        ({"count": 1, "products": ["x" * 129]}, "spec.devices.products[0]"),
        ({"count": 1, "products": V100_16}, "spec.devices.products"),
    ],
    ids=["with-product", "empty", "duplicate", "empty-name", "too-long", "not-a-list"],
)
async def test_invalid_alternatives_are_rejected_with_422_naming_why(
    objects: client.CustomObjectsApi, namespace: str, devices: dict[str, Any], expected: str
) -> None:
    body = claim_body(unique("bad-alternatives"), {"devices": devices})
    status, message = await rejected(create_claim(objects, namespace, body))
    assert status == 422, message
    assert expected in message
