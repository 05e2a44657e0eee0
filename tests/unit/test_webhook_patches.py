"""The JSON Patch differ the webhook uses (pure)."""

from __future__ import annotations

from webhook import patches


def test_keys_with_slash_and_tilde_are_escaped() -> None:
    ops = patches.diff({"a": {}}, {"a": {"gpu.scheduling/devices": "x", "t~1": 1}})
    assert ops == [
        {"op": "add", "path": "/a/gpu.scheduling~1devices", "value": "x"},
        {"op": "add", "path": "/a/t~01", "value": 1},
    ]


def test_a_missing_list_is_added_whole_and_an_existing_one_is_appended_to() -> None:
    assert patches.diff({"c": {}}, {"c": {"env": [1]}}) == [{"op": "add", "path": "/c/env", "value": [1]}]
    assert patches.diff({"env": [1]}, {"env": [1, 2, 3]}) == [
        {"op": "add", "path": "/env/1", "value": 2},
        {"op": "add", "path": "/env/2", "value": 3},
    ]


def test_surplus_items_are_removed_from_the_end() -> None:
    assert patches.diff([1, 2, 3], [1]) == [{"op": "remove", "path": "/2"}, {"op": "remove", "path": "/1"}]


def test_types_matter_for_equality() -> None:
    assert patches.diff({"a": 1}, {"a": True}) == [{"op": "replace", "path": "/a", "value": True}]
    assert patches.diff({"a": 1}, {"a": 1.0}) == [{"op": "replace", "path": "/a", "value": 1.0}]
    assert patches.diff({"a": [1, {"b": None}]}, {"a": [1, {"b": None}]}) == []


def test_copy_json_copies_containers_deeply() -> None:
    value = {"a": [{"b": 1}]}
    copied = patches.copy_json(value)
    copied["a"][0]["b"] = 2
    assert value == {"a": [{"b": 1}]}
