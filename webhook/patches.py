"""JSON Patch (RFC 6902) operations and JSON Pointer tokens (RFC 6901). Pure.

The webhook builds its patches from these, against the pod as it came (see
``mutations``), instead of diffing an edited copy with ``jsonpatch.make_patch``:
that call costs about half a millisecond for a three-container pod, more than
the rest of an admission together. ``jsonpatch`` stays the oracle in the
tests: every patch is applied with it and compared with a plain dict editor's
result.

An operation is kept as its JSON text (``Op``), not as a dict: the answer
carries the patch as JSON anyway, and writing each operation's text once
saves a dict, its path string and a second encoding pass per operation,
which in the server is a third of the decision's cost (BENCHMARKS.md).
``add``, ``replace`` and ``remove`` encode the whole operation with
msgspec, so any path or value is escaped. ``add_json`` and ``replace_json``
take a value encoded once for many operations and a path of fixed keys and
indices, written as it is; ``adds`` cuts such operations into pieces that a
path joins, for the same values added at many paths. An ``Op`` may hold
several operations separated by commas. ``document`` joins the Ops into the
patch, and ``loads`` reads them back as dicts (tests and tools).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import msgspec

Op = str  # operations as JSON text: '{"op":"add","path":"/a","value":1}', or several joined by commas

_encode = msgspec.json.Encoder().encode


def text(value: Any) -> str:
    """``value`` as compact JSON text."""
    return _encode(value).decode()


@functools.lru_cache(maxsize=64)  # the keys the webhook writes are a handful of constants
def escape(key: str) -> str:
    """One JSON Pointer reference token: ``~`` -> ``~0``, ``/`` -> ``~1``."""
    if "~" not in key and "/" not in key:
        return key
    return key.replace("~", "~0").replace("/", "~1")


def add(path: str, value: Any) -> Op:
    """Add ``value`` at ``path`` (replacing an existing object member); ``.../-`` appends to an array."""
    return text({"op": "add", "path": path, "value": value})


def replace(path: str, value: Any) -> Op:
    return text({"op": "replace", "path": path, "value": value})


def remove(path: str) -> Op:
    return text({"op": "remove", "path": path})


def add_json(path: str, value: str) -> Op:
    """``add`` with ``value`` already JSON text; ``path`` is written as it is (fixed keys and indices)."""
    return f'{{"op":"add","path":"{path}","value":{value}}}'


def adds(suffix: str, values: Sequence[str]) -> tuple[str, ...]:
    """Pieces that ``path.join(pieces)`` makes into one Op: ``add_json(path + suffix, value)`` for each value.

    For the same operations at many paths (the env entries of every
    container): the values are written into the pieces once, and each path
    then costs one ``str.join``, in C.
    """
    head = '{"op":"add","path":"'
    return (
        head,
        *(f'{suffix}","value":{value}}},{head}' for value in values[:-1]),
        f'{suffix}","value":{values[-1]}}}',
    )


def copies(source: str, start: int, count: int, suffix: str) -> tuple[str, ...]:
    """Pieces that ``path.join(pieces)`` makes into one Op: a ``copy`` of each of the ``count`` items
    from ``source + str(start)`` on, to ``path + suffix``.

    ``source`` and ``path`` are written as they are (fixed keys and indices).
    """
    head = '{"op":"copy","from":"'
    pieces = [f'{head}{source}{start}","path":"']
    for index in range(start + 1, start + count):
        pieces.append(f'{suffix}"}},{head}{source}{index}","path":"')
    pieces.append(f'{suffix}"}}')
    return tuple(pieces)


def replace_json(path: str, value: str) -> Op:
    """``replace`` with ``value`` already JSON text; ``path`` is written as it is (fixed keys and indices)."""
    return f'{{"op":"replace","path":"{path}","value":{value}}}'


def document(ops: Sequence[Op]) -> bytes:
    """The JSON Patch document: the operations as one JSON array."""
    return ("[" + ",".join(ops) + "]").encode()


def loads(ops: Sequence[Op]) -> list[dict[str, Any]]:
    """The operations as dicts (what ``jsonpatch.apply_patch`` takes)."""
    value: list[dict[str, Any]] = json.loads(document(ops))
    return value
