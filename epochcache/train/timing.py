"""When to prepare the next epoch: by time, from the measured preparation time and batch interval.

In: each batch as it is handed out (:meth:`PrepareClock.due`) and the duration of each epoch's
preparation (``prepare_s``); out: whether the next epoch's preparation should start now. It starts
once the time the epoch has left, less the batches its source builds ahead, is within twice the
expected preparation time (the last one, or a slower recent one) plus 50 ms: late enough that its
snapshot holds the shards published meanwhile, early enough that its first batch is ready when the
last one of this epoch is handed out. (A fixed fraction,
the old rule, started 30-70 ms of preparation at 80% of any epoch: far too early for long epochs,
too late for short ones.) ``loader.prepare_next_at``, when set, is that fixed fraction instead.
"""

from __future__ import annotations

import time

# Preparation runs beside training (it shares the GIL and the cores, and the ledger with the daemon),
# so it may take longer than it measured: start it this many times its measured duration ahead, plus
# a fixed slack (on a loaded 2-core machine one preparation in a few took 20-30 ms instead of 1).
_MARGIN = 2.0
_SLACK_S = 0.05
# How much of a slow preparation is still remembered at the next: a spike lifts the estimate at once
# and fades over a few epochs.
_FADE = 0.5
# Weight of the newest interval in the running mean: a few batches' hiccups do not move it much.
_SMOOTHING = 1 / 8


class PrepareClock:
    """Per epoch, :meth:`begin` then :meth:`due` at each batch until it says yes. ``ahead``: batches the
    source builds ahead of the consumer (they must be ready too); ``fraction``: a fixed point instead
    (or None)."""

    def __init__(self, ahead: int, fraction: float | None = None):
        self._ahead, self._fraction = ahead, fraction
        self._prepare_s = 0.0
        self._interval: float | None = None  # running mean of the time between batches, kept across epochs
        self._last: float | None = None
        self._batches = 0

    @property
    def prepare_s(self) -> float:
        """What a preparation is expected to take: the last one, or a fading memory of a slower one."""
        return self._prepare_s

    @prepare_s.setter
    def prepare_s(self, measured: float) -> None:
        self._prepare_s = max(measured, self._prepare_s * _FADE)

    def begin(self, batches: int) -> None:
        """A new epoch of ``batches`` batches (those a resume skips included) begins."""
        self._batches = batches
        self._last = None  # the gap since the last epoch's batches is not a batch interval

    def due(self, number: int) -> bool:
        """Batch ``number`` is being handed out: whether the next epoch should be prepared now."""
        now = time.monotonic()
        if self._last is not None:
            step = now - self._last
            self._interval = step if self._interval is None else self._interval + (step - self._interval) * _SMOOTHING
        self._last = now
        if self._fraction is not None:
            return number >= min(max(self._batches - 1, 0), int(self._batches * self._fraction))
        left = self._batches - number - 1 - self._ahead
        if self._interval is None:
            return left <= 0
        return left * self._interval <= _MARGIN * self.prepare_s + _SLACK_S
