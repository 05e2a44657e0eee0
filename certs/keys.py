"""Key material and serial numbers: the only randomness of the certs tool, kept apart from building."""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from certs import building


def generate_key(key_type: building.KeyType) -> building.PrivateKey:
    """A new private key: ECDSA P-256 (default) or RSA 2048."""
    if key_type == "ecdsa":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    raise ValueError(f"unknown key type {key_type!r}")


def random_serial() -> int:
    return int(x509.random_serial_number())
