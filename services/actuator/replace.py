"""Replacement pods: when a pod fails, the actuator starts a fresh spare in its place, so a
job heals back to its size instead of losing a slot per fault (issue 20).

``ReplacementBudget`` is the crash-loop guard, a pure decision over the times of earlier
failures: every pod that fails counts (a replacement, a pod the scaler or an operator asked
for, one that is not replaced), and once ``limit`` pods failed in the last ``window_s``
seconds a failed pod is not replaced and the actuator starts no pod on request either
(issue 33: spares asked for by a keeper of the spare pool, each failing at start, were not
counted, and looped for ever). A pod that keeps dying (a bad node, a script that crashes at
start) then stops being replaced and the refusal says why; the budget comes back as the
failures leave the window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Exit codes that are not failures: 0 (done, or released by a planned shrink).
NOT_A_FAILURE = (0,)


@dataclass
class ReplacementBudget:
    limit: int = 8
    window_s: float = 300.0
    _times: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.limit < 0 or not self.window_s > 0:
            raise ValueError(f"replacement budget: limit >= 0 and window_s > 0 "
                             f"(got {self.limit}, {self.window_s})")

    def _recent(self, now: float) -> int:
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        return len(self._times)

    def take(self, now: float) -> str | None:
        """Record a failed pod at ``now`` (monotonic seconds), whether or not it is to be
        replaced: None when a replacement is allowed, else why not."""
        n = self._recent(now)
        self._times.append(now)
        if n >= self.limit:
            return (f"crash loop: {n + 1} pods failed in the last {self.window_s:g}s "
                    f"(limit {self.limit}); not replacing")
        return None

    def refused(self, now: float) -> str | None:
        """Why no pod may be started on request now (None: it may): the failures of the
        window used the budget up."""
        n = self._recent(now)
        if n >= self.limit:
            return (f"crash loop: {n} pods failed in the last {self.window_s:g}s "
                    f"(limit {self.limit}); not starting more pods")
        return None


def is_failure(exit_code: int, shutting_down: bool) -> bool:
    """A pod that exited with ``exit_code`` failed: it counts against the budget and, when
    replacing is on and the budget allows, gets a fresh spare in its place."""
    return not shutting_down and exit_code not in NOT_A_FAILURE

