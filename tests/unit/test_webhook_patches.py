"""JSON Pointer escaping and the operation constructors."""

from __future__ import annotations

import jsonpatch
import pytest

from webhook import patches


@pytest.mark.parametrize(
    ("key", "token"),
    [
        ("plain", "plain"),
        ("gpu.scheduling/devices", "gpu.scheduling~1devices"),
        ("a~b", "a~0b"),
        ("~/", "~0~1"),
    ],
)
def test_keys_with_slash_and_tilde_are_escaped(key: str, token: str) -> None:
    assert patches.escape(key) == token
    doc = jsonpatch.apply_patch({"m": {}}, [patches.add(f"/m/{patches.escape(key)}", 1)])
    assert doc == {"m": {key: 1}}, "jsonpatch reads the token back as the key"


def test_operations_have_the_rfc_6902_shape() -> None:
    doc = {"a": [1, 2, 3], "b": {"c": 1}}
    ops = [patches.replace("/a/0", 9), patches.remove("/a/2"), patches.add("/a/-", 4), patches.add("/b/c", 2)]
    assert jsonpatch.apply_patch(doc, ops) == {"a": [9, 2, 4], "b": {"c": 2}}
