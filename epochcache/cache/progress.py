"""Progress bars of the long passes over a whole cache: a rebuild reading every shard file, a verify
hashing every byte, a clear deleting every file.

They follow the CLI's convention (``epochcache sync``'s bar): tqdm on stderr; ``progress`` None shows
the bar only on a terminal, False never (``--no-progress``), True always. A bar changes nothing the
pass does: it only counts what the pass reports.
"""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


def progress_bar(desc: str, total: int, progress: bool | None, **units: Any) -> tqdm[Any]:
    """A bar for ``total`` steps (``units``: tqdm's ``unit``, ``unit_scale``...), shown as ``progress``
    says, never for no steps (a verify finds no unknown file most times: no line about it)."""
    disable = None if progress is None else not progress  # tqdm's None: shown on a terminal only
    return tqdm(desc=desc, total=total, disable=disable if total else True, **units)
