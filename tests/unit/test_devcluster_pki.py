"""The local control plane's certificates: who they name, who signed them, what they allow."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpualloc.devcluster import pki


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_serving_certificate_names_loopback_and_the_in_cluster_service(tmp_path: Path) -> None:
    files = pki.ensure(tmp_path)

    sans = _cert(files.serving_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value

    assert {"localhost", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"} <= set(
        sans.get_values_for_type(x509.DNSName)
    )
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("10.96.0.1") in sans.get_values_for_type(x509.IPAddress)


def test_serving_and_admin_certificates_are_signed_by_the_ca(tmp_path: Path) -> None:
    files = pki.ensure(tmp_path)
    ca = _cert(files.ca_cert)

    for path in (files.serving_cert, files.admin_cert):
        _cert(path).verify_directly_issued_by(ca)  # raises if not
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_admin_client_certificate_is_a_system_masters_user(tmp_path: Path) -> None:
    cert = _cert(pki.ensure(tmp_path).admin_cert)

    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpualloc-admin"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_service_account_public_key_matches_the_signing_key(tmp_path: Path) -> None:
    files = pki.ensure(tmp_path)

    private = serialization.load_pem_private_key(files.service_account_key.read_bytes(), password=None)
    public = serialization.load_pem_public_key(files.service_account_public_key.read_bytes())

    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert private.public_key().public_numbers() == public.public_numbers()  # type: ignore[union-attr]


def test_private_keys_are_readable_only_by_the_owner(tmp_path: Path) -> None:
    files = pki.ensure(tmp_path)

    for path in (files.ca_key, files.serving_key, files.admin_key, files.service_account_key):
        assert path.stat().st_mode & 0o077 == 0, path


def test_second_ensure_keeps_the_existing_files(tmp_path: Path) -> None:
    first = pki.ensure(tmp_path)
    before = {path: path.read_bytes() for path in first.files()}

    second = pki.ensure(tmp_path)

    assert {path: path.read_bytes() for path in second.files()} == before
