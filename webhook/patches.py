"""JSON Patch (RFC 6902) operations and JSON Pointer tokens (RFC 6901). Pure.

The webhook builds its patches from these, against the pod as it came (see
``mutations``), instead of diffing an edited copy with ``jsonpatch.make_patch``:
that call costs about half a millisecond for a three-container pod, more than
the rest of an admission together. ``jsonpatch`` stays the oracle in the
tests: every patch is applied with it and compared with a plain dict editor's
result.
"""

from __future__ import annotations

from typing import Any

Op = dict[str, Any]


def escape(key: str) -> str:
    """One JSON Pointer reference token: ``~`` -> ``~0``, ``/`` -> ``~1``."""
    if "~" not in key and "/" not in key:
        return key
    return key.replace("~", "~0").replace("/", "~1")


def add(path: str, value: Any) -> Op:
    """Add ``value`` at ``path`` (replacing an existing object member); ``.../-`` appends to an array."""
    return {"op": "add", "path": path, "value": value}


def replace(path: str, value: Any) -> Op:
    return {"op": "replace", "path": path, "value": value}


def remove(path: str) -> Op:
    return {"op": "remove", "path": path}
