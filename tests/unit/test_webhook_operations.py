"""JSON Pointer escaping and the operation constructors; the patch is the operations json-encoded."""

from __future__ import annotations

import json

import jsonpatch
import pytest

from webhook import admission, mutations


@pytest.mark.parametrize(
    ("key", "token"),
    [
        ("plain", "plain"),
        ("gpu.scheduling/devices", "gpu.scheduling~1devices"),
        ("a~b", "a~0b"),
        ("~/", "~0~1"),
        ("~1", "~01"),
    ],
)
def test_keys_with_slash_and_tilde_are_escaped(key: str, token: str) -> None:
    assert mutations.escape(key) == token
    doc = jsonpatch.apply_patch({"m": {}}, [mutations.add(f"/m/{mutations.escape(key)}", 1)])
    assert doc == {"m": {key: 1}}, "jsonpatch reads the token back as the key"


def test_operations_have_the_rfc_6902_shape() -> None:
    doc = {"a": [1, 2, 3], "b": {"c": 1}}
    ops = [
        mutations.replace("/a/0", 9),
        mutations.remove("/a/2"),
        mutations.add("/a/-", 4),
        mutations.add("/b/c", 2),
        mutations.copy("/a/0", "/b/d"),
    ]
    assert jsonpatch.apply_patch(doc, ops) == {"a": [9, 2, 4], "b": {"c": 2, "d": 9}}


def test_the_answers_patch_is_the_operations_as_json_whatever_the_path_and_value() -> None:
    key, value = 'quote " backslash \\ newline \n tab \t', {"nested": ['"', "\\", "\u2028", "é"]}
    ops = [mutations.add(f"/m/{mutations.escape(key)}", value), mutations.replace("/n", "\u0000")]
    answer = admission.allow("u", patch=ops)
    assert answer.response.patch is not None and answer.response.patch_type == "JSONPatch"
    assert json.loads(answer.response.patch) == ops
    assert jsonpatch.apply_patch({"m": {}, "n": 1}, ops) == {"m": {key: value}, "n": "\u0000"}


def test_an_empty_patch_is_left_out_of_the_answer() -> None:
    response = admission.allow("u", patch=[]).response
    assert response.patch is None and response.patch_type is None
