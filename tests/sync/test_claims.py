"""Claims: units cached or on their way, and those a rewrite of their object made outdated."""

from __future__ import annotations

from collections.abc import Iterable

from epochcache.sync.claims import Claims


def _claims(cached: set[str] | None = None) -> Claims:
    held = cached or set()

    def lookup(keys: Iterable[str]) -> set[str]:
        return held & set(keys)

    return Claims(lookup)


def test_units_of_a_rewritten_object_claimed_now_are_outdated_and_dropped_once() -> None:
    claims = _claims()
    for key in ("b/a.parquet#0", "b/a.parquet#1~2", "b/c.parquet#0"):
        claims.claim(key)
    assert claims.outdate(["b/a.parquet"]) == 2
    assert claims.taken("b/a.parquet#0"), "still claimed until dropped: never read twice at once"
    assert claims.drop("b/a.parquet#0") and not claims.taken("b/a.parquet#0")
    assert not claims.drop("b/a.parquet#0"), "dropped once"
    assert not claims.drop("b/c.parquet#0") and claims.taken("b/c.parquet#0"), "another object's unit is kept"


def test_an_outdated_unit_whose_read_failed_is_read_again_and_kept() -> None:
    """Released (its read failed), an outdated unit's next claim is of the new version: not dropped."""
    claims = _claims()
    claims.claim("b/a.parquet#0")
    claims.outdate(["b/a.parquet"])
    claims.release("b/a.parquet#0")
    claims.claim("b/a.parquet#0")
    assert not claims.drop("b/a.parquet#0") and claims.taken("b/a.parquet#0")
