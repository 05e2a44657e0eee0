"""Topology derivation: every shipped profile, and the rules on hand-made facts."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import inventory, simulated
from gpualloc.api import codecs, constants, models

CRD = Path(__file__).resolve().parents[2] / "helm" / "gpualloc" / "crds" / "gpunodestatuses.yaml"


def _derive(profile: str, node: str = "gpu-node-1") -> models.NodeInventory:
    source = simulated.SimulatedSource(simulated.load_profile(profile), node)
    return inventory.derive(source.scan())


def _links(inv: models.NodeInventory) -> dict[tuple[int, int], models.Link]:
    return {(ln.a, ln.b): ln for ln in inv.links}


def _status_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return schema


def _check(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """A small structural check against the CRD's schema: types, enums, patterns, bounds, required."""
    problems: list[str] = []
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{path}: not an object"]
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{path}.{key}: required")
        props = schema.get("properties", {})
        for key, item in value.items():
            if key not in props:
                problems.append(f"{path}.{key}: not in the schema (would be pruned)")
            else:
                problems += _check(props[key], item, f"{path}.{key}")
    elif kind == "array":
        if not isinstance(value, list):
            return [f"{path}: not a list"]
        if len(value) > schema.get("maxItems", 1 << 30):
            problems.append(f"{path}: too many items")
        for i, item in enumerate(value):
            problems += _check(schema["items"], item, f"{path}[{i}]")
    elif kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{path}: not an integer"]
        if value < schema.get("minimum", -(1 << 62)) or value > schema.get("maximum", 1 << 62):
            problems.append(f"{path}: {value} out of bounds")
    elif kind == "string":
        if not isinstance(value, str):
            return [f"{path}: not a string"]
        if "pattern" in schema and not re.search(schema["pattern"], value):
            problems.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if "enum" in schema and value not in schema["enum"]:
            problems.append(f"{path}: {value!r} not in {schema['enum']}")
        if len(value) > schema.get("maxLength", 1 << 30):
            problems.append(f"{path}: too long")
    elif kind == "boolean" and not isinstance(value, bool):
        problems.append(f"{path}: not a boolean")
    return problems


# ------------------------------------------------------------------ profiles


def test_all_six_required_profiles_are_shipped() -> None:
    assert set(simulated.profile_names()) >= {
        "h100-sxm-8",
        "a100-sxm-8",
        "a100-pcie-4-nvlink",
        "pcie-8-bridged-nonadjacent",
        "consumer-8",
        "a100-mig",
    }


@pytest.mark.parametrize("profile", simulated.profile_names())
def test_every_profile_derives_a_schema_valid_status_with_one_link_per_pair(profile: str) -> None:
    inv = _derive(profile)
    n = len(inv.devices)
    assert [ln.a < ln.b for ln in inv.links] == [True] * len(inv.links)
    assert sorted(_links(inv)) == list(itertools.combinations(range(n), 2))
    assert inv.total == n and inv.healthy == n
    assert sorted(i for island in inv.islands for i in island) == list(range(n))  # a partition
    encoded = codecs.encode(inv)
    assert _check(_status_schema(), encoded, "status") == []


def test_h100_sxm_8_every_pair_is_nv18_at_900_in_one_island_on_two_numa_nodes() -> None:
    inv = _derive("h100-sxm-8")
    assert len(inv.links) == 28
    assert {(ln.type, ln.nvlinks, ln.bandwidth_gbps) for ln in inv.links} == {("NV18", 18, 900)}
    assert inv.islands == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert [d.numa_node for d in inv.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert inv.product == "8x NVIDIA H100 80GB HBM3"
    assert {d.compute_capability for d in inv.devices} == {"9.0"}
    assert inv.devices[0].pci_bus_id == "0000:1b:00.0"
    assert inv.cuda_version == "13.0"


def test_a100_sxm_8_every_pair_is_nv12_at_600_in_one_island() -> None:
    inv = _derive("a100-sxm-8")
    assert {(ln.type, ln.bandwidth_gbps) for ln in inv.links} == {("NV12", 600)}
    assert inv.islands == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert [d.numa_node for d in inv.devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a100_pcie_4_nvlink_bridges_0_1_and_2_3_with_sys_across() -> None:
    links = _links(_derive("a100-pcie-4-nvlink"))
    assert (links[(0, 1)].type, links[(0, 1)].bandwidth_gbps) == ("NV12", 600)
    assert (links[(2, 3)].type, links[(2, 3)].bandwidth_gbps) == ("NV12", 600)
    for pair in [(0, 2), (0, 3), (1, 2), (1, 3)]:
        # gen4 x16 is 64 GB/s; a cross-socket pair gets half.
        assert (links[pair].type, links[pair].nvlinks, links[pair].bandwidth_gbps) == ("SYS", 0, 32)
    assert _derive("a100-pcie-4-nvlink").islands == ((0, 1), (2, 3))


def test_nonadjacent_bridges_are_exactly_0_2_1_3_4_5_6_7() -> None:
    inv = _derive("pcie-8-bridged-nonadjacent")
    nvlinked = sorted((ln.a, ln.b) for ln in inv.links if ln.nvlinks)
    assert nvlinked == [(0, 2), (1, 3), (4, 5), (6, 7)]
    links = _links(inv)
    assert all(links[p].type == "NV12" and links[p].bandwidth_gbps == 600 for p in nvlinked)
    assert links[(0, 1)].type == "PIX"  # neighbours, same PCIe switch, but no bridge
    assert links[(0, 1)].bandwidth_gbps == 128  # gen5 x16
    assert links[(1, 2)].type == "NODE"
    assert (links[(3, 4)].type, links[(3, 4)].bandwidth_gbps) == ("SYS", 64)
    assert inv.islands == ((0, 2), (1, 3), (4, 5), (6, 7))


def test_consumer_8_has_no_nvlink_and_pix_node_sys_over_two_numa_nodes() -> None:
    inv = _derive("consumer-8")
    assert all(ln.nvlinks == 0 and not ln.type.startswith("NV") for ln in inv.links)
    links = _links(inv)
    assert (links[(0, 1)].type, links[(0, 1)].bandwidth_gbps) == ("PIX", 64)
    assert (links[(0, 2)].type, links[(0, 2)].bandwidth_gbps) == ("NODE", 64)
    assert (links[(0, 4)].type, links[(0, 4)].bandwidth_gbps) == ("SYS", 32)
    assert (links[(6, 7)].type, links[(5, 6)].type) == ("PIX", "NODE")
    assert {ln.type for ln in inv.links} == {"PIX", "NODE", "SYS"}
    assert [d.numa_node for d in inv.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert inv.islands == tuple((i,) for i in range(8))
    assert inv.product == "8x NVIDIA GeForce RTX 4090"


def test_a100_mig_publishes_mig_devices_with_mig_uuids_on_gpu_0_only() -> None:
    inv = _derive("a100-mig")
    mig = inv.devices[0].mig
    assert mig is not None and mig.enabled
    assert [m.profile for m in mig.devices] == ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]
    assert all(re.fullmatch(r"MIG-[0-9a-f-]{36}", m.uuid) for m in mig.devices)
    assert len({m.uuid for m in mig.devices}) == 4
    assert inv.devices[1].mig is None


def test_simulated_uuids_are_deterministic_per_node_and_distinct_across_nodes() -> None:
    pattern = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    a1 = [d.uuid for d in _derive("h100-sxm-8", "node-a").devices]
    a2 = [d.uuid for d in _derive("h100-sxm-8", "node-a").devices]
    b = [d.uuid for d in _derive("h100-sxm-8", "node-b").devices]
    assert a1 == a2
    assert not set(a1) & set(b)
    assert all(pattern.match(u) for u in a1 + b)


# ---------------------------------------------------------------- the rules


def _gpu(index: int, *links: inventory.NvLinkEndpoint, **kw: Any) -> inventory.DeviceFacts:
    return inventory.DeviceFacts(
        index=index,
        minor=index,
        uuid=f"GPU-00000000-0000-0000-0000-{index:012x}",
        pci_bus_id=f"0000:{index + 1:02x}:00.0",
        nvlinks=links,
        **kw,
    )


def _to_switch(
    link: int, switch: str, version: int = 6, remote_type: int | None = 2
) -> inventory.NvLinkEndpoint:
    return inventory.NvLinkEndpoint(
        link=link, active=True, remote_bus_id=switch, remote_type=remote_type, version=version
    )


def _to_gpu(link: int, peer: int, version: int = 5) -> inventory.NvLinkEndpoint:
    return inventory.NvLinkEndpoint(
        link=link, active=True, remote_bus_id=f"0000:{peer + 1:02x}:00.0", remote_type=0, version=version
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        ("00000000:DB:00.0", "0000:db:00.0"),
        (b"00000000:1B:00.0\x00", "0000:1b:00.0"),
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("00010000:0A:00.0", "00010000:0a:00.0"),  # a domain beyond 16 bits keeps 8 digits
        ("18:00.0", "0000:18:00.0"),
    ],
)
def test_normalize_bus_id_gives_the_sysfs_form(raw: str | bytes, expected: str) -> None:
    assert inventory.normalize_bus_id(raw) == expected


@pytest.mark.parametrize(("raw", "text"), [(13000, "13.0"), (12040, "12.4"), (12080, "12.8"), (0, "")])
def test_cuda_driver_version_integer_becomes_major_dot_minor(raw: int, text: str) -> None:
    assert inventory.cuda_version_text(raw) == text


@pytest.mark.parametrize(
    ("level", "kind"),
    [(0, "PIX"), (10, "PIX"), (20, "PXB"), (30, "PHB"), (40, "NODE"), (50, "SYS"), (99, "SYS")],
)
def test_common_ancestor_levels_map_to_nvidia_smi_link_types(level: int, kind: str) -> None:
    facts = inventory.NodeFacts(source="nvml", devices=(_gpu(0), _gpu(1)), common_ancestors={(0, 1): level})
    assert inventory.derive(facts).links[0].type == kind


def test_missing_common_ancestor_is_sys() -> None:
    facts = inventory.NodeFacts(source="nvml", devices=(_gpu(0), _gpu(1)))
    assert inventory.derive(facts).links[0].type == "SYS"


@pytest.mark.parametrize(
    ("version_enum", "per_link"), [(1, 40), (2, 50), (3, 50), (4, 50), (5, 50), (6, 50), (7, 100), (0, 50)]
)
def test_nvlink_bandwidth_per_link_follows_the_nvml_version_enum(version_enum: int, per_link: int) -> None:
    a = _gpu(0, *(_to_gpu(i, 1, version_enum) for i in range(4)))
    b = _gpu(1, *(_to_gpu(i, 0, version_enum) for i in range(4)))
    link = inventory.derive(inventory.NodeFacts(source="nvml", devices=(a, b))).links[0]
    assert (link.type, link.nvlinks, link.bandwidth_gbps) == ("NV4", 4, 4 * per_link)


def test_switch_pair_count_is_the_smaller_switch_link_count() -> None:
    a = _gpu(0, *(_to_switch(i, "0000:05:00.0") for i in range(18)))
    b = _gpu(1, *(_to_switch(i, "0000:05:00.0") for i in range(12)))
    link = inventory.derive(inventory.NodeFacts(source="nvml", devices=(a, b))).links[0]
    assert (link.type, link.bandwidth_gbps) == ("NV12", 600)


def test_switch_links_without_a_remote_type_are_recognised_by_a_foreign_bus_id() -> None:
    gpus = [
        _gpu(i, *(_to_switch(j, f"0000:c{j % 2}:00.0", remote_type=None) for j in range(18)))
        for i in range(4)
    ]
    inv = inventory.derive(inventory.NodeFacts(source="nvml", devices=tuple(gpus)))
    assert {ln.type for ln in inv.links} == {"NV18"}
    assert inv.islands == ((0, 1, 2, 3),)


def test_gpus_on_disjoint_switch_fabrics_are_not_nvlinked() -> None:
    gpus = [
        _gpu(0, *(_to_switch(j, "0000:a0:00.0") for j in range(4))),
        _gpu(1, *(_to_switch(j, "0000:a0:00.0") for j in range(4))),
        _gpu(2, *(_to_switch(j, "0000:b0:00.0") for j in range(4))),
        _gpu(3, *(_to_switch(j, "0000:b0:00.0") for j in range(4))),
    ]
    inv = inventory.derive(inventory.NodeFacts(source="nvml", devices=tuple(gpus)))
    assert inv.islands == ((0, 1), (2, 3))
    assert _links(inv)[(1, 2)].nvlinks == 0


def test_direct_links_counted_from_either_end_take_the_larger_count() -> None:
    a = _gpu(0, *(_to_gpu(i, 1) for i in range(4)))
    b = _gpu(1, *(_to_gpu(i, 0) for i in range(2)))  # two links unreadable on this side
    link = inventory.derive(inventory.NodeFacts(source="nvml", devices=(a, b))).links[0]
    assert link.type == "NV4"


def test_inactive_links_do_not_count() -> None:
    down = inventory.NvLinkEndpoint(link=2, active=False)
    a = _gpu(0, _to_gpu(0, 1), _to_gpu(1, 1), down)
    b = _gpu(1, _to_gpu(0, 0), _to_gpu(1, 0), down)
    assert inventory.derive(inventory.NodeFacts(source="nvml", devices=(a, b))).links[0].type == "NV2"


def test_unhealthy_marks_and_lost_devices_are_published_unhealthy_with_the_reason() -> None:
    facts = inventory.NodeFacts(
        source="nvml",
        devices=(_gpu(0), _gpu(1, lost="lost: GPU is lost"), _gpu(2)),
    )
    inv = inventory.derive(facts, unhealthy={_gpu(2).uuid: "XID 79"})
    assert [(d.health, d.health_reason) for d in inv.devices] == [
        (constants.HEALTHY, ""),
        (constants.UNHEALTHY, "lost: GPU is lost"),
        (constants.UNHEALTHY, "XID 79"),
    ]
    assert (inv.total, inv.healthy) == (3, 1)


def test_pcie_bandwidth_takes_the_slower_gpu_and_scales_with_width() -> None:
    a = _gpu(0, pcie_generation=5, pcie_width=16)
    b = _gpu(1, pcie_generation=4, pcie_width=8)
    facts = inventory.NodeFacts(source="nvml", devices=(a, b), common_ancestors={(0, 1): 10})
    assert inventory.derive(facts).links[0].bandwidth_gbps == 32
    assert inventory.pcie_gbps(3, 16) == 32
    assert inventory.pcie_gbps(0, 0) == 32  # unknown: gen3 x16


def test_product_summary_counts_each_product_in_index_order() -> None:
    devices = [
        models.Device(index=i, minor=i, uuid=f"u{i}", product=p)
        for i, p in enumerate(["A100", "A100", "H100", "A100"])
    ]
    assert inventory.product_summary(devices) == "3x A100, 1x H100"


def test_sharing_offers_every_gpu_not_in_mig_mode_and_counts_its_held_slots() -> None:
    source = simulated.SimulatedSource(simulated.load_profile("a100-mig"), "mig-node")
    offered = inventory.parse_sharing("MPS:3")
    assert offered == models.DeviceSharing(strategy="MPS", replicas=3)
    split, whole = inventory.derive(source.scan(), sharing=offered).devices
    assert split.sharing is None and not split.shared  # in MIG mode: its instances, never slots
    assert whole.sharing == offered and whole.shared
    assert whole.lock_ids == (whole.uuid, *(constants.slot_id(whole.uuid, k) for k in range(3)))
    held = {constants.slot_id(whole.uuid, 0), constants.slot_id(whole.uuid, 2)}
    inv = inventory.derive(source.scan(), sharing=offered, held=held)
    assert inv.devices[1].sharing == models.DeviceSharing(strategy="MPS", replicas=3, in_use=2)
    assert inv.allocated == 1


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("Fair:4", "sharing strategy 'Fair' is not one of TimeSlicing, MPS"),
        ("MPS", "sharing slots '' must be a number from 1 to 64"),
        ("TimeSlicing:0", "sharing slots '0' must be a number from 1 to 64"),
        ("TimeSlicing:65", "sharing slots '65' must be a number from 1 to 64"),
    ],
)
def test_a_wrong_sharing_setting_is_refused_saying_what_is_wrong(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        inventory.parse_sharing(text)
    assert inventory.parse_sharing("") is None


# ------------------------------------------------------------ MIG capabilities under /proc


def test_a_caps_access_file_gives_its_device_file_minor() -> None:
    text = "DeviceFileMinor: 12\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    assert inventory.parse_cap_access(text) == 12
    assert inventory.parse_cap_access("DeviceFileMode: 292\n") is None
    assert inventory.parse_cap_access("DeviceFileMinor: twelve\n") is None
    assert inventory.parse_cap_access("") is None


def test_mig_minors_parse_into_capability_names_and_skip_malformed_lines() -> None:
    text = "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\nbroken\ngpu0/gi2/access x\n"
    assert inventory.parse_mig_minors(text) == {
        "config": 1,
        "monitor": 2,
        "gpu0/gi1/access": 12,
        "gpu0/gi1/ci0/access": 13,
    }


def test_a_capabilitys_mig_minors_name_and_access_path_follow_the_drivers_layout() -> None:
    assert inventory.mig_cap_name(2, 5) == "gpu2/gi5/access"
    assert inventory.mig_cap_name(2, 5, 0) == "gpu2/gi5/ci0/access"
    assert inventory.mig_cap_access_path(2, 5) == "driver/nvidia/capabilities/gpu2/mig/gi5/access"
    assert inventory.mig_cap_access_path(2, 5, 1) == "driver/nvidia/capabilities/gpu2/mig/gi5/ci1/access"
