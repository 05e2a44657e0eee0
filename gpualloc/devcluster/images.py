"""Single-layer OCI image archives built without a registry, for the real node's containerd.

``build_archive`` is pure: files in, the bytes of an OCI image layout tar out (what
``ctr images import`` reads), with the image's name in the index's
``io.containerd.image.name`` and ``org.opencontainers.image.ref.name`` annotations. Every
tar entry has mtime 0 and owner 0:0 and the gzip header no time, so the same inputs give
the same digests. ``pause_image`` and ``toolbox_image`` say what goes into the node's two
images: the sandbox's pause program, and a shell (Debian's busybox-static, one file with
a symlink per applet) for tests and demos.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PAUSE_IMAGE = "gpualloc.dev/pause:v1"
TOOLBOX_IMAGE = "gpualloc/toolbox:dev"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
ANNOTATION_CONTAINERD_NAME = "io.containerd.image.name"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One path in the layer: a directory (``data`` and ``link`` None), a file or a symlink."""

    path: str  # relative, no leading slash
    mode: int = 0o755
    data: bytes | None = None
    link: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Image:
    """What one image holds and how its container starts."""

    name: str
    entries: tuple[Entry, ...]
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = (PATH_ENV,)


def full_name(name: str) -> str:
    """The name as containerd stores it: ``docker.io/`` and ``library/`` added as a registry's
    reference normalisation does (``gpualloc/toolbox:dev`` -> ``docker.io/gpualloc/toolbox:dev``)."""
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." in first or ":" in first or first == "localhost":
        return name
    return f"docker.io/{name}"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _add(archive: tarfile.TarFile, info: tarfile.TarInfo, data: bytes | None = None) -> None:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if data is not None:
        info.size = len(data)
    archive.addfile(info, io.BytesIO(data) if data is not None else None)


def _parents(paths: Iterable[str]) -> list[str]:
    parents: set[str] = set()
    for path in paths:
        parts = path.split("/")[:-1]
        for end in range(1, len(parts) + 1):
            parents.add("/".join(parts[:end]))
    return sorted(parents)


def layer_tar(entries: Sequence[Entry]) -> bytes:
    """The uncompressed layer: every parent directory first (0755), then the entries in order."""
    buffer = io.BytesIO()
    explicit = {entry.path for entry in entries}
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for directory in _parents(explicit):
            if directory not in explicit:
                info = tarfile.TarInfo(directory)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                _add(archive, info)
        for entry in entries:
            info = tarfile.TarInfo(entry.path.strip("/"))
            info.mode = entry.mode
            if entry.link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, entry.link
                _add(archive, info)
            elif entry.data is not None:
                _add(archive, info, entry.data)
            else:
                info.type = tarfile.DIRTYPE
                _add(archive, info)
    return buffer.getvalue()


def build_archive(image: Image) -> bytes:
    """An OCI image layout as a tar: oci-layout, index.json and the blobs of one manifest."""
    layer = layer_tar(image.entries)
    compressed = gzip.compress(layer, mtime=0)
    process: dict[str, Any] = {"Env": list(image.env), "WorkingDir": "/"}
    if image.entrypoint:
        process["Entrypoint"] = list(image.entrypoint)
    if image.cmd:
        process["Cmd"] = list(image.cmd)
    config = _json(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": process,
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
            "history": [{"created_by": "gpualloc.devcluster.images", "created": "1970-01-01T00:00:00Z"}],
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": MEDIA_LAYER, "digest": _digest(compressed), "size": len(compressed)}],
        }
    )
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        ANNOTATION_CONTAINERD_NAME: full_name(image.name),
                        ANNOTATION_REF_NAME: full_name(image.name),
                    },
                }
            ],
        }
    )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        _add(archive, tarfile.TarInfo("oci-layout"), _json({"imageLayoutVersion": "1.0.0"}))
        _add(archive, tarfile.TarInfo("index.json"), index)
        blobs = tarfile.TarInfo("blobs")
        blobs.type, blobs.mode = tarfile.DIRTYPE, 0o755
        _add(archive, blobs)
        sha = tarfile.TarInfo("blobs/sha256")
        sha.type, sha.mode = tarfile.DIRTYPE, 0o755
        _add(archive, sha)
        for blob in (compressed, config, manifest):
            info = tarfile.TarInfo("blobs/sha256/" + _digest(blob).removeprefix("sha256:"))
            info.mode = 0o644
            _add(archive, info, blob)
    return buffer.getvalue()


def pause_image(pause_program: bytes) -> Image:
    """The pod sandbox's image: the static pause program as ``/pause``, its entrypoint."""
    return Image(
        name=PAUSE_IMAGE,
        entries=(Entry(path="pause", data=pause_program),),
        entrypoint=("/pause",),
    )


_PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = b"root:x:0:\nnogroup:x:65534:\n"


def toolbox_image(
    busybox: bytes, applets: Iterable[str], *, extra: Mapping[str, bytes] | None = None
) -> Image:
    """A shell image: ``/bin/busybox`` and one symlink to it per applet path (``busybox --list-full``'s
    lines, such as ``bin/sh`` or ``usr/bin/env``), /etc/passwd and /etc/group, /tmp (1777)."""
    entries = [
        Entry(path="bin/busybox", data=busybox),
        Entry(path="etc/passwd", mode=0o644, data=_PASSWD),
        Entry(path="etc/group", mode=0o644, data=_GROUP),
        Entry(path="tmp", mode=0o1777),
        Entry(path="root", mode=0o700),
    ]
    for path, data in sorted((extra or {}).items()):
        entries.append(Entry(path=path.strip("/"), mode=0o644, data=data))
    seen = {entry.path for entry in entries}
    for applet in sorted({a.strip().strip("/") for a in applets if a.strip()}):
        if applet in seen:
            continue
        seen.add(applet)
        entries.append(Entry(path=applet, link="/bin/busybox"))
    return Image(name=TOOLBOX_IMAGE, entries=tuple(entries), cmd=("sh",))
