"""The weighted pick and the merged cursor of several sources, without a remote."""

from __future__ import annotations

from epochcache.sync.mixing import MixCursor, pick
from epochcache.sync.sampler import Cursor


def test_the_pick_keeps_every_source_within_one_unit_of_its_share() -> None:
    weights, unit_rows = {"a": 1.0, "b": 2.0, "c": 5.0}, {"a": 32, "b": 16, "c": 24}
    rows = dict.fromkeys(weights, 0)
    for _ in range(5000):
        name = pick(weights, rows)
        rows[name] += unit_rows[name]
        total = sum(rows.values())
        for other, weight in weights.items():
            assert abs(rows[other] - weight / 8 * total) <= 2 * max(unit_rows.values()), (rows, other)


def test_ties_go_to_the_first_configured_source() -> None:
    assert pick({"x": 1.0, "y": 1.0}, {"x": 0, "y": 0}) == "x"
    assert pick({"y": 1.0, "x": 1.0}, {"x": 0, "y": 0}) == "y"


def test_a_source_back_from_idle_resumes_at_its_share_not_above() -> None:
    position = MixCursor({"a": Cursor(), "b": Cursor()}, {"a": 100, "b": 9000})
    back = position.caught_up("a", {"a": 1.0, "b": 3.0})
    assert back.rows == {"a": 2275, "b": 9000}
    assert back.caught_up("b", {"a": 1.0, "b": 3.0}).rows == back.rows, "a source at its share keeps its rows"


def test_the_cursor_round_trips_and_the_single_source_keeps_the_plain_form() -> None:
    named = MixCursor({"a": Cursor(1, 2, 3), "b": Cursor(0, 4, 0)}, {"a": 96, "b": 32})
    saved = named.to_dict()
    assert saved == {"streams": {"a": {"pass": 1, "group": 2, "step": 3}, "b": {"pass": 0, "group": 4, "step": 0}},
                     "rows": {"a": 96, "b": 32}}
    assert MixCursor.from_dict(saved, ["a", "b"]) == named
    assert MixCursor.from_dict(saved, ["a", "c"]).cursors["c"] == Cursor(), "a new source starts afresh"
    single = MixCursor({"": Cursor(2, 1, 0)}, {"": 0})
    assert single.to_dict() == {"pass": 2, "group": 1, "step": 0}
    assert MixCursor.from_dict({**single.to_dict(), "progress": {}}, [""]) == single
