"""Shadow spares: hot spares that already hold the committed training state.

Rank 0 of a generation opens a two-rank gloo group with each spare of the plan (rendezvous on
the NATS store under ``sh<G>.<pod>.<request>.``, once the spare asked under
``shreq<G>.<pod>``; in a background thread, never on the training
thread's path), sends it the committed state once (``send_state``: verified chunk by chunk)
from the live tensors, no copy of them (``TrainState.shared``; the training thread's next
update waits until they are sent, ``first_sent``: usually they are, during the forward and
backward; CUDA: read on a side stream of the stream's thread), and the spare receives it into
its own tensors, then, after each committed step, that step's all-reduced gradients, the module buffers, the
loss and the learning-rate factor. The spare applies the same optimizer and scheduler step,
so it holds the job's committed state bit for bit. When the script comes back to rank 0 for
the next step, rank 0 sends an exact checksum of its modules (``state_word``): the spare
holds (and reports) the step only once its own state gives the same, so anything the script
changes outside ``s.step()`` (an EMA, a clamp) ends the stream instead of going unnoticed. When a fault promotes it, it reports that step and digest like any
member; the state broker counts it among the holders and sends it nothing, so the state
transfer leaves the recovery's critical path.

Whatever goes wrong (a slow, hung or dead spare, a dead rank 0, a gap in the stream, a
checksum that differs, a new generation) ends the stream; the spare then reports the step it
holds (-1 after a divergence) and takes the ordinary state transfer when it is promoted; it
asks for a new stream a few times (``ShadowFollower``), rank 0 serving it from its live
state at its next step boundary. When the job rolls back to its last verified copy
(``agent/verify.py``), rank 0 ends each stream with a ``ROLLBACK`` header naming the copy's
step: a spare holding a later step drops it (those steps were discarded) and asks to follow
again. Rank 0 never waits for a spare's steps (once for its first state, see above): it puts
references on a bounded queue, and a spare that falls ``QUEUE_STEPS`` behind is dropped (it
may ask again, a bounded number of times).

When the job finishes, rank 0 ends each stream with an ``END`` header and both ends close
their pair with nothing pending (``ShadowSender.finish``, ``ShadowReceiver.join``). Without
it the spare's receive helper (a Python thread blocked in gloo, GIL released) returns when
rank 0's process exits, and if that happens while the spare's interpreter is finalizing,
CPython ends the thread with ``pthread_exit``, whose unwinding through C++ frames aborts the
process ("terminate called without an active exception", exit -6): seen on both ends.
"""

from __future__ import annotations

import collections
import hashlib
import math
import queue
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from plumbing import logs

from .collectives import AbortableGroup, Aborted, make_group_abortable
from .hostcopy import HostCopy
from .state import FlatState, TensorState, checksum_of, checksum_words
from .transfer import recv_state, send_state

log = logs.get("agent")

MAGIC = 0x5AD0_5AD0
TAG_HEAD, TAG_SCALARS, TAG_TENSORS = 0x3EB0_0001, 0x3EB0_0002, 0x3EB0_0003
KIND_STEP, KIND_CONFIRM, KIND_END, KIND_ROLLBACK = 1, 2, 3, 4
QUEUE_STEPS = 4          # steps a spare may lag before rank 0 drops it
# steps a spare receives ahead of the one it applies: each is a gradient's worth of memory
# (more would make a spare that lags a moment bigger than a member: issue 43)
AHEAD_STEPS = 1
IDLE_TIMEOUT_S = 86400.0  # a spare waits this long for the next step (a step may be slow)


def store_prefix(generation: int, pod: str, request: str) -> str:
    # Not under "g<G>.": the generation's own store watches that whole prefix. One per
    # request: a restarted spare must not meet the keys of its predecessor's rendezvous.
    return f"sh{generation}.{pod}.{request}."


def layout_hash(tensors: Sequence[Tensor]) -> int:
    """Dtypes and shapes of an update's tensors, as a non-negative int63."""
    text = ";".join(f"{t.dtype}:{tuple(t.shape)}" for t in tensors)
    return zlib.crc32(text.encode()) | (len(tensors) << 32)


class PendingWord:
    """``state_word`` begun on the device: every tensor's two sums in one int64 tensor per
    device, on its way to the host (``HostCopy``); ``result()`` reads it (rank 0's stream
    thread does, so the training thread does not wait for it)."""

    def __init__(self, names: list[str], sizes: list[int],
                 parts: list[tuple[list[int], Tensor]]) -> None:
        self._names, self._sizes = names, sizes
        self._parts = [(idx, HostCopy(w)) for idx, w in parts]
        self._word: int | None = None

    def result(self) -> int:
        if self._word is None:
            got: list[Any] = [None] * len(self._names)
            for idx, copy in self._parts:
                for j, w in zip(idx, copy.get().numpy().tolist()):
                    got[j] = w
            h = hashlib.blake2b(digest_size=8)
            for name, w, n in zip(self._names, got, self._sizes):
                h.update(name.encode())
                h.update(checksum_of(w, n).to_bytes(40, "little"))
            self._word = int.from_bytes(h.digest(), "little", signed=True)
        return self._word


def state_word_begin(modules: Sequence[torch.nn.Module]) -> PendingWord:
    """``state_word`` begun on the device, read later: no host sync to begin it."""
    names: list[str] = []
    sizes: list[int] = []
    words: dict[torch.device, list[tuple[int, Tensor]]] = {}
    for i, m in enumerate(modules):
        for k, t in m.state_dict().items():
            t = t.detach().reshape(-1)  # on its device: a CUDA model is not copied to the host
            if not t.is_contiguous() or (t.storage_offset() * t.element_size()) % 8:
                t = t.clone()  # the checksum reads 8-byte words from an aligned start
            u8 = t.view(torch.uint8)
            words.setdefault(u8.device, []).append((len(names), checksum_words(u8)))
            names.append(f"{i}.{k}")
            sizes.append(u8.numel())
    return PendingWord(names, sizes, [([j for j, _ in ws], torch.stack([w for _, w in ws]))
                                      for ws in words.values()])


def state_word(modules: Sequence[torch.nn.Module]) -> int:
    """An exact check of every tensor in the modules' state dicts (parameters and buffers), as
    one signed int64: any changed 64-bit word changes it (``state._checksum_u8`` per tensor,
    wrapping integer sums: the same value on any device). About 6 ms for 10M parameters on one
    CPU thread; CUDA tensors are summed on their GPU and come to the host in one read per
    device (``state_word_begin``: begun on the training thread, read on another)."""
    return state_word_begin(modules).result()


def _pair(store_factory: Callable[[], Any], rank: int, abort: threading.Event, slice_s: float,
          timeout_s: float) -> AbortableGroup:
    """The two-rank gloo group of one stream (rank 0 sends, rank 1 is the spare). Rank 0
    answers a request at its next step boundary and the next step comes when it comes: the
    rendezvous and the group's own waits outlast any step; our waits use ``timeout_s``."""
    pg = make_group_abortable(store_factory(), rank, 2, abort, timeout_s=IDLE_TIMEOUT_S,
                              backend="gloo", slice_s=slice_s)
    return AbortableGroup(pg, slice_s=slice_s, timeout_s=timeout_s)


@dataclass
class Update:
    """One committed step: reduced gradients (in ``TrainState.params()`` order), then the module
    buffers, the step's loss, learning-rate factor and whether the update was skipped."""

    step: int
    loss: float | None
    lr_factor: float
    tensors: list[Tensor]
    skip: bool = False  # fp16: the GradScaler skipped the update (gradients not finite)
    # the optimizers' hyper-parameters this update used (``TrainState.hypers``): a script
    # that sets ``param_group['lr']`` in its loop is followed too
    hypers: list[float] = field(default_factory=list)
    # CUDA: the tensors are host copies made on a side stream; wait for this event first
    ready: Any = None


@dataclass
class Confirm:
    """Rank 0's ``state_word`` when the script came back for the next step (after whatever it
    did between steps): the spare holds ``step`` only once its own state gives the same.
    ``check``: the word, or on rank 0 a ``PendingWord`` its stream thread reads."""

    step: int
    check: Any


@dataclass
class Rollback:
    """The job went back to the verified copy of ``step``: every later step was discarded."""

    step: int


_END = object()  # queued by ShadowSender.finish
WAITING, STALE, SENDING, STREAMING = "waiting", "stale", "sending", "streaming"  # a sender's


class ShadowSender:
    """Rank 0's stream to one spare (its own thread and two-rank group)."""

    def __init__(self, pod: str, store_factory: Callable[[], Any],
                 state: TensorState | FlatState, step: int, *, timeout_s: float,
                 slice_s: float, stream: Any = None) -> None:
        self.pod = pod
        self._store_factory = store_factory
        # the first state: live tensors (``TrainState.shared``) or a frozen copy; CUDA:
        # ``stream``, a side stream that waits for the training stream's work that made it.
        # ``_phase`` (under ``_lock``): WAITING (for the pair), STALE (the state changed
        # before the pair was up: ``renew`` at the next step boundary), SENDING, STREAMING.
        self._lock = threading.Lock()
        self._phase = WAITING
        self._state: TensorState | FlatState | None = state
        self._stream = stream
        # set once the first state is out (or the stream ended): until then rank 0's update
        # waits (``ShadowLeader.hold``), the state being sent from the tensors it changes
        self.first_sent = threading.Event()
        self._expect = step + 1
        self._timeout_s, self._slice_s = timeout_s, slice_s
        # + 1: room for the END (or ROLLBACK) of a stream that is full when it is queued
        self._q: queue.Queue[Any] = queue.Queue(maxsize=2 * QUEUE_STEPS + 1)
        self._abort = threading.Event()
        self.ended: str | None = None  # why the stream ended (None: running)
        self._thread = threading.Thread(target=self._run, name=f"shadow-to-{pod}", daemon=True)
        self._thread.start()

    def before_change(self) -> bool:
        """Rank 0 is about to change its state: True if the first state is being sent now
        (the caller waits for ``first_sent``); a stream still connecting gets its first state
        anew at the next step boundary (``renew``), the one it holds going stale."""
        with self._lock:
            if self._phase == WAITING and isinstance(self._state, TensorState):  # live
                self._phase, self._state, self._stream = STALE, None, None
            return self._phase == SENDING

    @property
    def stale(self) -> bool:
        return self._phase == STALE

    @property
    def streaming(self) -> bool:
        """The first state is out: what is queued after it (steps, their confirmations:
        copies, not the live state) can still follow once rank 0 moves on. A first state
        still being sent reads the live tensors, which a new plan may write (a recipient)."""
        return self._phase == STREAMING and self.ended is None

    def renew(self, state: TensorState | FlatState, step: int, stream: Any = None) -> None:
        """The first state of a stream still connecting, taken again (``step``'s)."""
        with self._lock:
            if self._phase in (WAITING, STALE):
                self._phase, self._state, self._stream = WAITING, state, stream
                self._expect = step + 1

    def offer(self, u: Update | Confirm) -> None:
        """Queue a committed step or its confirmation (never blocks); none while the first
        state is stale (the one renewed is after them)."""
        if self.ended is not None or self._phase == STALE:
            return
        try:
            self._q.put_nowait(u)
        except queue.Full:
            self._end(f"spare fell {QUEUE_STEPS} steps behind")

    def close(self) -> None:
        self._end("closed")

    def finish(self) -> None:
        """Send END after what is queued, then close the pair (the job is done, or a new
        plan: the spare it promotes gets the steps committed before it)."""
        if self.ended is not None:
            return
        try:
            self._q.put_nowait(_END)
        except queue.Full:
            self._end("closed")

    def rollback(self, step: int) -> None:
        """The job rolled back to ``step``: send ROLLBACK after what is queued, then end."""
        if self.ended is not None:
            return
        try:
            self._q.put_nowait(Rollback(step))
        except queue.Full:
            self._end("closed")

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the stream's thread to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
            if why != "closed":
                log.warning("shadow stream to spare ended", spare=self.pod, reason=why)
        self._abort.set()

    def _run(self) -> None:
        group = None
        try:
            group = _pair(self._store_factory, 0, self._abort, self._slice_s, self._timeout_s)
            state = self._take_first()
            if state is None:
                return
            self._send_first(group, state)
            del state
            with self._lock:
                self._phase = STREAMING
            self.first_sent.set()
            while not self._abort.is_set():
                try:
                    u = self._q.get(timeout=self._slice_s * 4)
                except queue.Empty:
                    continue
                if u is _END:
                    head = torch.tensor([MAGIC, KIND_END, 0, 0], dtype=torch.int64)
                    group.send([head], 1, self._abort, TAG_HEAD, timeout_s=self._timeout_s)
                    self.ended = "finished"
                    break
                if isinstance(u, Rollback):
                    head = torch.tensor([MAGIC, KIND_ROLLBACK, u.step, 0], dtype=torch.int64)
                    group.send([head], 1, self._abort, TAG_HEAD, timeout_s=self._timeout_s)
                    self.ended = "rolled back"
                    break
                if isinstance(u, Confirm):
                    check = u.check if isinstance(u.check, int) else u.check.result()
                    head = torch.tensor([MAGIC, KIND_CONFIRM, u.step, check], dtype=torch.int64)
                    group.send([head], 1, self._abort, TAG_HEAD, timeout_s=self._timeout_s)
                    continue
                if u.step != self._expect:
                    raise RuntimeError(f"stream gap: step {u.step} after {self._expect - 1}")
                self._send(group, u)
                self._expect += 1
        except Aborted:
            pass
        except Exception as e:  # the spare died, hung or refused: training goes on
            self._end(f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            self._state = None
            self.first_sent.set()
            if group is not None:
                group.close()

    def _take_first(self) -> TensorState | FlatState | None:
        """The first state, once the pair is up: as served, or renewed at a step boundary
        when it went stale meanwhile (None: the stream ended first)."""
        while not self._abort.is_set():
            with self._lock:
                if self._phase == WAITING:
                    state, self._state, self._phase = self._state, None, SENDING
                    return state
            self._abort.wait(self._slice_s)
        return None

    def _send_first(self, group: AbortableGroup, state: TensorState | FlatState) -> None:
        """The first state, from rank 0's live tensors. CUDA: read (digest, checksums, the
        piece-by-piece copies to pinned host memory, at most two windows) on ``stream``,
        never on the training stream; done once every read has completed on the host, so
        the update may then change the tensors."""
        if self._stream is None:
            send_state(group, state, 0, {1: [0]}, self._abort, timeout_s=self._timeout_s)
            return
        try:
            with torch.cuda.stream(self._stream):
                send_state(group, state, 0, {1: [0]}, self._abort, timeout_s=self._timeout_s)
        finally:  # aborted too: nothing reads the tensors once the update may change them
            self._stream.synchronize()

    def _send(self, group: AbortableGroup, u: Update) -> None:
        head = torch.tensor([MAGIC, KIND_STEP, u.step, layout_hash(u.tensors)],
                            dtype=torch.int64)
        loss = math.nan if u.loss is None else float(u.loss)
        scalars = torch.tensor([loss, u.lr_factor, float(u.skip), *u.hypers],
                               dtype=torch.float64)
        if u.ready is not None:  # rank 0 copied the step to host memory on a side stream
            u.ready.synchronize()
        tensors = [t.detach().to("cpu").contiguous() for t in u.tensors]  # host already: no copy
        works = [group.isend(head, 1, TAG_HEAD), group.isend(scalars, 1, TAG_SCALARS)]
        works += [group.isend(t, 1, TAG_TENSORS) for t in tensors]
        group.wait_all(works, self._abort, "shadow step", timeout_s=self._timeout_s)


class ShadowReceiver:
    """A spare's end: receives in a background thread; the training thread ``take()``s the
    items (``("state", TensorState)`` first, then ``("step", Update)`` and ``("confirm",
    Confirm)`` in order, the stream's last maybe ``("rollback", Rollback)``) and applies
    them. ``notify`` is called (from the background thread) whenever an item arrives.
    ``into(skeleton) -> (tensors, in place)``: where the first state goes (``state.destinations``:
    the spare's own tensors; only when it holds no step, since a failed receive leaves them
    garbage); None: new tensors. A step is received only while fewer than ``AHEAD_STEPS``
    wait to be applied (the first state counts as one)."""

    def __init__(self, store_factory: Callable[[], Any], templates: Sequence[Tensor],
                 notify: Callable[[], None], *, timeout_s: float, slice_s: float,
                 hypers: int = 0, into: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self._store_factory = store_factory
        self._into = into
        self._hypers = hypers  # how many hyper-parameters each Update carries
        self._templates = [(t.shape, t.dtype) for t in templates]
        self._lh = layout_hash(templates)
        self._notify = notify
        self._timeout_s, self._slice_s = timeout_s, slice_s
        self._items: collections.deque[tuple[str, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._room = threading.Event()  # set by take(): the receive may go on at once
        self.ended: str | None = None
        self.connected = False  # the pair with rank 0 is built (rank 0 answered)
        self.got_state = False  # the state arrived (an ask that ended without it failed)
        self._thread = threading.Thread(target=self._run, name="shadow-from-rank0", daemon=True)
        self._thread.start()

    def ready(self) -> bool:
        return bool(self._items)

    def take(self, n: int | None = None) -> list[tuple[str, Any]]:
        """The first ``n`` items that arrived (all: None)."""
        with self._lock:
            k = len(self._items) if n is None else min(n, len(self._items))
            out = [self._items.popleft() for _ in range(k)]
        self._room.set()
        return out

    def close(self) -> None:
        if self.ended is None:
            self.ended = "closed"
        self._abort.set()
        self._room.set()
        if self._into is not None and not self.got_state \
                and threading.current_thread() is not self._thread:
            # a piece may be on its way into the spare's own tensors: done before anything
            # else (a promoted spare's state transfer) writes them
            self._thread.join(self._timeout_s)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the stream to end by itself (rank 0's END, or rank 0
        gone), before ``close``: a pod that exits with the receive still pending may crash in
        its interpreter's teardown (module docstring). True if it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _wait_room(self) -> None:
        """Until fewer than ``AHEAD_STEPS`` wait to be applied (woken by ``take``)."""
        while not self._abort.is_set():
            self._room.clear()
            if self._ahead() < AHEAD_STEPS:
                return
            self._room.wait(self._slice_s)

    def _ahead(self) -> int:
        """The states and steps that arrived and wait to be applied."""
        with self._lock:
            return sum(1 for kind, _ in self._items if kind in ("state", "step"))

    def _push(self, item: tuple[str, Any]) -> None:
        with self._lock:
            self._items.append(item)
        self._notify()

    def _run(self) -> None:
        group = None
        try:
            group = _pair(self._store_factory, 1, self._abort, self._slice_s, self._timeout_s)
            self.connected = True
            self._push(("state", recv_state(group, 1, [0], self._abort,
                                            timeout_s=self._timeout_s, into=self._into)))
            self.got_state = True
            self._wait_room()  # the state is applied before a step's gradients arrive
            while not self._abort.is_set():
                item = self._recv(group)
                if item is None:  # rank 0 ended the stream: the job is done, or a new plan
                    if self.ended is None:
                        self.ended = "finished"
                    break
                if item[0] == "rollback":  # rank 0's last word on this stream
                    self._push(item)  # first: an ended stream with nothing left is asked anew
                    self.ended = self.ended or "rolled back"
                    break
                self._push(item)
                self._wait_room()  # the training thread applies it; rank 0 drops us if we lag
        except Aborted:
            pass
        except Exception as e:
            if self.ended is None:
                self.ended = f"{type(e).__name__}: {str(e)[:200]}"
                log.info("shadow stream from rank 0 ended", reason=self.ended)
            self._notify()
        finally:
            if group is not None:
                group.close()

    def _recv(self, group: AbortableGroup) -> tuple[str, Update | Confirm | Rollback] | None:
        """The next item; None when rank 0 ended the stream."""
        head = torch.zeros(4, dtype=torch.int64)
        group.wait_all([group.irecv(head, 0, TAG_HEAD)], self._abort, "shadow head",
                       timeout_s=IDLE_TIMEOUT_S)
        magic, kind, step, value = head.tolist()
        if magic != MAGIC or kind not in (KIND_STEP, KIND_CONFIRM, KIND_END, KIND_ROLLBACK):
            raise ValueError(f"bad shadow header {head.tolist()}")
        if kind == KIND_END:
            return None
        if kind == KIND_ROLLBACK:
            return "rollback", Rollback(step=int(step))
        if kind == KIND_CONFIRM:
            return "confirm", Confirm(step=int(step), check=int(value))
        if value != self._lh:
            raise ValueError("rank 0's gradients do not match this spare's parameters "
                             f"(layout {value:x} != {self._lh:x})")
        scalars = torch.zeros(3 + self._hypers, dtype=torch.float64)
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in self._templates]
        works = [group.irecv(scalars, 0, TAG_SCALARS)]
        works += [group.irecv(t, 0, TAG_TENSORS) for t in tensors]
        group.wait_all(works, self._abort, "shadow step", timeout_s=self._timeout_s)
        loss, f, skip, *hypers = scalars.tolist()
        return "step", Update(step=int(step), loss=None if math.isnan(loss) else loss,
                              lr_factor=f, tensors=tensors, skip=skip != 0.0, hypers=hypers)
