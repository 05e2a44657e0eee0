"""A CA and a serving certificate for 127.0.0.1, written as ``gpualloc certs --out-dir`` would;
a bare HTTP(S) status probe."""

from __future__ import annotations

import datetime
import socket
import ssl
from pathlib import Path

from certs import building, keys


def write_serving_pair(directory: Path) -> tuple[Path, Path, Path]:
    """``ca.crt``, ``tls.crt`` and ``tls.key`` in ``directory``; the certificate's SAN is IP 127.0.0.1."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = keys.generate_key("ecdsa"), keys.generate_key("ecdsa")
    ca = building.build_ca(ca_key, now=now, serial=keys.random_serial())
    cert = building.build_serving_cert(
        key, ca_cert=ca, ca_key=ca_key, dns_names=[], ip_addresses=["127.0.0.1"], now=now,
        serial=keys.random_serial(),
    )  # fmt: skip
    paths = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
    paths[0].write_bytes(building.cert_pem(ca))
    paths[1].write_bytes(building.cert_pem(cert))
    paths[2].write_bytes(building.key_pem(key))
    return paths


def http_status(port: int, path: str, *, tls: ssl.SSLContext | None = None, server_name: str = "") -> int:
    """GET http(s)://127.0.0.1:port/path; 0 when nothing answers. TLS checks the name ``server_name``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
            sock = tls.wrap_socket(raw, server_hostname=server_name) if tls is not None else raw
            with sock:
                host = server_name or "localhost"
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                head = sock.recv(64).decode(errors="replace")
        return int(head.split()[1]) if head.startswith("HTTP/") else 0
    except OSError:
        return 0
