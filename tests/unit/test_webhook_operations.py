"""JSON Pointer escaping and the operation constructors."""

from __future__ import annotations

import json

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
    doc = jsonpatch.apply_patch({"m": {}}, patches.loads([patches.add(f"/m/{patches.escape(key)}", 1)]))
    assert doc == {"m": {key: 1}}, "jsonpatch reads the token back as the key"


def test_operations_have_the_rfc_6902_shape() -> None:
    doc = {"a": [1, 2, 3], "b": {"c": 1}}
    ops = [patches.replace("/a/0", 9), patches.remove("/a/2"), patches.add("/a/-", 4), patches.add("/b/c", 2)]
    assert jsonpatch.apply_patch(doc, patches.loads(ops)) == {"a": [9, 2, 4], "b": {"c": 2}}


def test_operation_text_escapes_any_path_and_value_as_json() -> None:
    key, value = 'quote " backslash \\ newline \n tab \t', {"nested": ['"', "\\", "\u2028", "é"]}
    ops = [patches.add(f"/m/{patches.escape(key)}", value), patches.replace("/n", "\u0000")]
    assert patches.loads(ops) == [
        {"op": "add", "path": f"/m/{patches.escape(key)}", "value": value},
        {"op": "replace", "path": "/n", "value": "\u0000"},
    ]
    assert jsonpatch.apply_patch({"m": {}, "n": 1}, patches.loads(ops)) == {"m": {key: value}, "n": "\u0000"}


def test_document_is_the_operations_as_one_json_array() -> None:
    ops = [patches.remove("/a"), patches.add("/b", [1, {"c": None}])]
    assert json.loads(patches.document(ops)) == [
        {"op": "remove", "path": "/a"},
        {"op": "add", "path": "/b", "value": [1, {"c": None}]},
    ]
    assert patches.document([]) == b"[]"
