"""The shape of a pass: row slices of units (``sampler.row_fraction``) and the mixing window
(``sampler.mix_units``). A cache of whole row groups from a sorted remote spans few of them; a slice
of each spans more, and a window of as many objects as the cache holds mixes them all.

With a fraction f < 1, every row of a unit is drawn into one of ``parts`` = ceil(1/f) slices by a
generator seeded by ``(sampler.seed, the unit's key)``, so the draw is the same in every pass, run
and process; pass p reads units whole and keeps slice ``p % parts``. Over ``parts`` passes every row
is cached once; a unit's slice has its own key (``<object>#<index>~<part>``), so a slice is cached
at most once while the others may be. The price: each row group is read whole for the rows it keeps,
so the remote bytes read per byte cached grow ``parts`` times.

``auto`` sizes both from the remote's size *as cached*: its listed (stored) bytes times the bytes a
cache holds per listed byte (decompressed Arrow plus each row's key column), measured once on one
unit (:func:`cached_per_listed`). Sized from the stored bytes alone, a compressed remote, or one of
small rows, gets too few slices: a full cache then holds less than one pass's slices and misses
whole units (and, on a sorted remote, whole classes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import xxhash

from epochcache.arrays import flags
from epochcache.cache.publisher import EPOCH_FILL
from epochcache.config import SamplerConfig
from epochcache.sources import RemoteObject, Source, Unit

# row_fraction auto never reads the remote more than this many times per byte cached.
MAX_AUTO_PARTS = 64


def parts_of(row_fraction: float) -> int:
    """Slices per unit for a ``row_fraction`` in (0, 1] (1: no slicing)."""
    return max(1, math.ceil(1 / row_fraction - 1e-9))


@dataclass(frozen=True)
class PassShape:
    """How one pass of one source is walked: ``parts`` row slices per unit, ``mix`` objects per window."""

    parts: int
    mix: int


def pass_shape(sampler: SamplerConfig, budget: int, remote_bytes: int | None, objects: int) -> PassShape:
    """The pass's shape from the settings; ``auto`` ones from ``budget`` (this source's share of
    ``cache.max_bytes``) and the pass's listing (``objects``, and ``remote_bytes``: their size as
    cached, :func:`cached_per_listed` times the listed bytes; both this node's share).

    ``row_fraction: auto``: as many slices (at most :data:`MAX_AUTO_PARTS`) as the cached size is
    times :data:`~epochcache.cache.publisher.EPOCH_FILL` of the budget, what an epoch of a full
    cache holds at least (``cache.low_watermark: auto``), so that every epoch of a full cache holds
    a slice of every unit. ``mix_units: auto``: as many objects as a full cache holds slices of, so
    one window mixes the whole cache. Both are functions of what the listing's header stores, so a
    restart mid-pass finds the same shape. A listing stored without its size (an older version's)
    gets 1 slice and 8 objects.
    """
    size = remote_bytes if remote_bytes and objects > 0 else None
    if sampler.row_fraction != "auto":
        parts = parts_of(sampler.row_fraction)
    else:
        parts = 1 if size is None else min(MAX_AUTO_PARTS, max(1, math.ceil(size / (EPOCH_FILL * budget))))
    if sampler.mix_units != "auto":
        mix = sampler.mix_units
    else:
        mix = 8 if size is None else min(1024, objects, max(1, math.ceil(parts * budget * objects / size)))
    return PassShape(parts, mix)


def cached_per_listed(source: Source, obj: RemoteObject) -> tuple[float | None, int]:
    """Bytes a cache holds per listed byte of ``obj``, measured by reading its first unit: the unit's
    rows as read (decoded, with their key column) over its share of the object's listed size (by the
    units' metadata sizes); and the bytes read (decoded), for the daemon's count of what it fetched.
    None (0 read) for an object without units or size. Raises what ``source`` raises."""
    units = source.units(obj)
    total = sum(unit.nbytes for unit in units)
    if not units or obj.size <= 0:
        return None, 0
    listed = obj.size * (units[0].nbytes / total if total > 0 else 1 / len(units))
    read = source.read(units[0]).nbytes
    return (read / listed if listed > 0 else None), read


@dataclass(frozen=True)
class Slicer:
    """Cuts units into ``parts`` seeded row slices (``parts`` 1: units stay whole)."""

    parts: int = 1
    seed: int = 0

    def units(self, units: Sequence[Unit], pass_: int) -> list[Unit]:
        """``units`` as pass ``pass_`` reads them: each meaning its slice ``pass_ % parts``, with the
        slice's exact row count where the unit's is known."""
        if self.parts == 1:
            return list(units)
        part = pass_ % self.parts
        return [dataclasses.replace(unit, part=part, rows=None if unit.rows is None else
                                    int(np.count_nonzero(self._draw(unit, unit.rows) == part)))
                for unit in units]

    def rows(self, unit: Unit, table: pa.Table) -> pa.Table:
        """The rows of ``table`` (all of ``unit``'s rows, as read) in the unit's slice."""
        if unit.part is None:
            return table
        return table.filter(flags(self._draw(unit, table.num_rows) == unit.part))

    def _draw(self, unit: Unit, rows: int) -> np.ndarray:
        whole = f"{unit.obj.path}#{unit.index}"
        return np.random.default_rng([self.seed, xxhash.xxh3_64_intdigest(whole.encode())]).integers(
            0, self.parts, rows)
