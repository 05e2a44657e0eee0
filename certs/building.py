"""Certificates for the webhook: a CA, a serving certificate, and when to renew them. Pure.

Nothing here reads a clock, draws a random number or touches a file: the
time, the keys and the serial numbers are arguments (``certs.keys`` makes
keys and serials; ``certs.storing`` reads and writes). So the renewal rules
can be tested at any instant of a certificate's life.

Rules (``plan``):

* the CA is kept while it is a CA, its key is at hand and matches it, and it is
  not in the last third of its lifetime; otherwise a new CA is made;
* the serving certificate is kept while it is signed by the CA in use, its key
  matches, its key type and SANs are the ones asked for, it is not in the
  last third of its lifetime, and no renewal was asked for (``renew``, the
  tool's ``--renew``); otherwise it is re-issued (a new CA always means a new
  serving certificate).

When the CA is replaced, the old one stays in ``ca.crt`` (and so in the
caBundle) until it expires, so a replica still serving the old certificate is
trusted until it reloads the new one.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from collections.abc import Mapping, Sequence
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpualloc import certificates
from gpualloc.certificates import BACKDATE as BACKDATE
from gpualloc.certificates import PrivateKey as PrivateKey
from gpualloc.certificates import cert_pem as cert_pem
from gpualloc.certificates import key_pem as key_pem

KeyType = Literal["ecdsa", "rsa"]
KEY_TYPES: tuple[KeyType, ...] = ("ecdsa", "rsa")

CA_COMMON_NAME = "gpualloc-webhook-ca"
DEFAULT_VALIDITY = datetime.timedelta(days=365)
DEFAULT_CA_VALIDITY = datetime.timedelta(days=3650)
RENEW_FRACTION = 1 / 3

# File names, the same in a directory and in the Secret.
CA_CRT = "ca.crt"
CA_KEY = "ca.key"
TLS_CRT = "tls.crt"
TLS_KEY = "tls.key"
NAMES = (CA_CRT, CA_KEY, TLS_CRT, TLS_KEY)


class BundleError(ValueError):
    """Stored certificate material that cannot be read."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Wanted:
    """What the serving certificate must say, and for how long certificates last."""

    dns_names: tuple[str, ...] = ()
    ip_addresses: tuple[str, ...] = ()
    key_type: KeyType = "ecdsa"
    validity: datetime.timedelta = DEFAULT_VALIDITY
    ca_validity: datetime.timedelta = DEFAULT_CA_VALIDITY

    def __post_init__(self) -> None:
        if not self.dns_names and not self.ip_addresses:
            raise ValueError("a serving certificate needs at least one DNS name or IP address")
        for ip in self.ip_addresses:
            ipaddress.ip_address(ip)  # raises ValueError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Bundle:
    """A CA (with older CAs still trusted) and a serving certificate with their keys."""

    ca_cert: x509.Certificate
    ca_key: PrivateKey | None
    cert: x509.Certificate | None = None
    key: PrivateKey | None = None
    previous_cas: tuple[x509.Certificate, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    new_ca: bool
    ca_reason: str
    new_cert: bool
    cert_reason: str


# ------------------------------------------------------------------ building


def service_dns_names(service: str, namespace: str) -> list[str]:
    """The names a Service is reached by: svc, svc.ns, svc.ns.svc, svc.ns.svc.cluster.local."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _aware(when: datetime.datetime) -> datetime.datetime:
    if when.tzinfo is None:
        raise ValueError("times must be timezone-aware (UTC)")
    return when


def build_ca(
    key: PrivateKey,
    *,
    now: datetime.datetime,
    serial: int,
    validity: datetime.timedelta = DEFAULT_CA_VALIDITY,
    common_name: str = CA_COMMON_NAME,
) -> x509.Certificate:
    """A self-signed CA certificate that may sign end-entity certificates only (pathLen 0)."""
    return certificates.build_ca(
        key, common_name=common_name, now=_aware(now), serial=serial, validity=validity, path_length=0
    )


def build_serving_cert(
    key: PrivateKey,
    *,
    ca_cert: x509.Certificate,
    ca_key: PrivateKey,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str] = (),
    now: datetime.datetime,
    serial: int,
    validity: datetime.timedelta = DEFAULT_VALIDITY,
) -> x509.Certificate:
    """A TLS server certificate for ``dns_names`` and ``ip_addresses``, signed by the CA.

    It never outlives the CA: its notAfter is the earlier of ``now + validity``
    and the CA's notAfter.
    """
    now = _aware(now)
    if not dns_names and not ip_addresses:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    common_name = dns_names[0] if dns_names else ip_addresses[0]
    return certificates.build_leaf(
        key,
        subject=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]),
        ca_cert=ca_cert,
        ca_key=ca_key,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        dns_names=dns_names,
        ips=ip_addresses,
        now=now,
        serial=serial,
        not_after=min(now + validity, ca_cert.not_valid_after_utc),
    )


# ------------------------------------------------------------------ inspecting


def key_type_of(key: PrivateKey | ec.EllipticCurvePublicKey | rsa.RSAPublicKey) -> KeyType | None:
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        return "ecdsa"
    if isinstance(key, rsa.RSAPrivateKey | rsa.RSAPublicKey):
        return "rsa"
    return None


def sans_of(cert: x509.Certificate) -> tuple[frozenset[str], frozenset[str]]:
    """(DNS names, IP addresses as text) in the certificate's SAN extension."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset(), frozenset()
    dns = frozenset(ext.get_values_for_type(x509.DNSName))
    ips = frozenset(str(ip) for ip in ext.get_values_for_type(x509.IPAddress))
    return dns, ips


def renew_after(cert: x509.Certificate) -> datetime.datetime:
    """The start of the last ``RENEW_FRACTION`` (a third) of the certificate's lifetime."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return end - (end - start) * RENEW_FRACTION


def needs_renewal(cert: x509.Certificate, now: datetime.datetime) -> bool:
    return _aware(now) >= renew_after(cert)


def key_matches(cert: x509.Certificate, key: PrivateKey) -> bool:
    public = cert.public_key()
    own = key.public_key()
    fmt = serialization.PublicFormat.SubjectPublicKeyInfo
    return bool(
        public.public_bytes(serialization.Encoding.DER, fmt)
        == own.public_bytes(serialization.Encoding.DER, fmt)
    )


def issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """True when ``ca_cert`` signed ``cert`` (the signature checks out, the names chain)."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def describe(cert: x509.Certificate) -> str:
    """``serial 0x1f… valid until 2026-01-02`` for messages."""
    return f"serial {cert.serial_number:#x}, valid until {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"


# ------------------------------------------------------------------ deciding


def plan(existing: Bundle | None, wanted: Wanted, *, now: datetime.datetime, renew: bool = False) -> Plan:
    """Which certificates to make, and why (or why the current ones are kept).

    ``renew`` re-issues a serving certificate that would otherwise be kept (``--renew``).
    """
    now = _aware(now)
    new_ca, ca_reason = _ca_plan(existing, now)
    if new_ca:
        return Plan(new_ca=True, ca_reason=ca_reason, new_cert=True, cert_reason="a new CA signs it")
    assert existing is not None
    new_cert, cert_reason = _cert_plan(existing, wanted, now, renew=renew)
    return Plan(new_ca=False, ca_reason=ca_reason, new_cert=new_cert, cert_reason=cert_reason)


def _ca_plan(existing: Bundle | None, now: datetime.datetime) -> tuple[bool, str]:
    if existing is None:
        return True, "there is none yet"
    ca = existing.ca_cert
    if existing.ca_key is None:
        return True, "the CA's key is not stored with it"
    if not key_matches(ca, existing.ca_key):
        return True, "the stored CA key does not match the CA certificate"
    if not is_ca(ca):
        return True, "the stored CA certificate is not a CA"
    if needs_renewal(ca, now):
        return True, f"it is in the last third of its lifetime (renewal due {renew_after(ca):%Y-%m-%d})"
    return False, f"kept: {describe(ca)}"


def _cert_plan(existing: Bundle, wanted: Wanted, now: datetime.datetime, *, renew: bool) -> tuple[bool, str]:
    cert, key = existing.cert, existing.key
    if cert is None or key is None:
        return True, "there is none yet"
    if not key_matches(cert, key):
        return True, "the stored key does not match the certificate"
    if not issued_by(cert, existing.ca_cert):
        return True, "it is not signed by the CA in use"
    if key_type_of(key) != wanted.key_type:
        return True, f"its key is {key_type_of(key)}, {wanted.key_type} was asked for"
    have_dns, have_ips = sans_of(cert)
    want_dns, want_ips = (
        frozenset(wanted.dns_names),
        frozenset(str(ipaddress.ip_address(i)) for i in wanted.ip_addresses),
    )
    if (have_dns, have_ips) != (want_dns, want_ips):
        have = sorted(have_dns) + sorted(have_ips)
        want = sorted(want_dns) + sorted(want_ips)
        return True, f"its SANs differ (has {', '.join(have) or 'none'}; wanted {', '.join(want)})"
    if needs_renewal(cert, now):
        return (
            True,
            f"it is in the last third of its lifetime (renewal due {renew_after(cert):%Y-%m-%d %H:%M})",
        )
    if renew:
        return True, "--renew was given"
    return False, f"kept: {describe(cert)}"


def issue(
    existing: Bundle | None,
    decided: Plan,
    wanted: Wanted,
    *,
    now: datetime.datetime,
    new_ca_key: PrivateKey | None,
    new_key: PrivateKey | None,
    ca_serial: int,
    serial: int,
) -> Bundle:
    """Carry out ``decided``: the resulting bundle. Keys for what is made new must be given."""
    now = _aware(now)
    if decided.new_ca or existing is None:
        if new_ca_key is None:
            raise ValueError("a new CA needs a key")
        ca_cert = build_ca(new_ca_key, now=now, serial=ca_serial, validity=wanted.ca_validity)
        ca_key: PrivateKey = new_ca_key
        previous = (existing.ca_cert, *existing.previous_cas) if existing is not None else ()
    else:
        if existing.ca_key is None:
            raise ValueError("the CA is kept but its key is missing")
        ca_cert, ca_key, previous = existing.ca_cert, existing.ca_key, existing.previous_cas
    # Older CAs stay trusted until they expire; drop repeats of the current one.
    previous = tuple(c for c in previous if c.not_valid_after_utc > now and c != ca_cert)
    if decided.new_cert or existing is None or existing.cert is None or existing.key is None:
        if new_key is None:
            raise ValueError("a new serving certificate needs a key")
        cert = build_serving_cert(
            new_key,
            ca_cert=ca_cert,
            ca_key=ca_key,
            dns_names=wanted.dns_names,
            ip_addresses=wanted.ip_addresses,
            now=now,
            serial=serial,
            validity=wanted.validity,
        )
        key: PrivateKey = new_key
    else:
        cert, key = existing.cert, existing.key
    return Bundle(ca_cert=ca_cert, ca_key=ca_key, cert=cert, key=key, previous_cas=previous)


# ------------------------------------------------------------------ PEM


def ca_bundle_pem(bundle: Bundle) -> bytes:
    """The CAs to trust: the one in use first, then older ones not yet expired (the caBundle)."""
    return b"".join(cert_pem(c) for c in (bundle.ca_cert, *bundle.previous_cas))


def bundle_files(bundle: Bundle) -> dict[str, bytes]:
    """The bundle as the files ``ca.crt``, ``ca.key``, ``tls.crt``, ``tls.key`` (PEM)."""
    files = {CA_CRT: ca_bundle_pem(bundle)}
    if bundle.ca_key is not None:
        files[CA_KEY] = key_pem(bundle.ca_key)
    if bundle.cert is not None:
        files[TLS_CRT] = cert_pem(bundle.cert)
    if bundle.key is not None:
        files[TLS_KEY] = key_pem(bundle.key)
    return files


def _load_key(data: bytes, name: str) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise BundleError(f"{name}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise BundleError(f"{name}: unsupported key type {type(key).__name__}")
    return key


def _load_certs(data: bytes, name: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise BundleError(f"{name}: not PEM certificates ({exc})") from exc
    if not certs:
        raise BundleError(f"{name}: no certificate in it")
    return certs


def read_bundle(files: Mapping[str, bytes]) -> Bundle | None:
    """The bundle stored in ``files`` (None when there is no ``ca.crt``); BundleError if unreadable.

    The CA in use is the one in ``ca.crt`` that ``ca.key`` matches (else the
    first); the others are older CAs still trusted.
    """
    if CA_CRT not in files:
        return None
    cas = _load_certs(files[CA_CRT], CA_CRT)
    ca_key = _load_key(files[CA_KEY], CA_KEY) if CA_KEY in files else None
    current = next((c for c in cas if ca_key is not None and key_matches(c, ca_key)), cas[0])
    cert = _load_certs(files[TLS_CRT], TLS_CRT)[0] if TLS_CRT in files else None
    key = _load_key(files[TLS_KEY], TLS_KEY) if TLS_KEY in files else None
    previous = tuple(c for c in cas if c is not current)
    return Bundle(ca_cert=current, ca_key=ca_key, cert=cert, key=key, previous_cas=previous)


def same_files(a: Mapping[str, bytes], b: Mapping[str, bytes]) -> bool:
    """Whether ``a`` and ``b`` hold the same certificate files (``NAMES``; others are not looked at)."""
    return all(a.get(n) == b.get(n) for n in NAMES)
