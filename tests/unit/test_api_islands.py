"""The union-find under NVLink islands, and the islands themselves."""

from __future__ import annotations

from gpualloc.api import islands


def test_disjoint_sets_start_apart_and_union_joins_whole_sets() -> None:
    sets: islands.DisjointSets[str] = islands.DisjointSets()
    assert "gpu:0" not in sets
    assert sets.find("gpu:0") == "gpu:0"  # find adds an item, in a set of its own
    assert "gpu:0" in sets
    sets.union("gpu:0", "switch:a")
    sets.union("gpu:1", "switch:b")
    assert sets.find("gpu:0") != sets.find("gpu:1")
    sets.union("switch:b", "switch:a")
    assert sets.find("gpu:0") == sets.find("gpu:1") == sets.find("switch:a")
    sets.union("gpu:0", "gpu:1")  # already together: nothing changes
    sets.find("gpu:2")
    assert sets.groups() == [["gpu:0", "switch:a", "gpu:1", "switch:b"], ["gpu:2"]]


def test_disjoint_sets_from_items_keep_every_item_in_exactly_one_group() -> None:
    sets = islands.DisjointSets(range(10))
    for a, b in [(0, 9), (9, 3), (4, 5), (7, 4)]:
        sets.union(a, b)
    groups = sets.groups()
    assert sorted(x for g in groups for x in g) == list(range(10))
    assert sorted(sorted(g) for g in groups) == [[0, 3, 9], [1], [2], [4, 5, 7], [6], [8]]


def test_islands_are_sorted_components_ordered_by_lowest_index_ignoring_unknown_indices() -> None:
    assert islands.islands(range(6), [(5, 2), (3, 1), (1, 0), (4, 9)]) == ((0, 1, 3), (2, 5), (4,))
    assert islands.islands([], [(0, 1)]) == ()
