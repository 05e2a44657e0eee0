"""Waking only the Pending claims a change can help, the count limit (maxClaims), and the queue's
order under a flood (``controller.waking``, ``State``, ``Controller._order``)."""

from __future__ import annotations

from typing import Any

from controller import queue as work_queue
from controller import running, settings, waking
from gpualloc.api import codecs, constants, models
from tests.simulation import model
from tests.unit.test_controller_pure import claim, inventory, state_on_fake_feeds, status, uuid


def claim_raw(
    namespace: str,
    name: str,
    *,
    count: int = 1,
    priority: int = 0,
    created: str = "2025-01-01T00:00:00Z",
    product: str | None = None,
    node_name: str | None = None,
    exclusivity: str = "Exclusive",
    allocations: tuple[models.Allocation, ...] = (),
) -> dict[str, Any]:
    base = claim(name, uid=f"uid-{namespace}-{name}", count=count, priority=priority, created=created)
    spec = models.GpuClaimSpec(
        devices=models.DeviceRequest(count=count, product=product, exclusivity=exclusivity),
        priority=priority,
        node_name=node_name,
    )
    phase = constants.PHASE_ALLOCATED if allocations else constants.PHASE_PENDING
    raw = codecs.encode(
        models.GpuClaim(
            metadata=base.metadata,
            spec=spec,
            status=models.GpuClaimStatus(phase=phase, allocations=allocations),
        )
    )
    raw["metadata"]["namespace"] = namespace
    return raw


class Woken(list[str]):
    def __call__(self, key: str) -> None:
        self.append(key)


def cluster_state(nodes: int = 2, gpus: int = 8) -> tuple[Any, dict[str, Any], Woken]:
    st, feeds = state_on_fake_feeds()
    woken = Woken()
    st.wake = woken
    for n in range(nodes):
        feeds["node_statuses"].put(codecs.encode(status(f"n{n}", inventory(n, gpus))))
    return st, feeds, woken


def put_claim(feeds: dict[str, Any], raw: dict[str, Any]) -> None:
    feeds["claims"].put(raw, key=f"{raw['metadata']['namespace']}/{raw['metadata']['name']}")


def lease_raw(node: int, index: int, holder: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": constants.lease_name(uuid(node, index)),
            "namespace": "gpualloc-system",
            "uid": f"lease-{node}-{index}",
            "labels": {constants.LABEL_NODE: f"n{node}"},
        },
        "spec": {"holderIdentity": holder},
    }


def quota_raw(namespace: str, max_claims: int | None, name: str = "q") -> dict[str, Any]:
    spec: dict[str, Any] = {"gpus": 1000}
    if max_claims is not None:
        spec["maxClaims"] = max_claims
    return {
        "apiVersion": constants.API_VERSION,
        "kind": "GpuQuota",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1"},
        "spec": spec,
    }


# ------------------------------------------------------------------ pure


def test_a_node_could_hold_a_need_by_its_healthy_whole_gpus_their_product_and_the_pin() -> None:
    cap = waking.capacity_of(status("n1", inventory(1, 8, unhealthy=(7,))))
    assert len(cap.whole) == 7 and not cap.partial
    assert cap.fits(waking.Need(exclusive=True, count=7), "n1")
    assert not cap.fits(waking.Need(exclusive=True, count=8), "n1"), "an unhealthy GPU is not capacity"
    assert not cap.fits(waking.Need(exclusive=True, count=64), "n1")
    assert not cap.fits(waking.Need(exclusive=True, count=1, node_name="n2"), "n1")
    assert cap.fits(waking.Need(exclusive=True, count=1, product="*"), "n1")
    assert not cap.fits(waking.Need(exclusive=True, count=1, product="*B200*"), "n1")
    assert not cap.fits(waking.Need(exclusive=False, count=0), "n1"), "no MIG or shared GPU there"
    assert waking.capacity_of(None) == waking.NO_CAPACITY


def test_ranks_order_a_namespaces_claims_by_creation_then_name() -> None:
    ranks = waking.Ranks()
    assert ranks.put("a/z", "2025-01-01T00:00:01Z") == 0
    assert ranks.put("a/b", "2025-01-01T00:00:02Z") == 1
    assert ranks.put("a/a", "2025-01-01T00:00:01Z") == 0, "same second: by name"
    assert ranks.put("b/x", "2024-01-01T00:00:00Z") == 0, "namespaces apart"
    assert [ranks.rank(k) for k in ("a/a", "a/z", "a/b")] == [0, 1, 2]
    assert ranks.keys("a", 1, 3) == ["a/z", "a/b"]
    assert ranks.remove("a/a") == 0 and ranks.rank("a/b") == 1 and ranks.count("a") == 2
    assert ranks.remove("a/a") is None


# ------------------------------------------------------------------ waking in State


def test_a_flood_that_fits_on_no_node_is_never_woken_by_capacity_while_a_small_claim_is() -> None:
    st, feeds, woken = cluster_state()
    holder = claim_raw("t", "holder", count=1, allocations=(model_alloc(0),))
    put_claim(feeds, holder)
    for i in range(300):
        put_claim(feeds, claim_raw("flood", f"f{i:03d}", count=64, priority=1))
    put_claim(feeds, claim_raw("victim", "v", count=1))
    flood = claim_raw("flood", "f000", count=64, priority=1)
    assert st.fits_nowhere(codecs.parse_claim(flood))
    assert not st.fits_nowhere(codecs.parse_claim(claim_raw("victim", "v")))
    woken.clear()
    feeds["leases"].put(lease_raw(0, 0, "uid-t-holder"), key="gpualloc-system/l0")
    feeds["leases"].delete("gpualloc-system/l0")  # capacity freed on n0
    assert [k for k in woken if k != "t/holder"] == ["victim/v"], "only the claim that could use n0"
    woken.clear()
    released = claim_raw("t", "holder", count=1)
    released["metadata"]["resourceVersion"] = "8"
    put_claim(feeds, released)  # gives its device back
    assert "victim/v" in woken and not any(k.startswith("flood/") for k in woken)
    woken.clear()
    feeds["node_statuses"].put(codecs.encode(status("n1", inventory(1, 8, unhealthy=(3,)))))
    assert woken == ["t/holder", "victim/v"], "a node that changed wakes only what it could hold"
    woken.clear()
    feeds["node_statuses"].put(codecs.encode(status("big", inventory(9, 64))))
    assert sorted(woken) == sorted([f"flood/f{i:03d}" for i in range(300)] + ["t/holder", "victim/v"])
    assert not st.fits_nowhere(codecs.parse_claim(flood)), "a 64-GPU node holds it"


def model_alloc(index: int) -> models.Allocation:
    return models.Allocation(
        replica=0, node_name="n0", devices=(models.DeviceRef(index=index, minor=index, uuid=uuid(0, index)),)
    )


def test_a_change_wakes_by_product_and_by_pin() -> None:
    _, feeds, woken = cluster_state()
    put_claim(feeds, claim_raw("a", "b200", product="*B200*"))
    put_claim(feeds, claim_raw("a", "pinned", node_name="n1"))
    put_claim(feeds, claim_raw("a", "any"))
    woken.clear()
    feeds["nodes"].put({"metadata": {"name": "n0"}})
    assert woken == ["a/any"]
    woken.clear()
    feeds["nodes"].put({"metadata": {"name": "n1"}})
    assert sorted(woken) == ["a/any", "a/pinned"]


def test_readiness_that_moves_wakes_what_the_node_could_hold() -> None:
    mono = [1000.0]
    st, feeds = state_on_fake_feeds(monotonic=lambda: mono[0])
    woken = Woken()
    st.wake = woken
    feeds["node_statuses"].put(codecs.encode(status("n0", inventory(0, 8))))
    put_claim(feeds, claim_raw("a", "small"))
    put_claim(feeds, claim_raw("a", "huge", count=64))
    woken.clear()
    mono[0] += 500
    st.refresh_readiness()
    assert woken == ["a/small"]


def test_claims_are_not_woken_once_allocated_or_deleted() -> None:
    _, feeds, woken = cluster_state()
    put_claim(feeds, claim_raw("a", "done", allocations=(model_alloc(1),)))
    put_claim(feeds, claim_raw("a", "gone"))
    feeds["claims"].delete("a/gone")
    woken.clear()
    feeds["nodes"].put({"metadata": {"name": "n0"}})
    assert woken == ["a/done"], "the allocated claim for its node, nothing pending"


# ------------------------------------------------------------------ maxClaims


def test_claims_beyond_max_claims_are_off_the_wait_list_and_the_next_comes_in_when_one_goes() -> None:
    st, feeds, woken = cluster_state()
    feeds["quotas"].put(quota_raw("t", 2), key="t/q")
    for i in range(5):
        put_claim(feeds, claim_raw("t", f"c{i}", created=f"2025-01-01T00:00:0{i}Z"))
    over = [k for k in (f"t/c{i}" for i in range(5)) if st.too_many_claims(st.claim(k))]
    assert over == ["t/c2", "t/c3", "t/c4"]
    message = st.too_many_claims(st.claim("t/c4"))
    assert "GpuQuota q allows 2" in message and "5 GpuClaims" in message
    woken.clear()
    feeds["nodes"].put({"metadata": {"name": "n0"}})
    assert sorted(woken) == ["t/c0", "t/c1"], "the claims over the limit are not woken by capacity"
    woken.clear()
    feeds["claims"].delete("t/c0")
    assert woken == ["t/c2", "t/c0"], "the next one comes inside the limit and is woken"
    assert st.too_many_claims(st.claim("t/c2")) is None
    woken.clear()
    feeds["quotas"].put(quota_raw("t", 3), key="t/q")
    assert "t/c3" in woken and "t/c4" not in woken
    woken.clear()
    feeds["quotas"].delete("t/q")
    assert "t/c4" in woken and st.too_many_claims(st.claim("t/c4")) is None


def test_an_older_claim_arriving_pushes_the_newest_out() -> None:
    st, feeds, woken = cluster_state()
    feeds["quotas"].put(quota_raw("t", 1), key="t/q")
    put_claim(feeds, claim_raw("t", "new", created="2025-01-01T00:00:05Z"))
    assert st.too_many_claims(st.claim("t/new")) is None
    put_claim(feeds, claim_raw("t", "old", created="2025-01-01T00:00:01Z"))  # restored from a backup
    assert st.too_many_claims(st.claim("t/new")) is not None
    woken.clear()
    feeds["nodes"].put({"metadata": {"name": "n0"}})
    assert woken == ["t/old"]


def test_a_capacity_event_costs_nothing_per_claim_over_the_limit() -> None:
    st, feeds, woken = cluster_state()
    feeds["quotas"].put(quota_raw("flood", 10), key="flood/q")
    for i in range(3000):
        stamp = f"2025-01-01T{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}Z"
        put_claim(feeds, claim_raw("flood", f"f{i:04d}", created=stamp))
    visited: list[str] = []
    helped_by = st._waitlist.helped_by

    def counting(node: str, capacity: waking.Capacity) -> list[str]:
        visited.extend(helped_by(node, capacity))
        return visited

    st._waitlist.helped_by = counting
    woken.clear()
    feeds["nodes"].put({"metadata": {"name": "n0"}})
    assert len(visited) == 10 and len(woken) == 10


# ------------------------------------------------------------------ the queue's order


def test_under_a_flood_the_other_namespaces_claim_goes_first() -> None:
    controller = running.Controller(
        object(),  # type: ignore[arg-type]  # nothing is called on it
        settings.Settings(namespace="gpu-system"),
        feeds={kind: model.SimFeed(kind) for kind in model.WATCHED},
    )
    feeds = controller.feeds
    feeds["node_statuses"].cache["n0"] = codecs.encode(status("n0", inventory(0, 8)))
    feeds["node_statuses"].on_event("ADDED", feeds["node_statuses"].cache["n0"])

    def add(raw: dict[str, Any]) -> str:
        key = f"{raw['metadata']['namespace']}/{raw['metadata']['name']}"
        feeds["claims"].cache[key] = raw
        feeds["claims"].on_event("ADDED", raw)
        return key

    for i in range(50):
        add(claim_raw("flood", f"huge{i:02d}", count=64, priority=1))  # fit nowhere: served last
        add(claim_raw("loud", f"small{i:02d}", count=1, priority=1))
    add(claim_raw("victim", "v", count=1, priority=1))
    queue = controller.queue
    assert len(queue) == 101
    first = [queue._pop() for _ in range(3)]
    assert first == ["loud/small00", "victim/v", "loud/small01"], "namespaces take turns in a priority"
    rest = [queue._pop() for _ in range(98)]
    assert all(k.startswith("loud/") for k in rest[:48]) and all(k.startswith("flood/") for k in rest[48:])


def test_the_rank_of_a_claim_over_max_claims_is_last() -> None:
    controller = running.Controller(
        object(),  # type: ignore[arg-type]
        settings.Settings(namespace="gpu-system"),
        feeds={kind: model.SimFeed(kind) for kind in model.WATCHED},
    )
    feeds = controller.feeds
    feeds["node_statuses"].cache["n0"] = codecs.encode(status("n0", inventory(0, 8)))
    feeds["node_statuses"].on_event("ADDED", feeds["node_statuses"].cache["n0"])
    quota = quota_raw("t", 1)
    feeds["quotas"].cache["t/q"] = quota
    feeds["quotas"].on_event("ADDED", quota)
    for i, priority in enumerate((0, 5)):
        raw = claim_raw("t", f"c{i}", priority=priority, created=f"2025-01-01T00:00:0{i}Z")
        feeds["claims"].cache[f"t/c{i}"] = raw
        feeds["claims"].on_event("ADDED", raw)
    assert controller._order("t/c1") > controller._order("t/c0"), "priority 5, but over the limit"
    assert isinstance(controller._order("t/c0"), work_queue.Rank)
