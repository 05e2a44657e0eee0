"""Certificates and keys for the local control plane (ECDSA P-256, made with cryptography).

A CA; the API server's serving certificate (127.0.0.1, localhost and the
in-cluster names); a client certificate for ``CN=gpualloc-admin, O=system:masters``;
and the service-account signing key pair. Files are written once per state
directory and reused, so a restarted cluster keeps its kubeconfig valid.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpualloc import certificates

ADMIN_USER = "gpualloc-admin"
ADMIN_GROUP = "system:masters"
SERVICE_CLUSTER_IP = "10.96.0.1"  # first address of --service-cluster-ip-range 10.96.0.0/16
SERVING_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
SERVING_IPS = ("127.0.0.1", "::1", SERVICE_CLUSTER_IP)
VALIDITY = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Pki:
    """Paths of the PEM files in one state directory."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def admin_cert(self) -> Path:
        return self.directory / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.directory / "admin.key"

    @property
    def service_account_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def service_account_public_key(self) -> Path:
        return self.directory / "sa.pub"

    def files(self) -> tuple[Path, ...]:
        return (
            self.ca_cert,
            self.ca_key,
            self.serving_cert,
            self.serving_key,
            self.admin_cert,
            self.admin_key,
            self.service_account_key,
            self.service_account_public_key,
        )


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def build_ca(now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and a self-signed CA for it, with no limit on the path length."""
    key = _new_key()
    cert = certificates.build_ca(
        key,
        common_name="gpualloc-dev-ca",
        now=now,
        serial=x509.random_serial_number(),
        validity=VALIDITY,
        path_length=None,
    )
    return cert, key


def issue_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    common_name: str,
    organization: str | None = None,
    dns_names: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    server: bool,
    now: datetime.datetime,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and its certificate signed by the CA: a serving one (``server``) or a client one."""
    key = _new_key()
    cert = certificates.build_leaf(
        key,
        subject=_name(common_name, organization),
        ca_cert=ca_cert,
        ca_key=ca_key,
        usage=ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH,
        dns_names=dns_names,
        ips=ips,
        now=now,
        serial=x509.random_serial_number(),
        not_after=now + VALIDITY,
    )
    return cert, key


def load_ca(pki: Pki) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and key of a state directory's PKI, to issue more certificates with."""
    cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{pki.ca_key} is not an EC private key")
    return cert, key


def _write(path: Path, data: bytes, *, private: bool) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    temporary.chmod(0o600 if private else 0o644)
    temporary.replace(path)


def ensure(directory: Path, *, now: datetime.datetime | None = None) -> Pki:
    """Write the PKI into ``directory`` unless every file is already there."""
    pki = Pki(directory=directory)
    if all(path.exists() for path in pki.files()):
        return pki
    directory.mkdir(parents=True, exist_ok=True)
    now = now or datetime.datetime.now(datetime.UTC)
    ca_cert, ca_key = build_ca(now)
    serving_cert, serving_key = issue_leaf(
        ca_cert,
        ca_key,
        common_name="kube-apiserver",
        dns_names=SERVING_DNS_NAMES,
        ips=SERVING_IPS,
        server=True,
        now=now,
    )
    admin_cert, admin_key = issue_leaf(
        ca_cert, ca_key, common_name=ADMIN_USER, organization=ADMIN_GROUP, server=False, now=now
    )
    sa_key = _new_key()
    _write(pki.ca_cert, certificates.cert_pem(ca_cert), private=False)
    _write(pki.ca_key, certificates.key_pem(ca_key), private=True)
    _write(pki.serving_cert, certificates.cert_pem(serving_cert), private=False)
    _write(pki.serving_key, certificates.key_pem(serving_key), private=True)
    _write(pki.admin_cert, certificates.cert_pem(admin_cert), private=False)
    _write(pki.admin_key, certificates.key_pem(admin_key), private=True)
    _write(pki.service_account_key, certificates.key_pem(sa_key), private=True)
    _write(
        pki.service_account_public_key,
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
        private=False,
    )
    return pki
