"""Process groups without a global default group, and collectives that can be abandoned.

* ``make_group(store, rank, world_size, timeout_s, backend)`` builds the backend object
  directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never ``init_process_group``: several
  generations can coexist in one process, e.g. a new group is built while a collective of the
  old one is still stuck on a stopped peer.
* ``AbortableGroup`` wraps such a group. Every wait is sliced (``work.wait(slice)`` on gloo;
  on NCCL a helper thread sleeps on a CUDA event recorded after the works, and the caller
  waits for it in slices); between slices the caller's ``abort`` event is checked
  -> ``Aborted``. Anything a collective raises (peer reset, gloo timeout, our own
  ``timeout_s``) -> ``PeerError``. After either, the group is unusable; build a new one.
* Releasing a group never blocks: a gloo group with a pending operation would block its
  destructor (it joins its worker threads) until the peer dies, so such groups are parked
  in the graveyard instead of being destroyed, and freed by ``reap`` once they cannot
  block (``graveyard.py``).

Measured here (torch 2.13 CPU, gloo, loopback): a SIGKILLed peer makes pending all-reduces
raise "Connection reset by peer" within milliseconds; ``ProcessGroupGloo.abort()`` does not
unblock a wait on a SIGSTOPped peer, but ``work.wait(timeout)`` raises "Operation timed out!"
and may be called again, which is what the slicing relies on. That holds for collectives
only: a timed-out wait on a send/recv closes the TCP pair ("Application timeout caused pair
closure"), so point-to-point works are waited on in a helper thread instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_SLICE_S = 0.05


from .vocab import Aborted, CollectiveTimeout, PeerError  # noqa: E402,F401  (their home)


def on_wire(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on the device a group's wire takes (itself when it is there already), to be
    copied back after the operation: CUDA tensors over gloo (pods sharing a GPU), CPU
    tensors over NCCL. CUDA -> host goes through pinned memory (no pageable bounce)."""
    if t.device.type == device.type:
        return t
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        return host
    return t.to(device)


# group creation and the graveyard: agent/groups.py (re-exported here, their old home)
from .groups import (NCCL_ENV, _GROUP_META, _Background, _park, abandoned,  # noqa: E402,F401
                     cuda_device,
                     choose_backend, gloo_device, make_group, make_group_abortable,
                     nccl_env_defaults)


# ---------------------------------------------------------------------------- buckets
def grads_of(params: Iterable[torch.nn.Parameter]) -> list[Tensor]:
    """The gradients of ``params`` for an all-reduce; a missing grad becomes zeros (assigned
    to ``p.grad``, so the reduced value lands on the parameter)."""
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One new contiguous 1-D tensor holding ``tensors`` (same dtype and device) in order."""
    if not tensors:
        raise ValueError("nothing to flatten")
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy ``flat`` (as made by ``flatten``) back into ``tensors`` in place."""
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off:off + n].view_as(t))
        off += n
    if off != flat.numel():
        raise ValueError(f"flat has {flat.numel()} elements, tensors {off}")


def buckets(tensors: Sequence[Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
            ) -> list[list[int]]:
    """Indices of ``tensors`` grouped per (dtype, device) in first-seen order, each group cut
    into runs of at most ``bucket_bytes`` (a bigger tensor is a bucket alone). Deterministic
    in the shapes and dtypes only, so every rank computes the same buckets. Empty tensors
    are skipped."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(i)
    out: list[list[int]] = []
    for idx in groups.values():
        cur: list[int] = []
        size = 0
        for i in idx:
            nb = tensors[i].numel() * tensors[i].element_size()
            if cur and size + nb > bucket_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += nb
        if cur:
            out.append(cur)
    return out


def _is_slice_timeout(e: BaseException) -> bool:
    return "timed out" in str(e).lower()


# ---------------------------------------------------------------------------- the wrapper
class AbortableGroup:
    """A process group whose waits can be abandoned (see module docstring).

    ``AbortableGroup(make_group(store, rank, ws))``. Ops take the caller's ``abort`` event;
    ``slice_s`` is how often it is checked, ``timeout_s`` how long an op may take in total.
    One thread at a time should issue operations (like any c10d group).
    """

    def __init__(self, pg: Any, *, slice_s: float = DEFAULT_SLICE_S,
                 timeout_s: float | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 store: dist.Store | None = None) -> None:
        meta = _GROUP_META.pop(id(pg), {})
        self.pg = pg
        self.rank: int = pg.rank()
        self.world_size: int = pg.size()
        self.backend: str = str(meta.get("backend") or pg.name()).lower()
        self.slice_s = slice_s
        self.timeout_s: float = timeout_s if timeout_s is not None else meta.get("timeout_s", 30.0)
        self.bucket_bytes = bucket_bytes
        self._store = store if store is not None else meta.get("store")
        self._nccl = self.backend == "nccl"
        # The device the wire takes: tensors elsewhere are staged (copied in, and back out
        # after the operation): CUDA tensors over gloo (pods sharing a GPU), CPU scalars
        # over NCCL.
        self.device = cuda_device() if self._nccl else torch.device("cpu")
        self._pending: list[Any] = []
        self._p2p: set[int] = set()   # ids of pending send/recv works (see _wait_in_thread)
        self._state = "ok"          # ok | aborted | broken | closed
        self._why = ""

    # -------------------------------------------------------------- state
    @property
    def usable(self) -> bool:
        return self._state == "ok"

    @property
    def state(self) -> str:
        return self._state

    def _check(self, abort: threading.Event | None) -> None:
        if self._state == "ok":
            if abort is not None and abort.is_set():
                self.abort()
                raise Aborted("abort requested before the operation started")
            return
        if self._state == "broken":
            raise PeerError(f"group is broken: {self._why}")
        raise Aborted(f"group is {self._state}")

    def _broken(self, why: str, timed_out: bool = False) -> PeerError:
        self._state = "broken"
        self._why = why
        self._release(force_park=True)
        return CollectiveTimeout(why) if timed_out else PeerError(why)

    # -------------------------------------------------------------- waiting
    def wait_all(self, works: Sequence[Any], abort: threading.Event | None,
                 what: str = "operation", slice_s: float | None = None,
                 timeout_s: float | None = None,
                 extend: Callable[[], float | None] | None = None) -> None:
        """Wait for every work, checking ``abort`` every ``slice_s``. Raises Aborted (abort
        set; the group is aborted), PeerError (an op failed or ran past ``timeout_s``).
        ``extend`` (optional) is asked when ``timeout_s`` runs out: a later
        ``time.monotonic()`` deadline to keep waiting until (a peer said it works alone for
        a while: ``Session.solo``), or None to give up."""
        sl = slice_s or self.slice_s
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit

        def expired() -> bool:
            nonlocal deadline, limit
            now = time.monotonic()
            if now < deadline:
                return False
            later = extend() if extend is not None else None
            if later is None or later <= now:
                return True
            limit += later - deadline
            deadline = later
            return False

        if self._nccl:
            return self._wait_nccl(works, abort, what, sl, limit, expired)
        if any(id(w) in self._p2p for w in works):
            return self._wait_in_thread(works, abort, what, sl, limit, deadline)
        td = timedelta(seconds=sl)
        for w in works:
            rewaited = False
            while True:
                self._check_abort(abort, what)
                try:
                    w.wait(td)
                    break
                except (Aborted, PeerError):
                    raise
                except Exception as e:
                    # A slice ran out. Gloo can finish the work right after wait() gave
                    # up (is_completed() is then True and the next wait() returns at once),
                    # so a completed work gets one more wait before it counts as failed.
                    if _is_slice_timeout(e) and (not w.is_completed() or not rewaited):
                        rewaited = rewaited or w.is_completed()
                        if expired():
                            raise self._broken(f"{what} did not complete in {limit:.1f}s", True) from e
                        continue
                    raise self._broken(f"{what} failed: {str(e)[:300]}") from e
        self._pending = [w for w in self._pending if not _completed(w)]

    def _check_abort(self, abort: threading.Event | None, what: str) -> None:
        if abort is not None and abort.is_set():
            self.abort()
            raise Aborted(f"{what} abandoned: abort requested")
        if self._state != "ok":
            raise Aborted(f"{what} abandoned: group {self._state}")

    def _wait_nccl(self, works: Sequence[Any], abort: threading.Event | None, what: str,
                   sl: float, limit: float, expired: Callable[[], bool]) -> None:
        """NCCL: ``wait()`` only puts the work before the current stream's next kernels (the
        CPU does not block), so one blocking-sync CUDA event recorded after them is waited
        for by a helper thread (the CPU sleeps: no polling) while this thread checks
        ``abort`` and the deadline every slice. Aborting the group (on abort, on a timeout)
        aborts the communicator: its kernels end, the event completes, the helper returns."""
        self._check_abort(abort, what)
        try:
            for w in works:
                w.wait()  # raises an error recorded already; orders the current stream
            ev = torch.cuda.Event(blocking=True)
            ev.record(torch.cuda.current_stream(self.device))
        except Exception as e:
            raise self._broken(f"{what} failed: {str(e)[:300]}") from e
        job = _Background(ev.synchronize, f"nccl-wait-r{self.rank}")
        while not job.done.wait(sl):
            self._check_abort(abort, what)
            if expired():
                raise self._broken(f"{what} did not complete in {limit:.1f}s", True)
        try:
            if job.error is not None:
                raise job.error
            for w in works:
                w.wait()  # complete: raises the error the work recorded, if any
        except Exception as e:
            raise self._broken(f"{what} failed: {str(e)[:300]}") from e
        self._pending = [w for w in self._pending if not _completed(w)]

    def _wait_in_thread(self, works: Sequence[Any], abort: threading.Event | None, what: str,
                        sl: float, limit: float, deadline: float) -> None:
        """Gloo send/recv: a wait that times out closes the pair ("Application timeout caused
        pair closure"), so these are never waited on with a short timeout. A helper thread
        waits (the group's own timeout applies; the GIL is released) and the caller checks
        ``abort`` every slice; an abandoned helper ends when the peer dies or times out."""
        job = _Background(lambda: [w.wait() for w in works], f"wait-r{self.rank}")
        while not job.done.wait(sl):
            if abort is not None and abort.is_set():
                self.abort()
                raise Aborted(f"{what} abandoned: abort requested")
            if self._state != "ok":
                raise Aborted(f"{what} abandoned: group {self._state}")
            if time.monotonic() >= deadline:
                raise self._broken(f"{what} did not complete in {limit:.1f}s", True)
        if job.error is not None:
            raise self._broken(f"{what} failed: {str(job.error)[:300]}") from job.error
        done_ids = {id(w) for w in works}
        self._p2p -= done_ids
        self._pending = [w for w in self._pending if id(w) not in done_ids and not _completed(w)]

    def _post(self, fn, what: str) -> Any:
        try:
            w = fn()
        except Exception as e:
            raise self._broken(f"{what} could not start: {str(e)[:300]}") from e
        self._pending.append(w)
        return w

    def _on_device(self, tensors: Sequence[Tensor], what: str) -> None:
        for t in tensors:
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{what}: tensor on {t.device}: only CPU and CUDA tensors "
                                 f"are supported (group {self.backend})")
            if t.device.type == "cuda" and self._nccl and t.device != self.device:
                raise ValueError(f"{what}: tensor on {t.device}, but this pod's NCCL group "
                                 f"is bound to {self.device}")

    def _wire(self, flat: Tensor) -> Tensor:
        return on_wire(flat, self.device)

    # -------------------------------------------------------------- collectives
    def allreduce_(self, tensors: Sequence[Tensor], abort: threading.Event | None,
                   slice_s: float | None = None, timeout_s: float | None = None,
                   extend: Callable[[], float | None] | None = None,
                   op_timeout_s: float | None = None) -> None:
        """SUM-all-reduce ``tensors`` in place, as a few flat buckets (one async all-reduce
        each, about ``bucket_bytes`` per dtype). Aborted / PeerError as in ``wait_all``; on
        either the tensors hold undefined values. ``op_timeout_s``: the backend's own limit
        for these operations (default: the group's), which must outlast any ``extend``."""
        self._check(abort)
        pending = self.allreduce_start(tensors, op_timeout_s)
        self.allreduce_finish(pending, abort, slice_s, timeout_s, extend)

    def allreduce_start(self, tensors: Sequence[Tensor],
                        op_timeout_s: float | None = None) -> "PendingAllreduce":
        """Post the all-reduce of ``tensors`` (bucketed like ``allreduce_``) without waiting;
        ``allreduce_finish`` waits and writes the results back. Any thread may post (e.g. a
        gradient hook during the backward); one thread at a time."""
        self._check(None)
        self._on_device(tensors, "allreduce_")
        plan = []
        for idx in buckets(tensors, self.bucket_bytes):
            ts = [tensors[i] for i in idx]
            flat = ts[0] if len(ts) == 1 and ts[0].is_contiguous() else flatten(ts)
            plan.append((flat, self._wire(flat), ts))
        opts = dist.AllreduceOptions()
        if op_timeout_s is not None:
            opts.timeout = timedelta(seconds=op_timeout_s)
        works = [self._post(lambda w=wire: self.pg.allreduce([w], opts), "all-reduce")
                 for _, wire, _ in plan]
        return PendingAllreduce(self, plan, works)

    def allreduce_finish(self, pending: "PendingAllreduce", abort: threading.Event | None,
                         slice_s: float | None = None, timeout_s: float | None = None,
                         extend: Callable[[], float | None] | None = None) -> None:
        """Wait for a posted all-reduce (``abort``, timeouts as ``wait_all``), then write the
        sums into the tensors it was given."""
        if pending.group is not self:
            raise ValueError("this all-reduce was posted on another group")
        self.wait_all(pending.works, abort, "all-reduce", slice_s, timeout_s, extend)
        pending.write_back()

    def broadcast_(self, tensors: Sequence[Tensor], src: int, abort: threading.Event | None,
                   slice_s: float | None = None, timeout_s: float | None = None) -> None:
        """Broadcast ``tensors`` from rank ``src`` in place (bucketed like ``allreduce_``)."""
        self._check(abort)
        self._on_device(tensors, "broadcast_")
        plan = []
        for idx in buckets(tensors, self.bucket_bytes):
            ts = [tensors[i] for i in idx]
            flat = ts[0] if len(ts) == 1 and ts[0].is_contiguous() else (
                flatten(ts) if self.rank == src else
                torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device))
            plan.append((flat, self._wire(flat), ts))
        works = []
        for _, wire, _ in plan:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            works.append(self._post(lambda w=wire, o=opts: self.pg.broadcast([w], o),
                                    "broadcast"))
        self.wait_all(works, abort, "broadcast", slice_s, timeout_s)
        if self.rank != src:
            for flat, wire, ts in plan:
                if wire is not flat:
                    flat.copy_(wire)
                if flat is not ts[0]:
                    unflatten_(flat, ts)

    def barrier(self, abort: threading.Event | None, timeout_s: float | None = None) -> None:
        """All ranks reach this point (a one-element all-reduce)."""
        self.allreduce_([torch.zeros(1, device=self.device)], abort, timeout_s=timeout_s)

    # -------------------------------------------------------------- point to point
    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Any:
        """Post a send of a contiguous tensor; wait for it with ``wait_all``. Keep the tensor
        alive (unchanged) until then."""
        self._check(None)
        if not tensor.is_contiguous():
            raise ValueError("isend needs a contiguous tensor")
        w = self._post(lambda: self.pg.send([tensor], dst, tag), f"send to {dst}")
        self._p2p.add(id(w))
        return w

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Any:
        """Post a receive into a contiguous tensor (sizes must match the send)."""
        self._check(None)
        if not tensor.is_contiguous():
            raise ValueError("irecv needs a contiguous tensor")
        w = self._post(lambda: self.pg.recv([tensor], src, tag), f"recv from {src}")
        self._p2p.add(id(w))
        return w

    def send(self, tensors: Sequence[Tensor], dst: int, abort: threading.Event | None,
             tag: int = 0, timeout_s: float | None = None) -> None:
        """Send ``tensors`` (in order, all with ``tag``) to ``dst`` and wait."""
        self._check(abort)
        works = [self.isend(t, dst, tag) for t in tensors]
        self.wait_all(works, abort, f"send to {dst}", timeout_s=timeout_s)

    def recv(self, tensors: Sequence[Tensor], src: int, abort: threading.Event | None,
             tag: int = 0, timeout_s: float | None = None) -> None:
        """Receive into ``tensors`` (in order, all with ``tag``) from ``src`` and wait."""
        self._check(abort)
        works = [self.irecv(t, src, tag) for t in tensors]
        self.wait_all(works, abort, f"recv from {src}", timeout_s=timeout_s)

    # -------------------------------------------------------------- release
    def abort(self) -> None:
        """Abandon the group now, from any thread, without blocking: NCCL communicators are
        aborted; a gloo group is parked (its threads may stay stuck until the peer dies).
        Later operations raise Aborted."""
        if self._state in ("aborted", "closed"):
            return
        if self._state == "ok":
            self._state = "aborted"
        self._release(force_park=True)

    def close(self) -> None:
        """Release the group. Without pending work it is destroyed normally (quick); with
        pending work it is aborted and parked like ``abort()``. Idempotent."""
        if self._state == "closed":
            return
        pending = any(not _completed(w) for w in self._pending)
        self._state = "closed" if self._state == "ok" else self._state
        self._release(force_park=pending)
        self._state = "closed"

    def _release(self, force_park: bool) -> None:
        pg, self.pg = self.pg, None
        works, self._pending = self._pending, []
        self._p2p = set()
        store, self._store = self._store, None
        if pg is not None and self._nccl:
            for name in ("abort", "_abort", "shutdown"):
                fn = getattr(pg, name, None)
                if fn is None:
                    continue
                try:
                    fn()
                    break
                except Exception:
                    continue
        if store is not None and hasattr(store, "close"):
            try:
                store.close()
            except Exception:
                pass
        if pg is not None and force_park:
            # not destroyed here: the destructor would join threads stuck on a peer
            # (``reap`` frees it once it cannot block); the store lives as long
            _park(pg, works, nccl=self._nccl, keep=store)
        # else: the last reference goes here; an idle group is destroyed at once

    def __repr__(self) -> str:
        return (f"AbortableGroup({self.backend}, rank={self.rank}/{self.world_size}, "
                f"state={self._state})")


@dataclass
class PendingAllreduce:
    """An all-reduce posted by ``AbortableGroup.allreduce_start``."""

    group: AbortableGroup
    plan: list
    works: list

    def write_back(self) -> None:
        """After the works completed: the sums into the tensors that were given."""
        for flat, wire, ts in self.plan:
            if wire is not flat:
                flat.copy_(wire)
            if flat is not ts[0]:
                unflatten_(flat, ts)


def _completed(w: Any) -> bool:
    try:
        return bool(w.is_completed())
    except Exception:
        return True
