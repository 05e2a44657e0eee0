"""The chart's dra value (issue 42 part 2): gpualloc as the DRA driver of its own allocations."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from gpualloc.api import constants
from tests.unit.test_chart_render import CHART, FULLNAME, NAMESPACE, _expand, _rules_of, _run, one, render

RESOURCE_V1 = "resource.k8s.io/v1"
Obj = dict[str, Any]


def workload(objs: list[Obj], kind: str, component: str) -> Obj:
    spec: Obj = one(objs, kind, f"{FULLNAME}-{component}")["spec"]["template"]["spec"]
    return spec


def args_of(objs: list[Obj], kind: str, component: str) -> list[str]:
    spec = workload(objs, kind, component)
    args: list[str] = spec["containers"][0]["args"]
    return args


def dra_on(objs: list[Obj]) -> bool:
    return any(o["kind"] == "DeviceClass" for o in objs)


@pytest.mark.parametrize(
    ("api_versions", "values", "on"),
    [
        ((RESOURCE_V1,), {}, True),
        ((RESOURCE_V1,), {"dra__enabled": "false"}, False),
        ((), {"dra__enabled": "true"}, True),
    ],
    ids=["auto-served", "false", "true"],
)
def test_dra_is_on_where_resource_v1_is_served_unless_the_value_says(
    api_versions: tuple[str, ...], values: dict[str, str], on: bool
) -> None:
    objs = render(*api_versions, **values)
    assert dra_on(objs) is on
    assert ("--dra" in args_of(objs, "Deployment", "controller")) is on
    assert ("--dra" in args_of(objs, "Deployment", "webhook")) is on
    assert ("--kubelet-plugin" in args_of(objs, "DaemonSet", "agent")) is on
    rule = ("*", "resource.k8s.io", "resourceclaims", "get", ())
    assert (rule in _rules_of(objs, "agent")) is on
    assert (rule in _rules_of(objs, "controller")) is on


def test_the_device_class_selects_the_drivers_devices_and_a_second_release_can_leave_it_out() -> None:
    assert not dra_on(render(RESOURCE_V1, dra__createDeviceClass="false"))
    device_class = one(render(RESOURCE_V1), "DeviceClass", constants.DRA_DRIVER)
    assert device_class["apiVersion"] == RESOURCE_V1
    assert device_class["spec"] == {
        "selectors": [{"cel": {"expression": 'device.driver == "gpu.gpualloc.dev"'}}]
    }


def test_with_dra_the_controller_writes_resourceclaims_and_their_status_and_the_agent_only_reads_them() -> (
    None
):
    objs = render(RESOURCE_V1)
    verbs = ("get", "list", "watch", "create", "update", "patch", "delete")
    for resource in ("resourceclaims", "resourceclaims/status"):
        for verb in verbs:
            assert ("*", "resource.k8s.io", resource, verb, ()) in _rules_of(objs, "controller")
    agent = {rule for rule in _rules_of(objs, "agent") if rule[1] == "resource.k8s.io"}
    assert agent == {("*", "resource.k8s.io", "resourceclaims", "get", ())}
    assert not any(rule[1] == "resource.k8s.io" for rule in _rules_of(objs, "webhook"))


def test_with_dra_the_agent_is_root_and_mounts_the_kubelet_plugin_directories_and_cdi() -> None:
    spec = workload(render(RESOURCE_V1, dra__kubeletRoot="/var/lib/k0s/kubelet"), "DaemonSet", "agent")
    container = spec["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["plugins-registry"] == "/var/lib/k0s/kubelet/plugins_registry"
    assert mounts["plugin-dir"] == "/var/lib/k0s/kubelet/plugins/gpu.gpualloc.dev"
    assert mounts["cdi"] == "/var/run/cdi"
    paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert paths["plugins-registry"] == mounts["plugins-registry"]
    assert paths["plugin-dir"] == mounts["plugin-dir"]
    assert paths["cdi"] == "/var/run/cdi"
    assert container["securityContext"]["runAsUser"] == 0
    assert container["securityContext"]["runAsNonRoot"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    off = workload(render(dra__enabled="false"), "DaemonSet", "agent")["containers"][0]
    assert off["securityContext"]["runAsNonRoot"] is True
    assert not any(m["name"] in mounts for m in off["volumeMounts"] if m["name"] != "tmp")


@pytest.mark.parametrize(
    ("kind", "component", "module"),
    [
        ("Deployment", "controller", "controller.main"),
        ("Deployment", "webhook", "webhook.main"),
        ("DaemonSet", "agent", "agent.main"),
    ],
)
def test_each_component_parses_the_dra_flags_the_chart_gives_it(
    kind: str, component: str, module: str
) -> None:
    objs = render(RESOURCE_V1, certManager__enabled="false", agent__source="simulated", dra__cdiMode="nvidia")
    env = {"NODE_NAME": "gpu-node-1", "POD_NAMESPACE": NAMESPACE, "POD_NAME": f"{component}-0"}
    args = [_expand(a, env) for a in args_of(objs, kind, component)]
    parsed = importlib.import_module(module).build_parser().parse_args(args[1:])
    if component == "agent":
        assert parsed.kubelet_plugin is True
        assert (parsed.kubelet_root, parsed.cdi_mode, parsed.cdi_dir) == (
            "/var/lib/kubelet",
            "nvidia",
            "/var/run/cdi",
        )
    else:
        assert parsed.dra is True


def test_the_values_schema_refuses_an_unknown_dra_mode() -> None:
    result = _run("template", "x", str(CHART), "--set", "dra.enabled=sometimes")
    assert result.returncode != 0
    assert "dra" in result.stderr
