"""Every random order in epochcache comes from here, seeded by a tuple of non-negative words.

The sampler uses ``(seed, pass)`` and ``(seed, pass, object)`` (pass 0's words for every pass when
``sampler.row_fraction`` slices the units, so consecutive passes' slices line up); the loader uses
``(seed, epoch)``.
"""

from __future__ import annotations

import numpy as np


def permutation(n: int, *seed_words: int) -> np.ndarray:
    """The permutation of ``range(n)`` (int64) fixed by ``seed_words``; the same on every machine."""
    return np.random.default_rng(list(seed_words)).permutation(n)
