"""X.509 pieces shared by the webhook's certs tool and the local control plane's PKI. Pure.

Only ``cryptography`` and the standard library: nothing here reads a clock,
draws a random number or touches a file; keys, times and serial numbers are
arguments. ``certs.building`` (the webhook's CA and serving certificate) and
``gpualloc.devcluster.pki`` (the dev cluster's CA, API server and admin
certificates) build their certificates from these.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey

# Certificates start a little in the past: clocks in a cluster disagree.
BACKDATE = datetime.timedelta(minutes=5)


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: PrivateKey) -> bytes:
    """The private key as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def key_usage(*, ca: bool, key_encipherment: bool = False) -> x509.KeyUsage:
    """digitalSignature, plus keyCertSign and cRLSign for a CA, plus keyEncipherment when asked (RSA)."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def alt_names(dns_names: Iterable[str], ips: Iterable[str]) -> x509.SubjectAlternativeName:
    """The DNS names, then the IP addresses (text, parsed here), in the order given."""
    names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    return x509.SubjectAlternativeName(names)


def build_ca(
    key: PrivateKey,
    *,
    common_name: str,
    now: datetime.datetime,
    serial: int,
    validity: datetime.timedelta,
    path_length: int | None,
) -> x509.Certificate:
    """A self-signed CA certificate, ``CN=common_name``, valid from ``now - BACKDATE`` to ``now + validity``.

    ``path_length`` is the basicConstraints pathLen (0: it signs end-entity
    certificates only; None: no limit).
    """
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(serial)
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )


def build_leaf(
    key: PrivateKey,
    *,
    subject: x509.Name,
    ca_cert: x509.Certificate,
    ca_key: PrivateKey,
    usage: x509.ObjectIdentifier,
    dns_names: Iterable[str] = (),
    ips: Iterable[str] = (),
    now: datetime.datetime,
    serial: int,
    not_after: datetime.datetime,
) -> x509.Certificate:
    """An end-entity certificate for ``key``, signed by the CA, valid from ``now - BACKDATE`` to
    ``not_after``; ``usage`` is its one extended key usage (``ExtendedKeyUsageOID.SERVER_AUTH`` or
    ``CLIENT_AUTH``). The names, if any, go in its subjectAltName."""
    public = key.public_key()
    dns_names, ips = list(dns_names), list(ips)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(serial)
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            key_usage(ca=False, key_encipherment=isinstance(key, rsa.RSAPrivateKey)), critical=True
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if dns_names or ips:
        builder = builder.add_extension(alt_names(dns_names, ips), critical=False)
    return builder.sign(ca_key, hashes.SHA256())
