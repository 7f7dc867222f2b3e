"""Replacement pods: when a pod fails, the actuator starts a fresh spare in its place, so a
job heals back to its size instead of losing a slot per fault (issue 20).

``ReplacementBudget`` is the crash-loop guard, a pure decision over the times of earlier
replacements: at most ``limit`` replacements in any ``window_s`` seconds. A pod that keeps
dying (a bad node, a script that crashes at start) then stops being replaced and the refusal
says why, instead of respawning for ever.
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

    def take(self, now: float) -> str | None:
        """Record a replacement at ``now`` (monotonic seconds) if the budget allows it:
        None when allowed, else why not."""
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return (f"crash loop: {len(self._times)} pods replaced in the last "
                    f"{self.window_s:g}s (limit {self.limit}); not replacing")
        self._times.append(now)
        return None


def should_replace(exit_code: int, shutting_down: bool) -> bool:
    """A pod that exited with ``exit_code`` gets a replacement (budget permitting)."""
    return not shutting_down and exit_code not in NOT_A_FAILURE
