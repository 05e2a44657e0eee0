"""The Helm chart, rendered by the real ``helm`` binary and checked object by object.

``helm lint --strict`` and ``helm template`` run for both TLS modes (cert-manager and
the certs hook Job). The assertions are about what the chart promises: the webhook
fails closed for claim pods only, every container runs locked down with resources,
the replicated parts have two replicas and a PodDisruptionBudget, every component's
RBAC is exactly what it needs, and values.schema.json catches a typo.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpualloc.api import constants
from gpualloc.devcluster import binaries

CHART = Path(__file__).resolve().parents[2] / "helm" / "gpualloc"
RELEASE = "ga"
NAMESPACE = "gpu-system"
HEARTBEATS = f"{NAMESPACE}-heartbeats"
KUBE_VERSION = "1.36.0"  # the API server the e2e tests run
FULLNAME = f"{RELEASE}-gpualloc"
CLAIM_CONDITION = "has(object.metadata.annotations) && 'gpu.scheduling/claim' in object.metadata.annotations"

Obj = dict[str, Any]


@functools.cache
def _helm() -> str:
    try:
        return str(binaries.ensure(["helm"], progress=lambda _: None)["helm"])
    except binaries.BuildError as exc:
        if shutil.which("go") is None:
            pytest.skip(f"helm is not built and there is no Go toolchain to build it: {exc}")
        raise


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=120, check=False)


def _set_args(values: dict[str, str]) -> list[str]:
    out: list[str] = []
    for key, value in values.items():
        out += ["--set", f"{key}={value}"]
    return out


@functools.cache
def _render_cached(
    values: tuple[tuple[str, str], ...], api_versions: tuple[str, ...] = ()
) -> tuple[Obj, ...]:
    result = _run(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        *[arg for version in api_versions for arg in ("--api-versions", version)],
        *_set_args(dict(values)),
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(*api_versions: str, **values: str) -> list[Obj]:
    """Render the chart with ``--set key=value`` for each keyword (dots spelled as __), and
    ``--api-versions`` for each positional argument (what the API server would say it serves)."""
    flat = tuple(sorted((key.replace("__", "."), value) for key, value in values.items()))
    return list(_render_cached(flat, api_versions))


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def denying_policy(objs: list[Obj], name: str) -> Obj:
    """The spec of ValidatingAdmissionPolicy ``name``, once checked to fail closed and to be bound,
    under its own name, to deny."""
    binding = one(objs, "ValidatingAdmissionPolicyBinding", name)["spec"]
    assert binding == {"policyName": name, "validationActions": ["Deny"]}
    policy: Obj = one(objs, "ValidatingAdmissionPolicy", name)["spec"]
    assert policy["failurePolicy"] == "Fail"
    return policy


def kinds(objs: list[Obj]) -> set[str]:
    return {o["kind"] for o in objs}


def pod_specs(objs: list[Obj]) -> Iterator[tuple[str, Obj]]:
    for o in objs:
        if o["kind"] in ("Deployment", "DaemonSet", "Job", "StatefulSet"):
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"]


def containers(spec: Obj) -> list[Obj]:
    return [*spec.get("initContainers", []), *spec["containers"]]


BOTH_MODES = pytest.mark.parametrize("cert_manager", ["true", "false"], ids=["cert-manager", "certs-job"])


# ----------------------------------------------------------------------------- lint, schema


@BOTH_MODES
def test_helm_lint_strict_passes(cert_manager: str) -> None:
    result = _run(
        "lint",
        "--strict",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        "--set",
        f"certManager.enabled={cert_manager}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("webhook.pendingMod=gate", "additional properties 'pendingMod' not allowed"),
        ("agnet.source=nvml", "additional properties 'agnet' not allowed"),
        ("certManager.enable=false", "additional properties 'enable' not allowed"),
        ("webhook.pendingMode=maybe", "value must be one of"),
        ("webhook.deviceIds=minor", "value must be one of"),
        ("agent.source=fake", "value must be one of"),
        ("agent.nvmlAccess=devices", "value must be one of"),
        ("isolation.mutatingAdmissionPolicy=yes", "value must be one of"),
        ("isolation.exemptNamespace={a}", "additional properties 'exemptNamespace' not allowed"),
        ("isolation.exemptNamespaces={Not_A_Namespace}", "does not match pattern"),
    ],
)
def test_values_schema_rejects_typos_unknown_enum_values_and_malformed_namespace_names(
    setting: str, message: str
) -> None:
    result = _run("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, "--set", setting)
    assert result.returncode != 0
    assert "schema" in result.stderr
    assert message in result.stderr


def test_values_schema_requires_limits_on_every_component() -> None:
    result = _run(
        "template",
        RELEASE,
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        "--set",
        "controller.resources.limits=null",
    )
    assert result.returncode != 0
    assert "missing property 'limits'" in result.stderr


def test_chart_refuses_a_kubernetes_older_than_1_30() -> None:
    result = _run("template", RELEASE, str(CHART), "--kube-version", "1.29.5")
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr


def test_the_built_helm_renders_the_chart_offline_without_being_told_a_kubernetes_version() -> None:
    # The dev build sets helm's default Kubernetes version to the control plane's (1.36), as
    # helm's release builds do; left at helm's source default (1.20) it would refuse the chart.
    result = _run("template", RELEASE, str(CHART))
    assert result.returncode == 0, result.stderr
    assert any(doc and doc["kind"] == "Deployment" for doc in yaml.safe_load_all(result.stdout))


def test_chart_metadata_and_the_crds_ship_in_crds_dir() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == "0.1.0"
    assert chart["kubeVersion"] == ">=1.30.0-0"
    crds = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in (CHART / "crds").glob("*.yaml")}
    assert crds == {"gpuclaims.gpu.scheduling", "gpunodestatuses.gpu.scheduling", "gpuquotas.gpu.scheduling"}
    # helm template leaves crds/ out unless asked: the CRDs are not templated objects.
    assert "CustomResourceDefinition" not in kinds(render())


# ----------------------------------------------------------------------------- webhook config


@BOTH_MODES
def test_mutating_webhook_fails_closed_for_claim_pods_only(cert_manager: str) -> None:
    objs = render(certManager__enabled=cert_manager)
    mwc = one(objs, "MutatingWebhookConfiguration", FULLNAME)
    (hook,) = mwc["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["matchConditions"] == [{"name": "has-claim-annotation", "expression": CLAIM_CONDITION}]
    assert hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["timeoutSeconds"] == 5
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert "objectSelector" not in hook
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    (expr,) = hook["namespaceSelector"]["matchExpressions"]
    assert expr["key"] == "kubernetes.io/metadata.name"
    assert expr["operator"] == "NotIn"
    assert set(expr["values"]) == {"kube-system", NAMESPACE}
    service = hook["clientConfig"]["service"]
    svc = one(objs, "Service", service["name"])
    assert service["namespace"] == NAMESPACE
    assert service["port"] == 443
    assert svc["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}]


def test_extra_excluded_namespaces_join_kube_system_and_the_release_namespace() -> None:
    objs = render(**{"webhook.excludeNamespaces[0]": "batch-infra"})
    (expr,) = one(objs, "MutatingWebhookConfiguration", FULLNAME)["webhooks"][0]["namespaceSelector"][
        "matchExpressions"
    ]
    assert set(expr["values"]) == {"kube-system", NAMESPACE, "batch-infra"}


def test_cert_manager_mode_injects_the_ca_of_the_serving_certificate_the_webhook_mounts() -> None:
    objs = render(certManager__enabled="true")
    mwc = one(objs, "MutatingWebhookConfiguration", FULLNAME)
    ns, cert_name = mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].split("/")
    assert ns == NAMESPACE
    cert = one(objs, "Certificate", cert_name)
    webhook = one(objs, "Deployment", f"{FULLNAME}-webhook")
    (tls,) = [v for v in webhook["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert cert["spec"]["secretName"] == tls["secret"]["secretName"]
    assert f"{FULLNAME}-webhook.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    assert "server auth" in cert["spec"]["usages"]
    # The self-signed CA chain: selfsigned Issuer -> CA Certificate -> CA Issuer -> serving cert.
    issuer = one(objs, "Issuer", cert["spec"]["issuerRef"]["name"])
    ca_cert = next(o for o in objs if o["kind"] == "Certificate" and o["spec"].get("isCA"))
    assert issuer["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
    assert "selfSigned" in one(objs, "Issuer", ca_cert["spec"]["issuerRef"]["name"])["spec"]
    assert "Job" not in kinds(objs)


def test_cert_manager_issuer_override_replaces_the_self_signed_chain() -> None:
    objs = render(certManager__issuerRef__name="corp-ca", certManager__issuerRef__kind="ClusterIssuer")
    assert "Issuer" not in kinds(objs)
    (cert,) = [o for o in objs if o["kind"] == "Certificate"]
    assert cert["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }


def test_certs_job_mode_makes_the_secret_before_and_patches_the_config_after_install() -> None:
    objs = render(certManager__enabled="false")
    assert not {"Certificate", "Issuer"} & kinds(objs)
    assert "annotations" not in one(objs, "MutatingWebhookConfiguration", FULLNAME)["metadata"]
    job = one(objs, "Job", f"{FULLNAME}-certs")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {
        "pre-install",
        "pre-upgrade",
        "post-install",
        "post-upgrade",
    }
    assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {
        "before-hook-creation",
        "hook-succeeded",
    }
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "certs"
    webhook = one(objs, "Deployment", f"{FULLNAME}-webhook")
    (tls,) = [v for v in webhook["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert f"--service={FULLNAME}-webhook" in args
    assert f"--namespace={NAMESPACE}" in args
    assert f"--secret={tls['secret']['secretName']}" in args
    assert f"--webhook-config={FULLNAME}" in args
    # Its ServiceAccount and RBAC are hooks of the same phases that run before the Job.
    job_weight = int(annotations["helm.sh/hook-weight"])
    sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        obj = one(objs, kind, sa)
        assert obj["metadata"]["annotations"]["helm.sh/hook"] == annotations["helm.sh/hook"]
        assert int(obj["metadata"]["annotations"]["helm.sh/hook-weight"]) < job_weight


# ----------------------------------------------------------------------------- pods


@BOTH_MODES
def test_every_pod_runs_non_root_read_only_without_privilege(cert_manager: str) -> None:
    objs = render(
        certManager__enabled=cert_manager, dra__enabled="false"
    )  # dra: tests/unit/test_chart_dra.py
    specs = dict(pod_specs(objs))
    assert len(specs) == (3 if cert_manager == "true" else 4)
    for where, spec in specs.items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, where
        assert pod["runAsUser"] == 65532, where
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for c in containers(spec):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["runAsNonRoot"] is True, where
            assert not sc.get("privileged"), where
            assert "hostPath" not in json.dumps(spec.get("volumes", [])), where
            assert spec.get("hostNetwork") is not True and spec.get("hostPID") is not True, where


@BOTH_MODES
def test_every_container_has_resource_requests_and_limits(cert_manager: str) -> None:
    for where, spec in pod_specs(render(certManager__enabled=cert_manager)):
        for c in containers(spec):
            resources = c["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), where
            assert {"cpu", "memory"} <= set(resources["limits"]), where


def test_controller_and_webhook_run_two_replicas_with_disruption_budgets() -> None:
    objs = render()
    for component in ("controller", "webhook"):
        deployment = one(objs, "Deployment", f"{FULLNAME}-{component}")
        assert deployment["spec"]["replicas"] == 2
        pdb = one(objs, "PodDisruptionBudget", f"{FULLNAME}-{component}")
        assert pdb["spec"]["minAvailable"] == 1
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    controller = one(objs, "Deployment", f"{FULLNAME}-controller")
    assert "--leader-elect=true" in controller["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("interval", "stale_after"), [(None, "120"), ("10", "120"), ("300", "1200")])
def test_controller_counts_a_node_stale_after_four_of_the_agents_heartbeat_intervals(
    interval: str | None, stale_after: str
) -> None:
    objs = render(**({"agent__heartbeatInterval": interval} if interval else {}))
    controller = one(objs, "Deployment", f"{FULLNAME}-controller")
    args = controller["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--node-stale-after={stale_after}" in args
    agent = one(objs, "DaemonSet", f"{FULLNAME}-agent")
    assert (
        f"--heartbeat-interval={interval or 30}" in agent["spec"]["template"]["spec"]["containers"][0]["args"]
    )


@pytest.mark.parametrize("value, namespace", [(None, HEARTBEATS), ("gpu-beats", "gpu-beats")])
def test_the_chart_makes_the_heartbeat_namespace_and_tells_the_agent_and_the_controller(
    value: str | None, namespace: str
) -> None:
    objs = render(**({"agent__heartbeatNamespace": value} if value else {}))
    made = one(objs, "Namespace", namespace)
    assert made["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for kind, name in (("DaemonSet", f"{FULLNAME}-agent"), ("Deployment", f"{FULLNAME}-controller")):
        args = one(objs, kind, name)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--heartbeat-namespace={namespace}" in args, kind


@pytest.mark.parametrize(
    "release_namespace, value, error",
    [
        (NAMESPACE, NAMESPACE, "must not be the release namespace"),
        ("n" * 53, "", "longer than 63 characters: set agent.heartbeatNamespace"),  # 53 + "-heartbeats"
    ],
)
def test_the_chart_refuses_a_heartbeat_namespace_that_is_the_device_lease_namespace_or_too_long(
    release_namespace: str, value: str, error: str
) -> None:
    result = _run(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        release_namespace,
        "--set",
        f"agent.heartbeatNamespace={value}",
    )
    assert result.returncode != 0
    assert error in result.stderr


def test_webhook_replicas_spread_over_nodes_and_probe_through_tls() -> None:
    objs = render()
    deployment = one(objs, "Deployment", f"{FULLNAME}-webhook")
    spec = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["selector"]["matchLabels"]
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == labels
    (anti,) = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == labels
    (c,) = spec["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["https"] == 8443
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    for flag in ("--tls-cert-file=/tls/tls.crt", "--tls-key-file=/tls/tls.key", "--port=8443"):
        assert flag in c["args"]
    assert "--pending=gate" in c["args"]  # the default: bench/pending_mode.py
    assert "--device-ids=uuid" in c["args"]
    assert (
        "--pending=deny"
        in one(render(webhook__pendingMode="deny"), "Deployment", f"{FULLNAME}-webhook")["spec"]["template"][
            "spec"
        ]["containers"][0]["args"]
    )


@BOTH_MODES
def test_webhook_mounts_only_the_serving_pair_never_the_ca_key(cert_manager: str) -> None:
    deployment = one(render(certManager__enabled=cert_manager), "Deployment", f"{FULLNAME}-webhook")
    (tls,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["items"] == [
        {"key": "tls.crt", "path": "tls.crt"},
        {"key": "tls.key", "path": "tls.key"},
    ]


def test_agent_runs_on_gpu_nodes_through_the_nvidia_runtime_by_default() -> None:
    ds = one(render(), "DaemonSet", f"{FULLNAME}-agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["runtimeClassName"] == "nvidia"
    (c,) = spec["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert "--node-name=$(NODE_NAME)" in c["args"]
    assert "--source=nvml" in c["args"]


def test_simulated_agent_needs_no_nvidia_runtime() -> None:
    ds = one(render(agent__source="simulated", agent__profile="dgx-h100"), "DaemonSet", f"{FULLNAME}-agent")
    spec = ds["spec"]["template"]["spec"]
    assert "runtimeClassName" not in spec
    (c,) = spec["containers"]
    assert not {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"} & {e["name"] for e in c["env"]}
    assert "--source=simulated" in c["args"]
    assert "--profile=dgx-h100" in c["args"]


def test_agent_host_paths_mode_is_privileged_and_mounts_only_libnvidia_ml() -> None:
    ds = one(render(agent__nvmlAccess="hostPaths", dra__enabled="false"), "DaemonSet", f"{FULLNAME}-agent")
    spec = ds["spec"]["template"]["spec"]
    assert "runtimeClassName" not in spec
    (c,) = spec["containers"]
    assert c["securityContext"]["privileged"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is True  # the API refuses privileged without it
    (volume,) = [v for v in spec["volumes"] if "hostPath" in v]
    assert volume["hostPath"] == {"path": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "type": "File"}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True


def test_agent_security_context_overrides_apply_to_the_agent_only_and_keep_the_other_keys() -> None:
    objs = render(
        agent__podSecurityContext__supplementalGroups="{44}",
        agent__securityContext__runAsUser="0",
        agent__securityContext__runAsNonRoot="false",
    )
    defaults = {(o["kind"], o["metadata"]["name"]): o for o in render()}
    agent = one(objs, "DaemonSet", f"{FULLNAME}-agent")["spec"]["template"]["spec"]
    assert agent["securityContext"]["supplementalGroups"] == [44]
    assert agent["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}  # a global key kept
    (c,) = agent["containers"]
    assert c["securityContext"]["runAsUser"] == 0
    assert c["securityContext"]["runAsNonRoot"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True  # a global key kept
    for o in objs:
        if o["kind"] == "Deployment":  # the controller and the webhook keep the global contexts
            before = defaults[("Deployment", o["metadata"]["name"])]["spec"]["template"]["spec"]
            after = o["spec"]["template"]["spec"]
            assert after["securityContext"] == before["securityContext"]
            assert [x["securityContext"] for x in after["containers"]] == [
                x["securityContext"] for x in before["containers"]
            ]
    # In hostPaths mode the override is kept under the privileged settings.
    host = one(
        render(agent__nvmlAccess="hostPaths", agent__securityContext__runAsUser="0"),
        "DaemonSet",
        f"{FULLNAME}-agent",
    )
    (c,) = host["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"]["privileged"] is True
    assert c["securityContext"]["runAsUser"] == 0


@BOTH_MODES
def test_every_service_selects_pods_the_chart_runs_and_a_named_port(cert_manager: str) -> None:
    objs = render(certManager__enabled=cert_manager)
    templates = [o["spec"]["template"] for o in objs if o["kind"] in ("Deployment", "DaemonSet")]
    services = [o for o in objs if o["kind"] == "Service"]
    assert len(services) == 4
    for svc in services:
        selector = svc["spec"]["selector"]
        matched = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
        assert len(matched) == 1, svc["metadata"]["name"]
        names = {p["name"] for c in matched[0]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, svc["metadata"]["name"]


# ----------------------------------------------------------------------------- RBAC


def _rules_of(objs: list[Obj], component: str) -> set[tuple[str, str, str, str, tuple[str, ...]]]:
    """(scope, apiGroup, resource, verb, resourceNames) granted to one component's ServiceAccount."""
    sa = f"{FULLNAME}-{component}"
    granted: set[tuple[str, str, str, str, tuple[str, ...]]] = set()
    for binding in objs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == NAMESPACE
            for s in binding["subjects"]
        ):
            continue
        ref = binding["roleRef"]
        role = one(objs, ref["kind"], ref["name"])
        scope = binding["metadata"]["namespace"] if binding["kind"] == "RoleBinding" else "*"
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((scope, group, resource, verb, tuple(rule.get("resourceNames", ()))))
    return granted


def _no_wildcards(granted: set[tuple[str, str, str, str, tuple[str, ...]]]) -> None:
    for _, group, resource, verb, _ in granted:
        assert "*" not in (group, resource, verb)


def test_webhook_may_only_read_claims() -> None:
    granted = _rules_of(render(), "webhook")
    assert granted == {("*", "gpu.scheduling", "gpuclaims", v, ()) for v in ("get", "list", "watch")}


def test_agent_may_write_node_statuses_and_heartbeat_leases_read_device_leases_and_nothing_secret() -> None:
    granted = _rules_of(render(dra__enabled="false"), "agent")  # dra: tests/unit/test_chart_dra.py
    _no_wildcards(granted)
    expected = {
        ("*", "gpu.scheduling", "gpunodestatuses", v, ())
        for v in ("get", "list", "watch", "create", "update", "patch")
    }
    expected |= {("*", "gpu.scheduling", "gpunodestatuses/status", v, ()) for v in ("get", "update", "patch")}
    expected |= {("*", "", "nodes", "get", ())}
    expected |= {(NAMESPACE, "coordination.k8s.io", "leases", v, ()) for v in ("list", "watch")}
    # Its heartbeat Lease, in a namespace where no device Lease is (not even get or list there).
    expected |= {
        (HEARTBEATS, "coordination.k8s.io", "leases", v, ()) for v in ("get", "create", "update", "patch")
    }
    audit = {("*", "", "pods", v, ()) for v in ("list", "watch")}  # the usage audit (default on)
    audit |= {("*", group, "events", "create", ()) for group in ("", "events.k8s.io")}
    assert granted == expected | audit
    assert not any(resource == "secrets" for _, _, resource, _, _ in granted)
    assert _rules_of(render(agent__processAudit__enabled="false", dra__enabled="false"), "agent") == expected


def test_the_agent_joins_the_hosts_pid_namespace_only_when_asked() -> None:
    def agent_pod(**values: str) -> dict[str, Any]:
        daemonset = next(o for o in render(**values) if o["kind"] == "DaemonSet")
        return dict(daemonset["spec"]["template"]["spec"])

    assert "hostPID" not in agent_pod()
    assert agent_pod(agent__processAudit__hostPID="true")["hostPID"] is True
    off = agent_pod(agent__processAudit__enabled="false", agent__processAudit__hostPID="true")
    assert "hostPID" not in off and "--no-process-audit" in off["containers"][0]["args"]


def test_agent_may_patch_nodes_only_when_node_labels_are_enabled() -> None:
    assert ("*", "", "nodes", "patch", ()) not in _rules_of(render(), "agent")
    assert ("*", "", "nodes", "patch", ()) in _rules_of(render(agent__nodeLabels__enabled="true"), "agent")


def test_controller_rbac_is_claims_inventory_events_and_leases_in_its_namespace() -> None:
    granted = _rules_of(render(dra__enabled="false"), "controller")  # dra: tests/unit/test_chart_dra.py
    _no_wildcards(granted)
    expected = {
        ("*", "gpu.scheduling", "gpuclaims", v, ()) for v in ("get", "list", "watch", "update", "patch")
    }
    expected |= {("*", "gpu.scheduling", "gpuclaims/status", v, ()) for v in ("get", "update", "patch")}
    expected |= {("*", "gpu.scheduling", "gpunodestatuses", v, ()) for v in ("get", "list", "watch")}
    expected |= {("*", "gpu.scheduling", "gpuquotas", v, ()) for v in ("get", "list", "watch")}
    expected |= {("*", "gpu.scheduling", "gpuquotas/status", v, ()) for v in ("get", "update", "patch")}
    expected |= {("*", "", "nodes", v, ()) for v in ("get", "list", "watch")}
    # patch: it lifts the scheduling gate the webhook holds every claim pod at.
    expected |= {("*", "", "pods", v, ()) for v in ("get", "list", "watch", "patch")}
    expected |= {("*", "batch", "jobs", "get", ()), ("*", "jobset.x-k8s.io", "jobsets", "get", ())}
    expected |= {("*", "", "pods/eviction", "create", ())}
    expected |= {("*", g, "events", v, ()) for g in ("", "events.k8s.io") for v in ("create", "patch")}
    expected |= {
        (NAMESPACE, "coordination.k8s.io", "leases", v, ())
        for v in ("get", "list", "watch", "create", "update", "patch", "delete")
    }
    expected |= {(HEARTBEATS, "coordination.k8s.io", "leases", v, ()) for v in ("list", "watch")}  # read only
    assert granted == expected
    # Leases only in its own namespace: a lock elsewhere locks nothing.
    assert not any(r == "leases" and scope == "*" for scope, _, r, _, _ in granted)


def _aggregated_into(objs: list[Obj], role: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the chart adds to one of Kubernetes' standard roles."""
    label = f"rbac.authorization.k8s.io/aggregate-to-{role}"
    return {
        (group, resource, verb)
        for o in objs
        if o["kind"] == "ClusterRole" and o["metadata"]["labels"].get(label) == "true"
        for rule in o["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_tenant_roles_write_claims_and_only_read_quotas() -> None:
    objs = render()
    read = {("gpu.scheduling", r, v) for r in ("gpuclaims", "gpuquotas") for v in ("get", "list", "watch")}
    write = {
        ("gpu.scheduling", "gpuclaims", v)
        for v in ("create", "delete", "deletecollection", "patch", "update")
    }
    assert _aggregated_into(objs, "view") == read
    assert _aggregated_into(objs, "edit") == read | write
    assert _aggregated_into(objs, "admin") == read | write
    # Quotas are the cluster admin's; statuses are the controller's; nothing else is granted.
    assert not any(r.endswith("/status") for _, r, _ in _aggregated_into(objs, "admin"))
    off = render(rbac__aggregateToTenantRoles="false")
    assert not [o for o in off if "aggregate-to-view" in str(o["metadata"].get("labels"))]


def test_nobody_but_admins_reads_the_gpu_inventory_unless_inventory_readers_names_them() -> None:
    assert not [o for o in render() if o["metadata"]["name"].endswith("-inventory-reader")]
    objs = render(
        **{
            "rbac__inventoryReaders[0]__kind": "Group",
            "rbac__inventoryReaders[0]__name": "system:authenticated",
            "rbac__inventoryReaders[0]__apiGroup": "rbac.authorization.k8s.io",
        }
    )
    role = one(objs, "ClusterRole", f"{FULLNAME}-inventory-reader")
    granted = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == {
        (g, r, v)
        for g, r in (("gpu.scheduling", "gpunodestatuses"), ("", "nodes"))
        for v in ("get", "list", "watch")
    }
    binding = one(objs, "ClusterRoleBinding", f"{FULLNAME}-inventory-reader")
    assert binding["subjects"] == [
        {"kind": "Group", "name": "system:authenticated", "apiGroup": "rbac.authorization.k8s.io"}
    ]


def test_pod_annotation_policy_exempts_only_the_controller_service_account_and_can_be_turned_off() -> None:
    objs = render()
    name = f"{RELEASE}-gpualloc-pod-annotations"
    policy = denying_policy(objs, name)
    assert policy["matchConstraints"]["resourceRules"][0]["operations"] == ["UPDATE"]
    controller = one(objs, "ServiceAccount", f"{RELEASE}-gpualloc-controller")["metadata"]["name"]
    exempt = [c["expression"] for c in policy["matchConditions"] if "userInfo" in c["expression"]]
    assert exempt == [f"request.userInfo.username != 'system:serviceaccount:{NAMESPACE}:{controller}'"]
    off = render(podAnnotationPolicy__enabled="false")
    assert not [o for o in off if o["metadata"]["name"] == name]


def test_only_the_controller_and_cluster_admins_may_remove_the_claim_finalizer_and_it_can_be_off() -> None:
    objs = render()
    name = f"{FULLNAME}-claim-finalizer-removal"
    policy = denying_policy(objs, name)
    # Every write of metadata (patch of any kind, apply, PUT) is an UPDATE of the main resource.
    assert policy["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": ["gpu.scheduling"],
            "apiVersions": ["*"],
            "operations": ["UPDATE"],
            "resources": ["gpuclaims"],
        }
    ]
    conditions = {c["name"]: c["expression"] for c in policy["matchConditions"]}
    assert "'gpu.scheduling/release-devices'" in conditions["had-the-finalizer"]
    controller = one(objs, "ServiceAccount", f"{FULLNAME}-controller")["metadata"]["name"]
    assert conditions["not-the-controller"] == (
        f"request.userInfo.username != 'system:serviceaccount:{NAMESPACE}:{controller}'"
    )
    assert "'system:masters'" in conditions["not-a-cluster-admin"]
    off = render(claimFinalizerRemovalPolicy__enabled="false")
    assert not [o for o in off if o["metadata"]["name"] == name]


def test_controller_honours_only_allowed_claim_tolerations_unless_told_any() -> None:
    def args(objs: list[Obj]) -> list[str]:
        spec = one(objs, "Deployment", f"{FULLNAME}-controller")["spec"]["template"]["spec"]
        (container,) = [c for c in spec["containers"] if c["name"] == "controller"]
        return [a for a in container["args"] if a.startswith("--claim-tolerations")]

    assert args(render()) == ["--claim-tolerations=Allowed"]
    assert args(render(controller__claimTolerations="Any")) == ["--claim-tolerations=Any"]
    refused = _run("template", RELEASE, str(CHART), "--set", "controller.claimTolerations=All")
    assert refused.returncode != 0
    assert "value must be one of" in refused.stderr


def test_certs_job_touches_only_its_secret_and_its_webhook_configuration() -> None:
    granted = _rules_of(render(certManager__enabled="false"), "certs")
    secret = (f"{FULLNAME}-webhook-tls",)
    expected = {(NAMESPACE, "", "secrets", "create", ())}
    expected |= {(NAMESPACE, "", "secrets", v, secret) for v in ("get", "update", "patch")}
    expected |= {
        ("*", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", v, (FULLNAME,))
        for v in ("get", "patch")
    }
    assert granted == expected


def test_every_component_has_its_own_service_account() -> None:
    objs = render()
    for where, spec in pod_specs(objs):
        component = where.rsplit("-", 1)[1]
        assert spec["serviceAccountName"] == f"{FULLNAME}-{component}"
        one(objs, "ServiceAccount", spec["serviceAccountName"])


# ----------------------------------------------------------------------------- observability


def _exported_metric_names() -> set[str]:
    """Every sample name the three components' /metrics can serve, from their own registries."""
    from agent import metrics as agent_metrics
    from controller import metrics as controller_metrics
    from webhook import metrics as webhook_metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: set[str] = set()
    for registry in (
        agent_metrics.AgentMetrics("node-1").registry,
        controller_metrics.Metrics().registry,
        webhook_metrics.Metrics().registry,
    ):
        for family in registry.collect():
            names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


def test_grafana_dashboard_queries_only_metrics_the_components_export() -> None:
    objs = render(grafana__dashboard__enabled="true")
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["gpualloc.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    queried = set(re.findall(r"gpualloc_[a-z_]+", exprs))
    exported = _exported_metric_names()
    assert queried <= exported, sorted(queried - exported)
    # allocations, failures, pending claims, devices by state, time to allocated, webhook outcomes and
    # latency, per-GPU utilisation, memory and health all have a panel
    for metric in (
        "gpualloc_claims_allocated_total",
        "gpualloc_allocation_failures_total",
        "gpualloc_pending_claims",
        "gpualloc_devices",
        "gpualloc_time_to_allocated_seconds_bucket",
        "gpualloc_webhook_admissions_total",
        "gpualloc_webhook_admission_duration_seconds_bucket",
        "gpualloc_gpu_utilization_percent",
        "gpualloc_gpu_memory_used_bytes",
        "gpualloc_gpu_health",
    ):
        assert metric in queried, metric
    assert "ConfigMap" not in kinds(render())


def test_service_monitor_scrapes_each_component_metrics_service() -> None:
    objs = render(metrics__serviceMonitor__enabled="true")
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    selector = sm["spec"]["selector"]["matchLabels"]
    selected = [
        o for o in objs if o["kind"] == "Service" and selector.items() <= o["metadata"]["labels"].items()
    ]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == {
        "agent",
        "controller",
        "webhook",
    }
    (endpoint,) = sm["spec"]["endpoints"]
    for svc in selected:
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert "ServiceMonitor" not in kinds(render())


# ----------------------------------------------------------------------------- flags vs programs


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args, from the container's plain and downward-API env."""
    for name, value in env.items():
        arg = arg.replace(f"$({name})", value)
    return arg


@pytest.mark.parametrize(
    ("workload", "container_name", "module"),
    [
        ("Deployment/controller", "controller", "controller.main"),
        ("Deployment/webhook", "webhook", "webhook.main"),
        ("DaemonSet/agent", "agent", "agent.main"),
        ("Job/certs", "certs", "certs.main"),
    ],
)
def test_each_component_parses_the_flags_the_chart_gives_it(
    workload: str, container_name: str, module: str
) -> None:
    """The rendered args go through the component's own argparse parser (a renamed flag fails here)."""
    import importlib

    objs = render(
        certManager__enabled="false",
        agent__nodeLabels__enabled="true",
        agent__source="simulated",
        agent__profile="x",
    )
    kind, component = workload.split("/")
    spec = one(objs, kind, f"{FULLNAME}-{component}")["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == container_name]
    env = {"NODE_NAME": "gpu-node-1", "POD_NAMESPACE": NAMESPACE, "POD_NAME": f"{component}-0"}
    args = [_expand(a, env) for a in container["args"]]
    assert args[0] == component
    parser = importlib.import_module(module).build_parser()
    parsed = parser.parse_args(args[1:])
    if component == "controller":
        assert parsed.namespace == NAMESPACE
        assert parsed.leader_elect is True
        assert parsed.metrics_port == 9400
    if component == "webhook":
        assert (parsed.port, parsed.pending, parsed.device_ids) == (8443, "gate", "uuid")
        assert parsed.tls_cert_file == "/tls/tls.crt"
    if component == "agent":
        assert parsed.node_name == "gpu-node-1"
        assert parsed.source == "simulated"


# ----------------------------------------------------------------------------- isolation policies

MAP_V1 = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"
NO_GPU = f"{FULLNAME}-no-gpu-without-claim"
POD_DEVICES = f"{FULLNAME}-pod-devices"
NODE_IDENTITY = f"{FULLNAME}-node-identity"
GATED_LABEL = f"{FULLNAME}-pod-gated-label"
QUOTA_PRIORITY = f"{FULLNAME}-quota-priority"
CLAIM_METADATA = f"{FULLNAME}-claim-metadata"


def named(objs: list[Obj], name: str) -> list[str]:
    """The kinds rendered under ``name``."""
    return sorted(o["kind"] for o in objs if o["metadata"]["name"] == name)


def _variables(policy: Obj) -> dict[str, str]:
    return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}


def test_mutating_policy_is_rendered_where_the_api_server_serves_it_and_the_validating_one_always() -> None:
    served = render(MAP_V1)
    assert named(served, NO_GPU) == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    assert named(served, POD_DEVICES) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    policy = one(served, "MutatingAdmissionPolicy", NO_GPU)
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert one(served, "MutatingAdmissionPolicyBinding", NO_GPU)["spec"] == {"policyName": NO_GPU}
    validating = one(served, "ValidatingAdmissionPolicyBinding", POD_DEVICES)
    assert validating["spec"] == {"policyName": POD_DEVICES, "validationActions": ["Deny"]}

    # An older API server (helm asks it: .Capabilities.APIVersions): no MutatingAdmissionPolicy,
    # the validating one still, and the NOTES warn (test_notes_warn_...).
    older = render()
    assert named(older, NO_GPU) == []
    assert named(older, POD_DEVICES) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    # always: rendered without asking (offline rendering for a 1.36 cluster); never: not rendered.
    assert "MutatingAdmissionPolicy" in named(render(isolation__mutatingAdmissionPolicy="always"), NO_GPU)
    assert named(render(MAP_V1, isolation__mutatingAdmissionPolicy="never"), NO_GPU) == []
    off = render(MAP_V1, isolation__enabled="false")
    assert named(off, NO_GPU) == [] and named(off, POD_DEVICES) == []


def test_isolation_policies_fail_closed_on_pods_and_ephemeral_containers_outside_exempt_namespaces() -> None:
    objs = render(MAP_V1)
    for kind, name in (("MutatingAdmissionPolicy", NO_GPU), ("ValidatingAdmissionPolicy", POD_DEVICES)):
        spec = one(objs, kind, name)["spec"]
        assert spec["failurePolicy"] == "Fail"
        constraints = spec["matchConstraints"]
        assert constraints["resourceRules"] == [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]},
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["UPDATE"],
                "resources": ["pods/ephemeralcontainers"],
            },
        ]
        (expression,) = constraints["namespaceSelector"]["matchExpressions"]
        assert expression == {
            "key": "kubernetes.io/metadata.name",
            "operator": "NotIn",
            "values": [NAMESPACE, "kube-system"],
        }
    mutating = one(objs, "MutatingAdmissionPolicy", NO_GPU)["spec"]
    assert mutating["reinvocationPolicy"] == "IfNeeded"
    (mutation,) = mutating["mutations"]
    assert mutation["patchType"] == "JSONPatch"
    patch = mutation["jsonPatch"]["expression"]
    for path in ("/spec/containers/", "/spec/initContainers/", "/spec/ephemeralContainers/"):
        assert f"path: '{path}' + string(i) + '/env'" in patch
    assert patch.count("{'name': 'NVIDIA_VISIBLE_DEVICES', 'value': 'void'}") == 9

    # The admin's namespaces join the release namespace; kube-system is a default, not a rule.
    listed = render(MAP_V1, **{"isolation.exemptNamespaces": "{gpu-operator}"})
    for kind, name in (("MutatingAdmissionPolicy", NO_GPU), ("ValidatingAdmissionPolicy", POD_DEVICES)):
        (expression,) = one(listed, kind, name)["spec"]["matchConstraints"]["namespaceSelector"][
            "matchExpressions"
        ]
        assert expression["values"] == [NAMESPACE, "gpu-operator"]


def test_device_plugin_and_dra_exemptions_come_from_values() -> None:
    default = _variables(one(render(MAP_V1), "MutatingAdmissionPolicy", NO_GPU))["pluginPod"]
    resources = (
        '(k in ["nvidia.com/gpu","nvidia.com/gpu.shared"] || ["nvidia.com/mig-"].exists(p, k.startsWith(p)))'
    )
    assert resources in default
    assert "isGreaterThan(quantity('0'))" in default  # a request of 0 GPUs exempts nothing
    assert "size(object.spec.?resourceClaims.orValue([])) > 0" in default
    custom = render(
        MAP_V1,
        **{
            "isolation.exemptResources": "{example.com/gpu,amd.com/*}",
            "isolation.exemptResourceClaims": "false",
        },
    )
    for kind, name in (("MutatingAdmissionPolicy", NO_GPU), ("ValidatingAdmissionPolicy", POD_DEVICES)):
        plugin = _variables(one(custom, kind, name))["pluginPod"]
        assert '(k in ["example.com/gpu"] || ["amd.com/"].exists(p, k.startsWith(p)))' in plugin
        assert "resourceClaims" not in plugin


def test_claim_pods_are_the_ones_the_webhook_is_called_for() -> None:
    claim = _variables(one(render(MAP_V1), "MutatingAdmissionPolicy", NO_GPU))["claimPod"]
    assert claim == (
        "has(object.metadata.annotations) && 'gpu.scheduling/claim' in object.metadata.annotations"
        f' && !(request.namespace in ["kube-system","{NAMESPACE}"])'
    )
    excluded = render(MAP_V1, **{"webhook.excludeNamespaces": "{batch}"})
    assert (
        '["kube-system","gpu-system","batch"]'
        in _variables(one(excluded, "MutatingAdmissionPolicy", NO_GPU))["claimPod"]
    )
    # Without the webhook nothing writes a claim pod's devices: the annotation exempts nothing.
    no_webhook = render(MAP_V1, webhook__enabled="false")
    for kind, name in (("MutatingAdmissionPolicy", NO_GPU), ("ValidatingAdmissionPolicy", POD_DEVICES)):
        assert _variables(one(no_webhook, kind, name))["claimPod"] == "false"


def test_pod_devices_policy_accepts_what_the_webhook_writes_in_each_device_id_mode() -> None:
    uuid = _variables(one(render(), "ValidatingAdmissionPolicy", POD_DEVICES))["claimBad"]
    assert "e.?value.orValue('') == variables.devices" in uuid
    assert (
        "e.?valueFrom.?fieldRef.?fieldPath.orValue('') == \"metadata.annotations['gpu.scheduling/devices']\""
        in uuid
    )
    assert "'all'" not in uuid
    index = _variables(one(render(webhook__deviceIds="index"), "ValidatingAdmissionPolicy", POD_DEVICES))[
        "claimBad"
    ]
    assert "e.?value.orValue('') == 'all'" in index
    assert "matches('^[0-9]+(,[0-9]+)*$')" in index
    messages = " ".join(
        v["messageExpression"]
        for v in one(render(), "ValidatingAdmissionPolicy", POD_DEVICES)["spec"]["validations"]
    )
    for words in (
        "gets no GPU",
        "GpuClaim",
        "device plugin",
        "ephemeral containers",
        "/var/run/nvidia-container-devices",
    ):
        assert words in messages


def test_node_identity_policy_binds_the_agent_to_its_own_node() -> None:
    objs = render()
    policy = denying_policy(objs, NODE_IDENTITY)
    assert policy["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": ["gpu.scheduling"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["gpunodestatuses", "gpunodestatuses/status"],
        },
        # The agent may write Leases only in the heartbeat namespace (RBAC): its own node's.
        {
            "apiGroups": ["coordination.k8s.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["leases"],
        },
    ]
    agent = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}-agent"
    assert policy["matchConditions"] == [
        {"name": "the-agent", "expression": f"request.userInfo.username == '{agent}'"}
    ]
    assert "authentication.kubernetes.io/node-name" in _variables({"spec": policy})["node"]
    checks = " ".join(v["expression"] for v in policy["validations"])
    assert "object.metadata.name == variables.node[0]" in checks
    assert "object.?spec.?nodeName.orValue('') == variables.node[0]" in checks
    # agent.nodeLabels grants patch nodes: the same check covers the Node it labels.
    labelled = one(render(agent__nodeLabels__enabled="true"), "ValidatingAdmissionPolicy", NODE_IDENTITY)
    assert labelled["spec"]["matchConstraints"]["resourceRules"][2] == {
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "operations": ["UPDATE"],
        "resources": ["nodes"],
    }
    assert named(render(nodeIdentityPolicy__enabled="false"), NODE_IDENTITY) == []
    assert named(render(agent__enabled="false"), NODE_IDENTITY) == []


def test_gated_label_policy_checks_creation_and_allows_only_removal() -> None:
    objs = render()
    policy = one(objs, "ValidatingAdmissionPolicy", GATED_LABEL)["spec"]
    assert one(objs, "ValidatingAdmissionPolicyBinding", GATED_LABEL)["spec"]["validationActions"] == ["Deny"]
    assert policy["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE", "UPDATE"]
    checks = " ".join(v["expression"] for v in policy["validations"])
    assert "g.name == 'gpu.scheduling/claim-allocated'" in checks
    assert "'gpu.scheduling/claim' in object.metadata" in checks
    assert named(render(gatedLabelPolicy__enabled="false"), GATED_LABEL) == []


def test_quota_priority_policy_takes_every_quota_of_the_claims_namespace_as_a_param() -> None:
    objs = render()
    policy = one(objs, "ValidatingAdmissionPolicy", QUOTA_PRIORITY)["spec"]
    binding = one(objs, "ValidatingAdmissionPolicyBinding", QUOTA_PRIORITY)["spec"]
    assert binding == {
        "policyName": QUOTA_PRIORITY,
        "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
        "validationActions": ["Deny"],
    }
    assert policy["failurePolicy"] == "Fail"
    assert policy["paramKind"] == {"apiVersion": "gpu.scheduling/v1", "kind": "GpuQuota"}
    assert policy["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": ["gpu.scheduling"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["gpuclaims"],
        }
    ]
    # An update that keeps the priority (a label, the controller's finalizer) is not checked.
    (condition,) = policy["matchConditions"]
    assert "oldObject.spec.?priority.orValue(0)" in condition["expression"]
    (check,) = policy["validations"]
    assert check["expression"] == (
        "!has(params.spec.maxPriority) || variables.priority <= params.spec.maxPriority"
    )
    assert "the maximum of namespace" in check["messageExpression"]
    assert named(render(quotaPriorityPolicy__enabled="false"), QUOTA_PRIORITY) == []


def test_claim_metadata_policy_fails_closed_on_every_claim_create_and_update_and_can_be_turned_off() -> None:
    objs = render()
    whole = one(objs, "ValidatingAdmissionPolicy", CLAIM_METADATA)
    policy = whole["spec"]
    binding = one(objs, "ValidatingAdmissionPolicyBinding", CLAIM_METADATA)["spec"]
    assert binding == {"policyName": CLAIM_METADATA, "validationActions": ["Deny"]}
    assert policy["failurePolicy"] == "Fail"
    assert "matchConditions" not in policy
    assert policy["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": ["gpu.scheduling"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["gpuclaims"],
        }
    ]
    assert f"'{constants.FINALIZER}'" in _variables(whole)["finalizers"]  # gpualloc's own does not count
    assert named(render(claimMetadataPolicy__enabled="false"), CLAIM_METADATA) == []


def test_node_status_crd_requires_the_name_to_be_the_node_name() -> None:
    crd = yaml.safe_load((CHART / "crds" / "gpunodestatuses.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    (rule,) = version["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert rule["rule"] == "self.metadata.name == self.spec.nodeName"
    assert "metadata.name must equal spec.nodeName" in rule["message"]


def _notes(tmp_path: Path, *args: str) -> str:
    """NOTES.txt as ``helm install`` would print it, rendered offline: a copy of the chart in
    which a ConfigMap renders NOTES.txt's text with ``tpl`` (``helm template`` leaves NOTES out)."""
    chart = tmp_path / "gpualloc"
    shutil.copytree(CHART, chart)
    (chart / "NOTES.copy").write_text((CHART / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ tpl (.Files.Get "NOTES.copy") . | toJson }}}\n'
    )
    result = _run(
        "template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
        "--show-only", "templates/notes-probe.yaml", *args,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes: str = yaml.safe_load(result.stdout)["data"]["notes"]
    return notes


def test_notes_warn_when_pods_without_a_claim_are_not_given_void(tmp_path: Path) -> None:
    assert "WARNING" not in _notes(tmp_path / "served", "--api-versions", MAP_V1)
    older = _notes(tmp_path / "older")
    assert "WARNING: pods without a GpuClaim are NOT given NVIDIA_VISIBLE_DEVICES=void" in older
    assert "does not\nserve admissionregistration.k8s.io/v1 MutatingAdmissionPolicy" in older
    assert f"{POD_DEVICES} still refuses" in older
    assert "Upgrade to Kubernetes 1.36" in older
    never = _notes(
        tmp_path / "never", "--api-versions", MAP_V1, "--set", "isolation.mutatingAdmissionPolicy=never"
    )
    assert 'isolation.mutatingAdmissionPolicy is "never"' in never
    off = _notes(tmp_path / "off", "--api-versions", MAP_V1, "--set", "isolation.enabled=false")
    assert "WARNING: isolation.enabled is false" in off


CLAIM_FINALIZER = f"{FULLNAME}-claim-finalizer"


def test_claim_finalizer_policy_is_rendered_where_mutating_admission_policies_are_served() -> None:
    served = render(MAP_V1)
    assert named(served, CLAIM_FINALIZER) == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    policy = one(served, "MutatingAdmissionPolicy", CLAIM_FINALIZER)
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    rule = {"apiGroups": ["gpu.scheduling"], "apiVersions": ["*"], "operations": ["CREATE"]}
    assert rules == [{**rule, "resources": ["gpuclaims"]}]
    assert constants.FINALIZER in policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
    # Older API servers: the controller adds the finalizer itself.
    assert named(render(), CLAIM_FINALIZER) == []
    assert "MutatingAdmissionPolicy" in named(render(controller__finalizerPolicy="always"), CLAIM_FINALIZER)
    assert named(render(MAP_V1, controller__finalizerPolicy="never"), CLAIM_FINALIZER) == []
    assert named(render(MAP_V1, controller__enabled="false"), CLAIM_FINALIZER) == []


# ------------------------------------------------------------- packing.steerPodsWithoutClaim

STEER = f"{FULLNAME}-steer-pods-without-gpus"
FREE_GPUS_LABEL = f"{FULLNAME}-node-free-gpus-label"


def _controller_args(objs: list[Obj]) -> list[str]:
    spec = one(objs, "Deployment", f"{FULLNAME}-controller")["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "controller"]
    return list(container["args"])


def _steering_is_off(objs: list[Obj]) -> bool:
    return (
        named(objs, STEER) == []
        and named(objs, FREE_GPUS_LABEL) == []
        and "--label-free-gpus" not in _controller_args(objs)
        and ("*", "", "nodes", "patch", ()) not in _rules_of(objs, "controller")
    )


def test_steering_is_on_by_default_where_its_mutating_policy_is_served_and_off_elsewhere() -> None:
    served = render(MAP_V1)
    assert named(served, STEER) == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    assert named(served, FREE_GPUS_LABEL) != [] and "--label-free-gpus" in _controller_args(served)
    assert _steering_is_off(render()), "auto, and no MutatingAdmissionPolicy served: nothing of it"
    assert _steering_is_off(render(MAP_V1, isolation__mutatingAdmissionPolicy="never"))
    assert _steering_is_off(render(MAP_V1, packing__steerPodsWithoutClaim="false"))


def test_steering_labels_nodes_from_the_controller_which_may_change_only_those_labels() -> None:
    objs = render(MAP_V1, packing__steerPodsWithoutClaim="true")
    assert "--label-free-gpus" in _controller_args(objs)
    assert ("*", "", "nodes", "patch", ()) in _rules_of(objs, "controller")
    policy = denying_policy(objs, FREE_GPUS_LABEL)
    (rule,) = policy["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["nodes", "nodes/status"] and "UPDATE" in rule["operations"]
    controller = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}-controller"
    assert policy["matchConditions"] == [
        {"name": "the-controller", "expression": f"request.userInfo.username == '{controller}'"}
    ]
    only_labels, values, busy_values = (v["expression"] for v in policy["validations"])
    for kept in ("object.spec == oldObject.spec", "annotations", "finalizers", "ownerReferences"):
        assert kept in only_labels
    assert "k in ['gpu.scheduling/free-gpus', 'gpu.scheduling/busy'] ||" in only_labels
    assert "['true', 'shares', 'false']" in values
    assert "variables.labels['gpu.scheduling/busy'] in ['true', 'false']" in busy_values


def test_steering_appends_preferred_terms_to_pods_without_gpus_where_mutating_policies_are_served() -> None:
    objs = render(MAP_V1, packing__steerPodsWithoutClaim="true")
    assert named(objs, STEER) == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    assert one(objs, "MutatingAdmissionPolicyBinding", STEER)["spec"] == {"policyName": STEER}
    policy = one(objs, "MutatingAdmissionPolicy", STEER)
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Ignore", "a preference: a failure leaves the pod as it was"
    constraints = spec["matchConstraints"]
    assert constraints["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
    ]
    (expression,) = constraints["namespaceSelector"]["matchExpressions"]
    assert expression == {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": [NAMESPACE, "kube-system"],
    }
    variables = _variables(policy)
    isolation = _variables(one(objs, "MutatingAdmissionPolicy", NO_GPU))
    assert variables["claimPod"] == isolation["claimPod"] and variables["pluginPod"] == isolation["pluginPod"]
    assert "nodeName" in variables["steer"] and "!variables.steered" in variables["steer"]
    assert variables["terms"] == (
        "[{'weight': dyn(100), 'preference': dyn({'matchExpressions': [{'key':"
        " dyn('gpu.scheduling/free-gpus'), 'operator': dyn('NotIn'), 'values': dyn(['true'])}]})},"
        " {'weight': dyn(100), 'preference': dyn({'matchExpressions': [{'key':"
        " dyn('gpu.scheduling/free-gpus'), 'operator': dyn('NotIn'), 'values': dyn(['true', 'shares'])}]})},"
        " {'weight': dyn(80), 'preference': dyn({'matchExpressions': [{'key':"
        " dyn('gpu.scheduling/free-gpus'), 'operator': dyn('NotIn'), 'values': dyn(['true'])}, {'key':"
        " dyn('gpu.scheduling/busy'), 'operator': dyn('NotIn'), 'values': dyn(['false'])}]})}]"
    )
    (mutation,) = spec["mutations"]
    assert mutation["patchType"] == "JSONPatch"
    patch = mutation["jsonPatch"]["expression"]
    for path in (
        "/spec/affinity'",
        "/spec/affinity/nodeAffinity'",
        "/spec/affinity/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution'",
        "/spec/affinity/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution/-'",
    ):
        assert f"path: '{path}" in patch

    # Not served (and auto): only the controller's half; always: rendered; never: not.
    assert named(render(packing__steerPodsWithoutClaim="true"), STEER) == []
    always = render(packing__steerPodsWithoutClaim="true", isolation__mutatingAdmissionPolicy="always")
    assert "MutatingAdmissionPolicy" in named(always, STEER)
    never = render(MAP_V1, packing__steerPodsWithoutClaim="true", isolation__mutatingAdmissionPolicy="never")
    assert named(never, STEER) == [] and named(never, FREE_GPUS_LABEL) != []


def test_notes_warn_when_steering_is_on_but_its_mutating_policy_is_not_rendered(tmp_path: Path) -> None:
    on = ("--set", "packing.steerPodsWithoutClaim=true")
    assert "steerPodsWithoutClaim" not in _notes(tmp_path / "served", "--api-versions", MAP_V1, *on)
    assert "no pod is steered" in _notes(tmp_path / "older", *on)


DEFAULT_STRATEGY = f"{FULLNAME}-default-strategy"


def _default_strategy_patch(objs: list[Obj]) -> str:
    (mutation,) = one(objs, "MutatingAdmissionPolicy", DEFAULT_STRATEGY)["spec"]["mutations"]
    return str(mutation["jsonPatch"]["expression"])


def test_the_default_strategy_is_least_fragmentation_where_a_mutating_policy_is_served_else_binpack() -> None:
    assert "value: 'leastFragmentation'" in _default_strategy_patch(render(MAP_V1))
    assert named(render(), DEFAULT_STRATEGY) == [], "auto, not served: binpack, which needs no policy"
    assert named(render(MAP_V1, isolation__mutatingAdmissionPolicy="never"), DEFAULT_STRATEGY) == []


def test_binpack_as_the_default_strategy_renders_no_policy() -> None:
    assert named(render(MAP_V1, packing__defaultStrategy="binpack"), DEFAULT_STRATEGY) == []


def test_another_default_strategy_is_set_on_claims_created_without_one() -> None:
    objs = render(MAP_V1, packing__defaultStrategy="leastFragmentation")
    assert named(objs, DEFAULT_STRATEGY) == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    spec = one(objs, "MutatingAdmissionPolicy", DEFAULT_STRATEGY)["spec"]
    assert spec["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": ["gpu.scheduling"],
            "apiVersions": ["*"],
            "operations": ["CREATE"],
            "resources": ["gpuclaims"],
        }
    ], "CREATE only: an allocated claim's spec may not change"
    (mutation,) = spec["mutations"]
    assert mutation["jsonPatch"]["expression"] == (
        "has(object.spec.strategy) ? [] : "
        "[JSONPatch{op: 'add', path: '/spec/strategy', value: 'leastFragmentation'}]"
    )


def test_another_default_strategy_without_a_mutating_policy_fails_the_install() -> None:
    result = _run(
        "template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION,
        "--set", "packing.defaultStrategy=leastFragmentation",
    )  # fmt: skip
    assert result.returncode != 0
    assert "packing.defaultStrategy=leastFragmentation needs a MutatingAdmissionPolicy" in result.stderr
