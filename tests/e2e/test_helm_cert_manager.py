"""The chart's cert-manager path with cert-manager's own code running: Issuers, Certificates, cainjector.

cert-manager publishes its CRDs in its Go module (``deploy/crds``) but not its programs:
the ``cmd/controller`` and ``cmd/cainjector`` modules are not on the Go proxy. So this
test builds a small Go program (below) from the published module
``github.com/cert-manager/cert-manager``: it runs that release's own certificate
controllers (trigger, key manager, request manager, issuing, readiness, revision
manager), the CertificateRequest approver, the selfSigned and CA issuers, and
cainjector's MutatingWebhookConfiguration reconciler. No ACME, Vault or Venafi issuer, no
webhook of cert-manager's own, no leader election. The build is cached in gpualloc's cache
directory (``~/.cache/gpualloc/test-programs``; a cold build takes minutes).

Proven: after ``helm install`` with ``certManager.enabled=true``, the chart's CA chain is
issued, the serving certificate has the Service's DNS names and is signed by the CA in
the Secret, cainjector writes that CA into the webhook configuration's ``caBundle``, and
``gpualloc webhook`` serving that Secret's pair passes TLS verification against the
injected ``caBundle`` for the Service's name.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import ssl
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from gpualloc.devcluster import binaries, cluster
from tests.conftest import wait_until
from tests.integration.tls_support import http_status

CHART = Path(__file__).resolve().parents[2] / "helm" / "gpualloc"
CERT_MANAGER_MODULE = "github.com/cert-manager/cert-manager"
CERT_MANAGER_VERSION = "v1.21.2"

MAIN_GO = r"""// A minimal cert-manager for verifying the gpualloc chart against a local kube-apiserver:
// the certificate controllers, the selfSigned and CA issuers, the approver, and cainjector
// for MutatingWebhookConfigurations, all from github.com/cert-manager/cert-manager's own
// packages (its cmd/ modules are not published to the Go proxy).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	admissionreg "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apiext "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/clientcmd"
	apireg "k8s.io/kube-aggregator/pkg/apis/apiregistration/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	cmapi "github.com/cert-manager/cert-manager/pkg/apis/certmanager/v1"
	controllerpkg "github.com/cert-manager/cert-manager/pkg/controller"
	"github.com/cert-manager/cert-manager/pkg/controller/cainjector"

	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/approver"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/ca"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/selfsigned"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/issuing"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/keymanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/readiness"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/requestmanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/revisionmanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/trigger"
	_ "github.com/cert-manager/cert-manager/pkg/controller/issuers"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/ca"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/selfsigned"
)

var controllers = []string{
	"issuers",
	"certificaterequests-approver",
	"certificaterequests-issuer-selfsigned",
	"certificaterequests-issuer-ca",
	"certificates-trigger",
	"certificates-issuing",
	"certificates-key-manager",
	"certificates-request-manager",
	"certificates-readiness",
	"certificates-revision-manager",
}

func main() {
	kubeconfig := flag.String("kc", "", "kubeconfig")
	flag.Parse()
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	ctrl.SetLogger(zap.New(zap.UseDevMode(true)))
	if err := run(ctx, *kubeconfig); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, kubeconfig string) error {
	factory, err := controllerpkg.NewContextFactory(ctx, controllerpkg.ContextOptions{
		Kubeconfig:         kubeconfig,
		KubernetesAPIQPS:   50,
		KubernetesAPIBurst: 100,
		IssuerOptions:      controllerpkg.IssuerOptions{ClusterResourceNamespace: "kube-system"},
		CertificateOptions: controllerpkg.CertificateOptions{
			CertificateRequestMinimumBackoffDuration: time.Second,
			CertificateRequestMaximumBackoffDuration: 10 * time.Second,
		},
	})
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(controllers)+1)
	for _, name := range controllers {
		ctor, ok := controllerpkg.Known()[name]
		if !ok {
			return fmt.Errorf("controller %s is not registered", name)
		}
		iface, err := ctor(factory)
		if err != nil {
			return fmt.Errorf("controller %s: %w", name, err)
		}
		wg.Add(1)
		go func(name string, c controllerpkg.Interface) {
			defer wg.Done()
			if err := c.Run(2, ctx); err != nil {
				errs <- fmt.Errorf("controller %s: %w", name, err)
			}
		}(name, iface)
	}
	base, err := factory.Build()
	if err != nil {
		return err
	}
	base.KubeSharedInformerFactory.Start(ctx.Done())
	base.SharedInformerFactory.Start(ctx.Done())
	base.HTTP01ResourceMetadataInformersFactory.Start(ctx.Done())

	// cainjector, for MutatingWebhookConfigurations, from Certificates.
	restConfig, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	restConfig.UserAgent = "cert-manager-cainjector/v1.21.2"
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, admissionreg.AddToScheme, apiext.AddToScheme,
		apireg.AddToScheme, cmapi.AddToScheme,
	} {
		if err := add(scheme); err != nil {
			return err
		}
	}
	mgr, err := ctrl.NewManager(restConfig, ctrl.Options{
		Scheme:         scheme,
		Metrics:        metricsserver.Options{BindAddress: "0"},
		LeaderElection: false,
	})
	if err != nil {
		return err
	}
	if err := cainjector.RegisterAllInjectors(ctx, mgr, cainjector.SetupOptions{
		EnableCertificatesDataSource: true,
		EnabledReconcilersFor:        map[string]bool{cainjector.MutatingWebhookConfigurationName: true},
	}); err != nil {
		return err
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := mgr.Start(ctx); err != nil {
			errs <- fmt.Errorf("cainjector: %w", err)
		}
	}()
	fmt.Println("cert-manager (minimal) running")
	select {
	case <-ctx.Done():
	case err := <-errs:
		return err
	}
	wg.Wait()
	return nil
}
"""


def _go(args: list[str], cwd: Path, timeout: float) -> None:
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"}
    result = subprocess.run(
        ["go", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    assert result.returncode == 0, (
        f"go {' '.join(args)} in {cwd}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    )


@pytest.fixture(scope="module")
def cert_manager_program() -> Path:
    """The minimal cert-manager, built once per machine into the binaries cache."""
    key = hashlib.sha256((CERT_MANAGER_VERSION + MAIN_GO).encode()).hexdigest()[:12]
    directory = binaries.cache_dir() / "test-programs" / f"cert-manager-minimal-{CERT_MANAGER_VERSION}-{key}"
    program = directory / "cert-manager-minimal"
    if program.is_file():
        return program
    source = directory / "src"
    source.mkdir(parents=True, exist_ok=True)
    (source / "main.go").write_text(MAIN_GO)
    requirement = f"require {CERT_MANAGER_MODULE} {CERT_MANAGER_VERSION}"
    (source / "go.mod").write_text(f"module gpualloc.dev/tests/certmanager\n\ngo 1.26.0\n\n{requirement}\n")
    _go(["mod", "tidy"], source, timeout=900)
    temporary = directory / f".cert-manager-minimal.tmp-{os.getpid()}"
    _go(["build", "-trimpath", "-ldflags", "-s -w", "-o", str(temporary), "."], source, timeout=1800)
    os.replace(temporary, program)
    return program


def cert_manager_crds() -> Path:
    """cert-manager's CRDs, from its Go module (``deploy/crds``) in the Go module cache (``test_helm_install``
    applies them too)."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"{CERT_MANAGER_MODULE}@{CERT_MANAGER_VERSION}"],
        capture_output=True, text=True, timeout=300, check=False, cwd="/",
        env={**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"},
    )  # fmt: skip
    assert result.returncode == 0, f"go mod download {CERT_MANAGER_MODULE}: {result.stdout}{result.stderr}"
    directory = Path(json.loads(result.stdout)["Dir"]) / "deploy" / "crds"
    assert sorted(p.name for p in directory.glob("cert-manager.io_*.yaml")), f"no CRDs in {directory}"
    return directory


@pytest.fixture
def cert_manager(control_plane: Any, cert_manager_program: Path, tmp_path: Path) -> Iterator[Path]:
    """cert-manager's CRDs applied and the minimal cert-manager running; yields its log file."""
    control_plane.apply_crds(cert_manager_crds())
    log = tmp_path / "cert-manager.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(cert_manager_program), f"--kc={control_plane.kubeconfig}"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield log
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait(what: str, check: Callable[[], Any], log: Path, timeout: float = 90.0) -> Any:
    """``wait_until`` with the end of cert-manager's log in the failure."""

    def tail() -> str:
        return "cert-manager log:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])

    return wait_until(what, check, within=timeout, every=0.5, logs=tail)


def test_cert_manager_issues_the_chain_and_cainjector_fills_the_ca_bundle_the_webhook_serves_with(
    control_plane: Any, cert_manager: Path, namespace: str, tmp_path: Path
) -> None:

    # kube-controller-manager finishes deleting namespaces: `helm uninstall --wait` waits for the
    # heartbeat namespace the chart made.
    control_plane.ensure_controller_manager()
    helm = str(binaries.ensure(["helm"], progress=lambda _: None)["helm"])
    release = f"cm{uuid.uuid4().hex[:6]}"
    fullname = f"{release}-gpualloc"
    service = f"{fullname}-webhook"
    env = {
        **os.environ,
        **{k: str(tmp_path / "helm") for k in ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME")},
    }
    base = ["--kubeconfig", str(control_plane.kubeconfig), "--namespace", namespace]
    install = subprocess.run(
        [helm, *base, "install", release, str(CHART), "--timeout", "120s"],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    webhook: subprocess.Popen[bytes] | None = None
    try:
        certs = f"/apis/cert-manager.io/v1/namespaces/{namespace}/certificates"

        def ready(name: str) -> bool:
            conditions = (
                control_plane.request("GET", f"{certs}/{name}").get("status", {}).get("conditions") or []
            )
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        _wait("the CA Certificate Ready", lambda: ready(f"{fullname}-ca"), cert_manager)
        _wait("the serving Certificate Ready", lambda: ready(f"{fullname}-webhook-serving"), cert_manager)
        issuer = control_plane.request(
            "GET", f"/apis/cert-manager.io/v1/namespaces/{namespace}/issuers/{fullname}-ca"
        )
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in issuer["status"]["conditions"])

        secret = control_plane.request(
            "GET", f"/api/v1/namespaces/{namespace}/secrets/{fullname}-webhook-tls"
        )
        files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        assert secret["type"] == "kubernetes.io/tls"
        assert {"tls.crt", "tls.key", "ca.crt"} <= set(files)
        serving = x509.load_pem_x509_certificate(files["tls.crt"])
        ca = x509.load_pem_x509_certificate(files["ca.crt"])
        serving.verify_directly_issued_by(ca)
        names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert f"{service}.{namespace}.svc" in names.get_values_for_type(x509.DNSName)
        assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

        mwc_path = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{fullname}"

        def injected() -> bytes | None:
            bundle = control_plane.request("GET", mwc_path)["webhooks"][0]["clientConfig"].get("caBundle")
            return base64.b64decode(bundle) if bundle else None

        bundle = _wait("cainjector to fill the caBundle", injected, cert_manager)
        assert bundle == files["ca.crt"]

        # The webhook serving the Secret's pair is trusted through the injected caBundle, for the
        # name the API server uses (<service>.<namespace>.svc).
        for name in ("tls.crt", "tls.key"):
            (tmp_path / name).write_bytes(files[name])
        port = cluster.free_port()
        webhook = subprocess.Popen(
            [sys.executable, "-m", "gpualloc.cli", "webhook", f"--kubeconfig={control_plane.kubeconfig}",
             f"--tls-cert-file={tmp_path / 'tls.crt'}", f"--tls-key-file={tmp_path / 'tls.key'}",
             f"--port={port}", "--metrics-port=0", "--health-port=0", "--log-format=text"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        context = ssl.create_default_context(cadata=bundle.decode())
        dns_name = f"{service}.{namespace}.svc"
        _wait(
            "the webhook's /readyz over TLS",
            lambda: http_status(port, "/readyz", tls=context, server_name=dns_name) == 200,
            cert_manager,
            timeout=30,
        )
        with (
            pytest.raises(ssl.SSLCertVerificationError),
            socket.create_connection(("127.0.0.1", port), timeout=2) as raw,
        ):
            context.wrap_socket(raw, server_hostname="someone-else.example").close()
    finally:
        if webhook is not None:
            webhook.terminate()
            webhook.wait(timeout=15)
        subprocess.run(
            [helm, *base, "uninstall", release, "--wait"],
            env=env,
            capture_output=True,
            timeout=120,
            check=False,
        )
        try:
            control_plane.request(
                "DELETE", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{fullname}"
            )
        except cluster.RequestError as exc:
            if exc.status != 404:
                raise
