"""JSON Patches (RFC 6902) from diffing a document before and after an edit. Pure.

``diff(src, dst)`` compares two JSON values and returns the operations that
turn ``src`` into ``dst``: objects member by member, arrays position by
position (changed items in place, new items appended in order, surplus items
removed from the end), anything else replaced when it differs, with the type
taken into account (``1``, ``1.0`` and ``true`` differ). Paths are JSON
Pointers with ``~`` and ``/`` in keys escaped as ``~0`` and ``~1``, and a
member missing in ``src`` (an ``env`` list, the annotations) is added whole.

Why not ``jsonpatch.make_patch``: it gives equivalent patches (the tests use
jsonpatch to apply ours and check the result), but it matches array items up
by serialising every one of them and costs about half a millisecond of CPU
for a three-container pod's env lists, two thirds of an admission. Position
by position is all the webhook needs: it never reorders anything.
"""

from __future__ import annotations

from typing import Any

Op = dict[str, Any]


def escape(key: str) -> str:
    """One JSON Pointer reference token (RFC 6901): ``~`` -> ``~0``, ``/`` -> ``~1``."""
    if "~" not in key and "/" not in key:
        return key
    return key.replace("~", "~0").replace("/", "~1")


def same(a: Any, b: Any) -> bool:
    """JSON equality that tells ``true`` from ``1`` and ``1`` from ``1.0`` (Python's ``==`` does not)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def diff(src: Any, dst: Any) -> list[Op]:
    """The JSON Patch that turns ``src`` into ``dst``. Values in it are ``dst``'s own (not copied)."""
    ops: list[Op] = []
    _diff(src, dst, "", ops)
    return ops


def _diff(src: Any, dst: Any, path: str, ops: list[Op]) -> None:
    if src is dst:  # shared, so unchanged: the webhook's edits replace what they change
        return
    if isinstance(src, dict) and isinstance(dst, dict):
        for key in src:
            if key not in dst:
                ops.append({"op": "remove", "path": f"{path}/{escape(key)}"})
        for key, value in dst.items():
            if key not in src:
                ops.append({"op": "add", "path": f"{path}/{escape(key)}", "value": value})
            elif src[key] is not value:
                _diff(src[key], value, f"{path}/{escape(key)}", ops)
    elif isinstance(src, list) and isinstance(dst, list):
        common = min(len(src), len(dst))
        for i in range(common):
            if src[i] is not dst[i]:
                _diff(src[i], dst[i], f"{path}/{i}", ops)
        for i in range(common, len(dst)):
            ops.append({"op": "add", "path": f"{path}/{i}", "value": dst[i]})
        for i in range(len(src) - 1, common - 1, -1):
            ops.append({"op": "remove", "path": f"{path}/{i}"})
    elif not same(src, dst):
        ops.append({"op": "replace", "path": path, "value": dst})


def copy_json(value: Any) -> Any:
    """A deep copy of a JSON value (dicts, lists, scalars): several times faster than ``copy.deepcopy``."""
    if isinstance(value, dict):
        return {k: copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_json(v) for v in value]
    return value
