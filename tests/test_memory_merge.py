"""The merge policies (server_bridge/memory/merge.py): results and type refusals."""

from __future__ import annotations

from typing import Any

import pytest

from server_bridge.memory.errors import BadEnvelope
from server_bridge.memory.merge import MISSING, POLICIES, merge


def test_the_table_names_every_policy_of_the_contract() -> None:
    assert set(POLICIES) == {"replace", "append", "sum", "max", "min", "union", "deep"}


@pytest.mark.parametrize(
    ("policy", "old", "new", "want"),
    [
        ("replace", 1, "x", "x"),
        ("replace", MISSING, None, None),
        ("append", "ab", "cd", "abcd"),
        ("append", [1], [2, 3], [1, 2, 3]),
        ("append", MISSING, "x", "x"),
        ("append", MISSING, [1], [1]),
        ("sum", 2, 3, 5),
        ("sum", 1.5, 1, 2.5),
        ("sum", MISSING, 4, 4),
        ("max", 2, 3, 3),
        ("max", 5, 3, 5),
        ("min", 2, 3, 2),
        ("min", MISSING, -1, -1),
        ("union", [1, 2], [2, 3, 3], [1, 2, 3]),
        ("union", [1], [True], [1, True]),
        ("union", [{"a": 1, "b": 2}], [{"b": 2, "a": 1}, {"a": 2}], [{"a": 1, "b": 2}, {"a": 2}]),
        ("union", MISSING, ["a", "a"], ["a"]),
        (
            "deep",
            {"a": {"x": 1, "y": 2}, "b": 1},
            {"a": {"y": None, "z": 3}},
            {"a": {"x": 1, "z": 3}, "b": 1},
        ),
        ("deep", {"a": 1}, {"a": {"k": None, "j": 1}}, {"a": {"j": 1}}),
        ("deep", {"a": 1}, {"b": None}, {"a": 1}),
        ("deep", MISSING, {"a": None, "b": {"c": None}}, {"b": {}}),
    ],
)
def test_policy_results(policy: str, old: Any, new: Any, want: Any) -> None:
    assert merge(policy, old, new) == want


@pytest.mark.parametrize(
    ("policy", "old", "new"),
    [
        ("append", "a", ["b"]),
        ("append", [1], "b"),
        ("append", 1, 2),
        ("append", MISSING, 3),
        ("sum", 1, True),
        ("sum", True, 1),
        ("sum", "1", 1),
        ("sum", MISSING, None),
        ("max", 1, "2"),
        ("min", [1], 2),
        ("union", [1], 1),
        ("union", "ab", ["c"]),
        ("deep", {"a": 1}, [1]),
        ("deep", [1], {"a": 1}),
        ("deep", MISSING, "x"),
    ],
)
def test_wrong_types_are_bad_envelope_naming_field_and_policy(
    policy: str, old: Any, new: Any
) -> None:
    with pytest.raises(BadEnvelope) as e:
        merge(policy, old, new, field="visits")
    assert e.value.kind == "bad_envelope"
    assert "visits" in e.value.msg and policy in e.value.msg


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(BadEnvelope, match="nope"):
        merge("nope", 1, 2, field="f")


def test_policies_never_change_their_arguments() -> None:
    old: dict[str, Any] = {"a": {"x": [1]}, "l": [1]}
    new: dict[str, Any] = {"a": {"y": 2}, "l": None}
    merged = merge("deep", old, new)
    assert old == {"a": {"x": [1]}, "l": [1]} and new == {"a": {"y": 2}, "l": None}
    assert merged == {"a": {"x": [1], "y": 2}}
    lst = [1]
    assert merge("append", lst, [2]) == [1, 2] and lst == [1]
    assert merge("union", lst, [2]) == [1, 2] and lst == [1]
