"""Rank-0 set-up that follows rank 0 (``Session.on_rank0``, issue 33).

A pod's rank can change after a fault (w1 becomes rank 0 when rank 0 dies; a spare is
promoted into rank 0), so set-up that only rank 0 does (a logger, ``wandb.init``) cannot run
once before the loop. ``Rank0Hooks.follow`` compares "is this pod rank 0" with "did it run
the set-up" at ``join()`` and at every step boundary (one comparison), and runs the set-up or
the teardown there, on the training thread, inside ``solo`` (a slow set-up does not time
out the peers).
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from plumbing import logs

log = logs.get("agent")
Solo = Callable[[float], contextlib.AbstractContextManager]


@dataclass
class Rank0Hooks:
    setup: Callable[[], Any] | None
    teardown: Callable[[], Any] | None
    max_s: float
    active: bool = False  # this pod ran the set-up last (it is rank 0)

    def __post_init__(self) -> None:
        if self.setup is None and self.teardown is None:
            raise ValueError("s.on_rank0 needs a setup or a teardown (or both)")

    def follow(self, is_rank0: bool, solo: Solo, **where: Any) -> None:
        """Run the set-up (became rank 0) or the teardown (stopped being it), if changed.
        A set-up that raises propagates: the script's error, like any other."""
        if is_rank0 == self.active:
            return
        if not is_rank0:
            return self.end(solo)
        self.active = True
        if self.setup is not None:
            log.info("rank-0 set-up", **where)
            with solo(self.max_s):
                self.setup()

    def end(self, solo: Solo) -> None:
        """The teardown, if the set-up ran: logged, never raised (a logger that fails to
        close must not stop training)."""
        if not self.active:
            return
        self.active = False
        if self.teardown is None:
            return
        log.info("rank-0 teardown")
        try:
            with solo(self.max_s):
                self.teardown()
        except Exception as e:
            log.warning("rank-0 teardown failed", error=f"{type(e).__name__}: {e}"[:500],
                        traceback=traceback.format_exc()[-2000:])
