"""GPU-model alternatives: ``spec.devices.products`` (issue 39 part 2), parsed, screened, explained."""

from __future__ import annotations

from controller import allocator, asks, explaining
from gpualloc.api import codecs, models

V100_16 = "Tesla V100-SXM2-16GB"
V100_32 = "Tesla V100-SXM2-32GB"


def _view(name: str, product: str, n: int = 2) -> allocator.NodeView:
    devices = tuple(
        models.Device(index=i, minor=i, uuid=f"GPU-{name}-{i}", product=product, memory_mib=16384)
        for i in range(n)
    )
    return allocator.NodeView(
        name=name,
        labels={},
        unschedulable=False,
        node_present=True,
        ready=True,
        inventory=models.NodeInventory(devices=devices, total=n, product=product),
        taken=frozenset(),
    )


def _claim(*, product: str | None = None, products: tuple[str, ...] = (), count: int = 1) -> models.GpuClaim:
    return models.GpuClaim(
        metadata=models.ObjectMeta(name="c", namespace="ns"),
        spec=models.GpuClaimSpec(
            devices=models.DeviceRequest(count=count, product=product, products=products)
        ),
    )


def test_a_gpu_matching_any_alternative_will_do_and_no_other() -> None:
    views = [_view("a-t4", "Tesla T4"), _view("b-v100", V100_32), _view("c-p100", "Tesla P100")]
    decision = allocator.allocate(_claim(products=(V100_16, V100_32)), views)
    assert [a.node_name for a in decision.allocations] == ["b-v100"]
    globbed = allocator.allocate(_claim(products=("Tesla P1*", "NVIDIA A100*"), count=2), views)
    assert [a.node_name for a in globbed.allocations] == ["c-p100"]


def test_the_reason_and_explain_name_each_alternative() -> None:
    claim = _claim(products=(V100_16, V100_32))
    decision = allocator.allocate(claim, [_view("a-t4", "Tesla T4")], explain=True)
    assert not decision.ok
    named = f'product "{V100_16}" or "{V100_32}"'
    assert named in decision.reason
    assert "2 not matching" in decision.per_node["a-t4"]
    assert named in explaining.describe_request(claim)


def test_product_and_products_together_are_refused_with_the_reason() -> None:
    ask = asks.parse(_claim(product=V100_16, products=(V100_32,)))
    assert ask == "product and products both name accepted products; set one"


def test_products_decode_from_the_claims_json() -> None:
    raw = {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"count": 1, "products": [V100_16, V100_32]}},
    }
    claim = codecs.parse_claim(raw)
    assert claim.spec.devices.products == (V100_16, V100_32)
    assert codecs.encode(claim.spec.devices)["products"] == [V100_16, V100_32]
