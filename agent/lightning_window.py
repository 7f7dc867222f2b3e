"""The step of ``agent.lightning``'s strategy under ``ceaseless up``: the window of
micro-batches one optimizer step takes (one without gradient accumulation,
``accumulate_grad_batches`` with it; an epoch's last window may be shorter).

The window's first ``training_step`` opens the step (``agent.ddp.iteration``: commit the step
before, or recover); the micro-batches before the last run their backward without gradient
sync (``no_sync``), the last one's, inside ``optimizer_step``, synchronises. A step discarded
by a fault is computed again whole before the update: every micro-batch of the window, with
its own batch (the window keeps references to the batches the loop already holds: no copy),
through Lightning's own closure, so hooks, loss scaling and ``zero_grad`` are Lightning's.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Any, Callable

from . import ddp


class Phase(enum.Enum):
    CLOSED = "closed"        # between steps: the next training_step opens one
    OPEN = "open"            # the step's micro-batches are being computed (first attempt)
    REPLAYING = "replaying"  # a discarded step computed again: record nothing, open nothing


class Window:
    """One per strategy; driven from the training thread only (Lightning's loop)."""

    def __init__(self) -> None:
        self.phase = Phase.CLOSED
        self.batches: list[tuple[int, tuple]] = []  # (batch_idx, training_step's args)
        self._counted: dict | None = None           # zero_grad's progress at the step's start

    def on_training_step(self, trainer: Any, args: tuple) -> None:
        """Before a micro-batch's ``training_step`` (inside Lightning's closure)."""
        if self.phase is Phase.REPLAYING:
            return
        if self.phase is Phase.CLOSED:
            # the closure zeroes the gradients and counts that in the loop's progress: an
            # attempt computed again (a fault, a resume's dry attempt) counts once, as without
            self._counted = _zeroed(trainer).state_dict()
            open_step(trainer)
            self.phase, self.batches = Phase.OPEN, []
        self.batches.append((trainer.fit_loop.epoch_loop.batch_idx, args))

    def finish(self, trainer: Any, optimizer: Any, closure: Callable[[], Any],
               no_sync: Callable[[], Any]) -> Any:
        """``optimizer_step``: the last micro-batch's closure (its backward synchronises);
        until the sync succeeds, the step computed again, every micro-batch of it."""
        d = ddp.active()
        assert d is not None
        try:
            out = closure()  # opens the step if this micro-batch is the window's only one
            while not d.synced:
                if self._counted is not None:
                    _zeroed(trainer).load_state_dict(self._counted)
                open_step(trainer)  # the same step again, recovered
                self.phase = Phase.REPLAYING
                auto = trainer.fit_loop.epoch_loop.automatic_optimization
                for batch_idx, args in self.batches[:-1]:
                    kwargs = OrderedDict(zip(("batch", "batch_idx"), args))
                    with no_sync():
                        auto._make_closure(kwargs, optimizer, batch_idx)()
                out = closure()
        finally:
            self.phase, self.batches, self._counted = Phase.CLOSED, [], None
        return out


def open_step(trainer: Any) -> None:
    d = ddp.active()
    assert d is not None
    t = d.iteration(trainer.global_step)
    if t != trainer.global_step:
        raise RuntimeError(f"the job's step {t} is not the Trainer's global step "
                           f"{trainer.global_step}")


def _zeroed(trainer: Any) -> Any:
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer \
        .zero_grad
