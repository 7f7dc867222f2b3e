"""Gradient sync overlapped with the backward (issue 23): DDP's bucketed all-reduce, abortable.

The parameters are cut into buckets once, in reverse registration order (about the order
their gradients become ready, as DDP does), each at most ``bucket_bytes`` per dtype and
device. During the backward of this rank's *last* micro-batch, a hook on each parameter
(``register_post_accumulate_grad_hook``) notes its gradient final; when every parameter of a
bucket is, and every bucket before it was posted, the bucket's gradients are copied into one
flat buffer and its all-reduce is posted, while the backward goes on with the layers below.
Buckets are posted strictly in index order (as DDP's reducer does): collectives are matched
by order across ranks, and a rank with no micro-batch at all posts them all in ``finish``. Earlier micro-batches accumulate
without communication. ``finish`` (in ``Session.step``) posts what is left (buckets of
parameters that got no gradient, a rank with no micro-batch at all, the loss), waits for
everything with the caller's abort event and timeouts, and writes the sums into ``.grad``.

Why a copy per bucket and not the gradients in place: an all-reduce that fails or is
abandoned leaves its buffer undefined, and a step resumed in the next generation
(``prejoin.py``) must all-reduce the rank's own gradients again, untouched. Buckets are a
function of the parameters only, so every run of a job (with faults or without) sums the
same elements in the same buckets: results stay bitwise reproducible.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .collectives import (DEFAULT_BUCKET_BYTES, AbortableGroup, PendingAllreduce, buckets,
                          flatten, unflatten_)


class GradSync:
    def __init__(self, params: Sequence[torch.nn.Parameter],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.params = list(params)
        self.params_of: Any = None  # the list it was built from (Stepper: not built again)
        order = list(reversed(range(len(self.params))))
        rev = [self.params[i] for i in order]
        self.buckets: list[list[int]] = [[order[j] for j in b] for b in buckets(rev, bucket_bytes)]
        # parameters with no elements are in no bucket (nothing to sum)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._lock = threading.Lock()  # hooks may run on autograd's device threads
        # Per step (``_reset``): the group posted on (None: not armed), buckets' parameters
        # still to come, the next bucket to post (in order), what was posted, parameters
        # final in the armed backward, whether one changed after its bucket may have gone
        # (``spoiled``), why a bucket could not be posted.
        self._group: AbortableGroup | None = None
        self._op_timeout_s: float | None = None
        self._missing: list[int] = []
        self._next = 0
        self._posted: dict[int, tuple[PendingAllreduce, Tensor]] = {}
        self._seen: set[int] = set()
        self.spoiled = False
        self._ahead = False  # armed at the forward (the drop-in): its backward not begun
        self._error: BaseException | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(self.params) if i in self._bucket_of]
        self.overlapped = 0  # buckets posted during the backward (for tests and traces)
        # wall times of the last finished step: armed, each bucket posted, finish called,
        # done (``Stepper`` turns them into spans with CEASELESS_TRACE_STEPS=1)
        self._times: dict[str, Any] = {}
        self.last_times: dict[str, Any] = {}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.disarm()

    # ------------------------------------------------------------------ the backward
    @property
    def armed(self) -> bool:
        return self._group is not None

    def arm(self, group: AbortableGroup, op_timeout_s: float | None = None,
            ahead: bool = False) -> None:
        """The next backward is this rank's last of the step: post buckets as they fill.
        ``ahead``: armed before that backward's forward (the drop-in), so the script may call
        a collective in between (Lightning's ``self.log(..., sync_dist=True)`` in
        ``training_step``): until the backward begins, ``flush`` posts nothing."""
        with self._lock:
            self._reset(group, op_timeout_s)
            self._ahead = group is not None and ahead

    def disarm(self) -> None:
        """Forget what was posted (a discarded step; its group is aborted or closed)."""
        with self._lock:
            self._reset(None)

    def _reset(self, group: AbortableGroup | None, op_timeout_s: float | None = None) -> None:
        """(Under the lock.) Nothing posted yet, for ``group`` (None: not armed)."""
        self._group, self._op_timeout_s = group, op_timeout_s
        self._missing = [len(b) for b in self.buckets] if group is not None else []
        self._posted, self._next, self._error = {}, 0, None
        self._seen, self.spoiled, self._ahead = set(), False, False
        self._times = {"armed": time.time() if group is not None else None, "posted": {},
                       "during_backward": 0}

    def flush(self, group: AbortableGroup, op_timeout_s: float | None = None) -> None:
        """Before a collective of the script's own (``s.all_reduce``) after this rank's last
        backward: post every bucket not posted yet (parameters that got no gradient; a rank
        with no micro-batch: all of them), in order. So every rank has posted all its buckets
        before the script's collective, whatever its share: the order is the same everywhere.
        Armed ``ahead`` and the backward not begun: nothing (the gradients are not computed;
        every rank is at the same point of its script, before any bucket is posted)."""
        with self._lock:
            if self._ahead and self._group is group:
                return
            if self._group is not group:
                self._reset(group, op_timeout_s)
            while self._next < len(self.buckets):
                self._post(self._next)
                self._next += 1

    def _hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(_: Tensor) -> None:
            with self._lock:
                if self._group is None:
                    return
                if i in self._seen:
                    # accumulated again after it may have been sent (reentrant activation
                    # checkpointing with shared weights, a second backward): finish() refuses
                    self.spoiled = True
                    return
                self._ahead = False
                self._seen.add(i)
                b = self._bucket_of[i]
                self._missing[b] -= 1
                while self._next < len(self.buckets) and self._missing[self._next] <= 0:
                    self._post(self._next)
                    self._next += 1
                    self.overlapped += 1
                    self._times["during_backward"] += 1
        return hook

    def _post(self, b: int) -> None:
        g = self._group
        if g is None or not g.usable or b in self._posted:
            return
        grads = [self._grad(i) for i in self.buckets[b]]
        flat = flatten(grads)  # a copy: the gradients stay this rank's own (module doc)
        try:
            self._posted[b] = (g.allreduce_start([flat], self._op_timeout_s), flat)
            self._times["posted"][b] = time.time()
        except Exception as e:  # raised by finish() on the training thread
            self._error = self._error or e

    def _grad(self, i: int) -> Tensor:
        p = self.params[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    # ------------------------------------------------------------------ the step
    def finish(self, group: AbortableGroup, extra: Sequence[Tensor], abort: threading.Event | None,
               op_timeout_s: float | None = None, **wait: Any) -> None:
        """All-reduce every bucket (those posted during the backward on ``group``, the rest
        now) and ``extra`` (e.g. the loss), wait (``wait``: ``slice_s``, ``timeout_s``,
        ``extend`` as ``AbortableGroup.wait_all``), and write the sums into the gradients and
        ``extra``. Raises Aborted / PeerError like ``allreduce_``; the gradients then stay
        this rank's own."""
        if self.spoiled:
            self.disarm()
            raise RuntimeError(
                "a gradient was accumulated again after its bucket was sent (a second "
                "backward after this rank's last micro-batch, or reentrant activation "
                "checkpointing with shared weights): set CEASELESS_OVERLAP=0 for this script")
        t_finish = time.time()
        with self._lock:
            if self._group is not group:  # posted on another generation's group, or none
                self._reset(group, op_timeout_s)
            self._op_timeout_s = op_timeout_s
            while self._next < len(self.buckets):
                self._post(self._next)
                self._next += 1
            posted, err, times = self._posted, self._error, self._times
            self._reset(None)
        group._check(abort)
        if len(posted) != len(self.buckets):
            group._check(None)  # a bucket could not be posted: the group broke, or
            raise err or RuntimeError("gradient buckets could not be posted")
        pending = [posted[b][0] for b in range(len(self.buckets))]
        if extra:
            pending.append(group.allreduce_start(list(extra), op_timeout_s))
        group.wait_all([w for p in pending for w in p.works], abort, "all-reduce", **wait)
        for p in pending:
            p.write_back()
        for b, idx in enumerate(self.buckets):
            unflatten_(posted[b][1], [self.params[i].grad for i in idx])
        self.last_times = {**times, "finish": t_finish, "done": time.time()}
