"""Where certificates live: a directory, a ``kubernetes.io/tls`` Secret, a webhook configuration's caBundle.

Each writer compares before it writes and says what it did ("created",
"updated", "unchanged"), so running the tool again changes nothing when
nothing is due.
"""

from __future__ import annotations

import base64
import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from certs import building
from gpualloc.api import constants
from gpualloc.kube import errors, transport
from gpualloc.kube.client import Api

SECRET_TYPE = "kubernetes.io/tls"

_PRIVATE = (building.CA_KEY, building.TLS_KEY)


class StoreError(Exception):
    """Something is in the way of storing the certificates (a clear message for the user)."""


# ------------------------------------------------------------------ directory


def read_dir(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """The certificate files present in ``path`` (missing ones are left out)."""
    out: dict[str, bytes] = {}
    for name in building.NAMES:
        with contextlib.suppress(FileNotFoundError):
            out[name] = (Path(path) / name).read_bytes()
    return out


def _write_atomically(target: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_dir(path: str | os.PathLike[str], files: Mapping[str, bytes]) -> list[str]:
    """Write the files that differ (keys 0600, certificates 0644), each by an atomic rename.

    Keys are written before certificates, so a reader that sees a new
    certificate also finds its key. Returns the names written.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    present = read_dir(directory)
    written: list[str] = []
    for name in (building.CA_KEY, building.TLS_KEY, building.CA_CRT, building.TLS_CRT):
        if name not in files:
            continue
        mode = 0o600 if name in _PRIVATE else 0o644
        target = directory / name
        if present.get(name) == files[name] and (target.stat().st_mode & 0o777) == mode:
            continue
        _write_atomically(target, files[name], mode)
        written.append(name)
    return written


# ------------------------------------------------------------------ Secret


def _secret_path(namespace: str, name: str | None = None) -> str:
    return transport.collection_path("", "v1", "secrets", namespace, name)


async def read_secret(api: Api, namespace: str, name: str) -> tuple[dict[str, bytes], dict[str, Any]] | None:
    """The Secret's files (decoded) and the Secret itself; None when it does not exist."""
    try:
        secret = await transport.request(api, "GET", _secret_path(namespace, name))
    except errors.NotFound:
        return None
    data = secret.get("data") or {}
    files = {k: base64.b64decode(v) for k, v in data.items() if k in building.NAMES}
    return files, secret


def _encoded(files: Mapping[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode("ascii") for k, v in files.items() if k in building.NAMES}


async def write_secret(
    api: Api,
    namespace: str,
    name: str,
    files: Mapping[str, bytes],
    *,
    existing: tuple[dict[str, bytes], dict[str, Any]] | None,
) -> str:
    """Create or update the ``kubernetes.io/tls`` Secret; "created", "updated" or "unchanged".

    ``existing`` is what ``read_secret`` returned: None means the Secret does
    not exist, and it is created. An update carries the resourceVersion that was
    read: a concurrent writer makes it fail with Conflict instead of being
    overwritten (as a create fails with AlreadyExists).
    """
    data = _encoded(files)
    if existing is None:
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {constants.LABEL_MANAGED_BY: constants.MANAGED_BY},
            },
            "type": SECRET_TYPE,
            "data": data,
        }
        await transport.request(api, "POST", _secret_path(namespace), body=body)
        return "created"
    present, secret = existing
    if secret.get("type") != SECRET_TYPE:
        raise StoreError(
            f"Secret {namespace}/{name} exists with type {secret.get('type')!r}, not {SECRET_TYPE}; "
            "the type cannot be changed: delete the Secret or choose another name"
        )
    if building.same_files(present, files):
        return "unchanged"
    patch = {
        "metadata": {"resourceVersion": secret["metadata"]["resourceVersion"]},
        # Keys this tool owns are replaced; a key to drop is set to null (merge-patch delete).
        "data": {k: data.get(k) for k in building.NAMES},
    }
    await transport.request(
        api, "PATCH", _secret_path(namespace, name), body=patch, content_type=transport.MERGE_PATCH
    )
    return "updated"


# ------------------------------------------------------------------ caBundle


async def patch_ca_bundle(api: Api, config_name: str, ca_pem: bytes) -> tuple[int, int] | None:
    """Write ``ca_pem`` into ``clientConfig.caBundle`` of every webhook of the configuration.

    Returns (webhooks changed, webhooks in total); None when the configuration
    does not exist. Each change is a JSON Patch guarded by a ``test`` of the
    webhook's name at that index, so a concurrent reordering fails the patch
    instead of writing the bundle into the wrong webhook.
    """
    path = transport.collection_path(
        "admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", None, config_name
    )
    try:
        config = await transport.request(api, "GET", path)
    except errors.NotFound:
        return None
    wanted = base64.b64encode(ca_pem).decode("ascii")
    webhooks = config.get("webhooks") or []
    ops: list[dict[str, Any]] = []
    for i, webhook in enumerate(webhooks):
        client_config = webhook.get("clientConfig") or {}
        if client_config.get("caBundle") == wanted:
            continue
        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": webhook["name"]})
        ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": wanted})
    if ops:
        await transport.request(api, "PATCH", path, body=ops, content_type=transport.JSON_PATCH)
    return len(ops) // 2, len(webhooks)
