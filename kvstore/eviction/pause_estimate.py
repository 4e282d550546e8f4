"""Resume hints kvtier infers itself, for spills whose framework sent none.

A session that has never resumed is mostly one that never will. So a session's first
spill is hinted as a long pause, the 90th percentile of the pauses seen so far divided
by the share of first spills that came back (a rare return, expected late), and a
session that has resumed is hinted as due now: from there recency (LRU order) ranks it,
and the long pause predicted at its first spill no longer marks its blocks as not needed
soon, even when it spills again without having been restored from kvtier (a framework
that kept the session in its own memory). ``bench.trace`` measures the choice.

The estimator only learns from what already happened; it is fed one call per spill::

    hint = estimator.on_spill(previous_spill_at, first_spill_at, now)

with the previous spill's time (None for a session's first) and the session's first.
"""

from __future__ import annotations

import statistics
from collections import deque

from kvstore.format.hints import ResumeHint

MIN_PAUSES = 10  # below this many observed pauses, no estimate
MIN_RETURN_RATE = 0.02  # bounds the hinted pause when almost nothing came back yet
# A session that came back: due now, so recency ranks it from here, and the long pause
# predicted at its first spill stops pinning its blocks as "not needed soon".
RETURNED = ResumeHint(expected_pause_s=0.0)


class PauseEstimator:
    def __init__(self, window: int = 512) -> None:
        self.pauses: deque[float] = deque(maxlen=window)  # recent pauses between spills
        self.first_spills = 0
        self.first_returns = 0  # sessions seen to spill again after their first spill

    def on_spill(self, previous_at: float | None, first_at: float | None,
                 now: float) -> ResumeHint | None:
        """The hint for a spill at ``now`` of a session last spilled at ``previous_at``
        (None: its first spill) and first spilled at ``first_at``; records the pause."""
        if previous_at is None:
            self.first_spills += 1
            return self.first_spill_hint()
        self.pauses.append(max(0.0, now - previous_at))
        if first_at is not None and previous_at <= first_at:  # its first return
            self.first_returns += 1
        return RETURNED

    def first_spill_hint(self) -> ResumeHint | None:
        """A long expected pause for a session that has not resumed yet (None until
        ``MIN_PAUSES`` pauses have been seen)."""
        if len(self.pauses) < MIN_PAUSES:
            return None
        p90 = statistics.quantiles(self.pauses, n=10)[-1]
        rate = max(self.first_returns / max(self.first_spills, 1), MIN_RETURN_RATE)
        return ResumeHint(expected_pause_s=p90 / rate)
