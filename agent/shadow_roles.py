"""The two ends of shadow spares, as the Session uses them (``agent/shadow.py`` has the wire).

``ShadowLeader`` (rank 0 of a generation): answers the spares that ask to follow (their KV
requests), streams the committed state once (from the live tensors: no copy of the state; the
next update waits until they are out, ``hold``), then every committed step, and a checksum of
the state the script came back with. ``ShadowFollower`` (a spare): asks rank 0 to stream,
applies what arrives to the ``TrainState`` with the members' own update, and holds a step
once rank 0 confirmed it; when the state stops matching it holds nothing and takes the
ordinary transfer when promoted. An ask whose stream failed (before or after the state
arrived; or no answer in time) is made again, ``ASK_TRIES`` asks at most per generation,
with a growing pause (the steps held meanwhile stay held); after a rollback of the job
(ROLLBACK on the stream) a spare holding a discarded step drops it and asks again. See
docs/architecture.md, "Shadow spares".
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import torch

from schemas.messages import Plan
from plumbing import logs

from .config import AgentConfig
from .ports import ShadowRuntime
from .train_state import TrainState

log = logs.get("agent")
# how long a promoted spare waits for rank 0 to end its stream (the last committed step and
# its confirmation come before the END; the group it builds meanwhile waits for rank 0 too)
SETTLE_S = 0.5
# at the end of the job: how long rank 0 waits for its streams' END to go out, and a spare
# for its stream to end (bounded: a stuck peer must not hold the exit)
END_WAIT_S = 2.0
# a spare's asks to follow that got no state: how many per generation, the first pause
# between two (doubled each time)
ASK_TRIES = 4
ASK_BACKOFF_S = 1.0


def why_not(cfg: AgentConfig, state: TrainState) -> str | None:
    """Why spares cannot follow this job (None: they can). The pair group is gloo whatever
    the job's backend; CUDA tensors go through host memory."""
    if not cfg.shadow_spares:
        return "off (CEASELESS_SHADOW_SPARES=0)"
    return state.replayable()  # the spare must replay what the script does


def _store(rt: ShadowRuntime, generation: int, pod: str, rid: str,
           timeout: float | None = None) -> Callable[[], Any]:
    from .shadow import store_prefix

    prefix = store_prefix(generation, pod, rid)
    return lambda: rt.stores.rendezvous(prefix, timeout)


def _request_key(generation: int, pod: str = "") -> str:
    """The store key a spare writes to ask rank 0 of ``generation`` to stream to it."""
    return f"shreq{generation}.{pod}"


class ShadowLeader:
    """Rank 0's streams to the spares of one generation at a time."""

    def __init__(self, rt: ShadowRuntime, cfg: AgentConfig, state: TrainState) -> None:
        self._rt, self._cfg, self._state = rt, cfg, state
        self._out: dict[str, Any] = {}      # spare pod -> ShadowSender
        self._ending: list[Any] = []        # streams sending their ROLLBACK
        self._served: dict[str, str] = {}   # spare pod -> the request it answered
        self.generation = 0                 # the generation spares may follow (0: none)
        # spare pod -> request id, written by the runtime's thread (the store watch)
        self._lock = threading.Lock()
        self._requests: dict[str, str] = {}
        self._watching: int | None = None
        self._unwatch: Callable[[], None] | None = None
        self._stream: Any = None            # CUDA: the side stream of the copies to spares
        state.before_change = self.hold     # the update waits for a first state in flight

    @property
    def streaming(self) -> bool:
        return bool(self._out)

    def lead(self, plan: Plan) -> None:
        """Stream the committed state, then every committed step, to each spare that asks
        (the plan's spares at once, later ones at a step boundary)."""
        g = self.generation = plan.generation
        self._watch(g)
        for pod in plan.spares:
            rid = self._rt.stores.get(_request_key(g, pod))
            if rid is not None:
                self._serve(pod, rid.decode())

    def hold(self) -> None:
        """Before the update (or a restore) changes the state: wait until every first state
        in flight is sent (it is sent from the live tensors). Usually done already: it went
        out during the forward and backward. A stream that takes longer than the collective
        timeout is ended (the spare asks again): a spare never holds the job up for long."""
        for out in list(self._out.values()) + self._ending:
            if not out.before_change() or out.first_sent.is_set():
                continue  # sent, or not begun (then renewed at the next step boundary)
            t0 = time.monotonic()
            if not out.first_sent.wait(self._cfg.collective_timeout):
                log.warning("a spare's first state is not out by the next update: its "
                            "stream ends", spare=out.pod)
                out.close()  # what it still sends is torn: the spare's checks refuse it
            else:
                log.info("the update waited for a spare's first state", spare=out.pod,
                         waited_s=round(time.monotonic() - t0, 3))

    def _first(self) -> tuple[Any, Any]:
        """A spare's first state (the live one: ``TrainState.shared``) and, CUDA, the side
        stream it is read on, waiting for what the training stream queued so far (a
        device-side wait, no host sync)."""
        state, side, dev = self._state.shared(), None, self._state.device
        if dev.type == "cuda":  # after the buffers' copies, queued by shared()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
        return state, side

    def _renew(self, step: int) -> None:
        """Streams whose first state went stale before they connected: take it again."""
        for out in list(self._out.values()) + self._ending:
            if out.stale:
                state, side = self._first()
                out.renew(state, step, side)

    def _watch(self, generation: int | None) -> None:
        """Collect the spares asking to follow ``generation`` (None: stop)."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        with self._lock:
            self._requests, self._watching = {}, generation
        if generation is None:
            return

        def on_put(pod: str, rid: bytes) -> None:
            with self._lock:
                if self._watching == generation:  # not a late one of an older watch
                    self._requests = {**self._requests, pod: rid.decode()}

        self._unwatch = self._rt.stores.watch(_request_key(generation), on_put)

    def _serve(self, pod: str, rid: str) -> None:
        """Start a stream to ``pod``, its first state the live one (``_first``)."""
        from .shadow import ShadowSender

        old = self._out.pop(pod, None)
        if old is not None:
            old.close()
        self._served[pod] = rid
        state, side = self._first()
        self._out[pod] = ShadowSender(
            pod, _store(self._rt, self.generation, pod, rid), state,
            self._state.last_committed, timeout_s=self._cfg.collective_timeout,
            slice_s=self._cfg.collective_slice, stream=side)

    def rollback(self, step: int) -> None:
        """The job went back to the verified copy of ``step`` (``agent/verify.py``): each
        stream ends with ROLLBACK, so no spare holds or reports a discarded step; each then
        asks anew and is served from a step computed again (``confirm``)."""
        self._renew(step)  # a stream still connecting starts from the restored state
        for out in self._out.values():
            out.rollback(step)
        self._ending = [o for o in self._ending if o.ended is None] + list(self._out.values())
        self._out = {}
        if self._ending:
            log.info("rollback: spares told to drop the discarded steps", step=step,
                     spares=len(self._ending))

    def end(self, final: bool = False, wait_s: float = END_WAIT_S) -> None:
        """Stop streaming. ``final`` (the job is done): each spare gets END and its stream is
        waited for up to ``wait_s`` in all, so no receive is left pending when both ends exit
        (``agent/shadow.py``). Else (a new plan) a stream under way gets END after what is
        queued too, not waited for: a spare the plan promotes takes the last committed step
        and its confirmation before it reports (``ShadowFollower.settle``; closed, a loaded
        rank 0 dropped them and the spare needed a transfer); one still connecting, or still
        sending its first state from the live tensors, closes."""
        outs = list(self._out.values())
        if final:
            self._renew(self._state.last_committed)  # the final state: it changes no more
        for out in outs:
            out.finish() if final or out.streaming else out.close()
        if final:
            deadline = time.monotonic() + wait_s
            for out in outs:
                if not out.join(max(0.0, deadline - time.monotonic())):
                    out.close()
        for out in self._ending if final else ():  # else each ends once its ROLLBACK is out
            out.close()
        self._out, self._served, self._ending = {}, {}, []
        if self.generation:
            self.generation = 0
            self._watch(None)

    def offer(self, s: int, grads: list[torch.Tensor], f: float, skip: bool = False,
              hypers: list[float] | None = None) -> None:
        """Step ``s`` committed with these reduced gradients, learning-rate factor and
        optimizer hyper-parameters (``skip``: the fp16 scaler skipped its update)."""
        from .shadow import Update

        if all(out.stale for out in self._out.values()):
            return  # none streams yet (each is renewed at the next step boundary)
        bufs = [b.detach().clone() for b in self._state.buffers()]  # the next forward changes them
        tensors, ready = list(grads) + bufs, None
        if any(t.is_cuda for t in tensors):
            tensors, ready = self._to_host(tensors)
        u = Update(step=s, loss=self._state.loss, lr_factor=f, tensors=tensors,
                   skip=skip, hypers=list(hypers or []), ready=ready)
        for out in self._out.values():  # one copy, shared by every spare's stream
            out.offer(u)

    def _to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """One device-to-host copy of a step's tensors for every spare, on a side stream (not
        the training stream), into pinned memory; the queues then hold no GPU tensor (issue
        34). Returns the host tensors and the event the senders wait for."""
        dev = next(t.device for t in tensors if t.is_cuda)
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(dev))  # the gradients are final here
        host = []
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(computed)
            for t in tensors:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                if t.is_cuda:  # its memory is not reused before the copy read it
                    t.record_stream(self._stream)
                host.append(h)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return host, ready

    def confirm(self, s: int) -> None:
        """Back from the script after committing ``s``: the state the spares must hold
        (anything the script did between steps included); spares that asked since the last
        step start here, from that state (live: ``_serve``)."""
        from .shadow import Confirm, state_word_begin

        if not all(out.stale for out in self._out.values()):
            # the word is read on each stream's thread: no host sync here
            c = Confirm(step=s, check=state_word_begin(self._state.modules()))
            for out in self._out.values():
                out.offer(c)
        self._renew(s)
        with self._lock:
            reqs = self._requests
        new = sorted(p for p, rid in reqs.items() if self._served.get(p) != rid)
        for pod in new:
            self._serve(pod, reqs[pod])


class ShadowFollower:
    """A spare's stream from rank 0 and what it applies."""

    def __init__(self, rt: ShadowRuntime, cfg: AgentConfig, state: TrainState) -> None:
        self._rt, self._cfg, self._state = rt, cfg, state
        self._in: Any = None
        self._at = -1                       # the last step applied (held once confirmed)
        self._loss: float | None = None
        # the asks of this generation: its plan (None: not asking), how many were made,
        # when the last was, and when the next is due (None: none due)
        self._plan: Plan | None = None
        self._asks = 0
        self._asked_at = 0.0
        self._retry_at: float | None = None

    @property
    def following(self) -> bool:
        """Following rank 0, or about to ask again (promoted: ``settle`` then ``stop``)."""
        return self._in is not None or self._retry_at is not None

    def ready(self) -> bool:
        """Something arrived to apply, or an ask is due again (training thread)."""
        return (self._in is not None and self._in.ready()) or self._due()

    def follow(self, plan: Plan) -> None:
        """A spare of ``plan``: follow its rank 0 (ends any older stream)."""
        self.stop()
        if why_not(self._cfg, self._state) is not None or not plan.members:
            return
        self._plan = plan
        self._ask()

    def _ask(self) -> None:
        """Ask rank 0 to stream to this spare (a new request each time)."""
        from .shadow import IDLE_TIMEOUT_S, ShadowReceiver

        rt, plan = self._rt, self._plan
        assert plan is not None
        self._asks += 1
        self._at = self._state.last_committed
        self._asked_at = time.monotonic()
        rid = f"{os.getpid()}-{time.time_ns()}"  # unique per ask: a restarted spare asks anew
        if not rt.stores.put(_request_key(plan.generation, self._cfg.pod), rid.encode()):
            return self._failed("could not write the request")
        # holding no step, the state goes into the spare's own tensors (no second copy);
        # holding one, into new ones: a stream that fails half-way must not spoil it
        into = self._state.destinations if self._at < 0 else None
        self._in = ShadowReceiver(
            _store(rt, plan.generation, self._cfg.pod, rid, IDLE_TIMEOUT_S),
            self._state.params() + self._state.buffers(), rt.notify,
            timeout_s=self._cfg.collective_timeout, slice_s=self._cfg.collective_slice,
            hypers=len(self._state.hypers()), into=into)

    def _failed(self, why: str) -> None:
        """The last ask got no state: the next one after a pause, or none (tries used up)."""
        if self._asks >= ASK_TRIES:
            log.warning("spare stops asking to follow the job this generation; it takes the "
                        "state transfer when promoted", asks=self._asks, reason=why)
            self._plan = None
            return
        pause = ASK_BACKOFF_S * 2 ** (self._asks - 1)
        log.info("the spare's ask to follow got no state; asking again", reason=why,
                 asks=self._asks, pause_s=pause)
        self._retry_at = time.monotonic() + pause

    def _due(self) -> bool:
        """A new ask is due: the stream failed (everything it delivered applied), or rank 0
        did not answer the ask (it answers at its next step boundary: within the recovery
        timeout, then the rendezvous within the store timeout). A stream that ended with
        the job (END), or was closed here, is not asked again."""
        src, why = self._in, None
        if src is not None and not src.ready():
            if src.ended not in (None, "finished", "closed", "rolled back"):
                why = src.ended
            elif src.ended is None and not src.connected and (
                    time.monotonic() - self._asked_at
                    > self._cfg.recovery_timeout + self._cfg.store_timeout):
                why = "rank 0 did not answer"
        if why is not None:
            src.close()
            self._in = None
            if self._at != self._state.last_committed:  # a step applied, never confirmed
                self._diverged(f"step {self._at} applied but not confirmed")
            self._failed(why)
        return self._retry_at is not None and time.monotonic() >= self._retry_at

    def settle(self, wait_s: float = SETTLE_S) -> None:
        """Promoted: apply what arrives until the stream ends, at most ``wait_s``. Rank 0
        ends it at the plan with END after what it queued (``ShadowLeader.end``), so the
        spare holds the members' last committed step and its confirmation, even when they
        were still on their way (a loaded machine: the spare one step behind needed the
        state transfer, and a corrupt replica met by that handoff stood one against one).
        This runs while the group is built, which waits for rank 0 anyway; a stream that
        ended (rank 0 died) is not waited for."""
        deadline = time.monotonic() + wait_s
        self._retry_at = None  # promoted: no more asks
        while True:
            self.apply()
            src = self._in
            if src is None or time.monotonic() >= deadline:
                return
            if src.ended is not None:
                self.apply()  # what it delivered before it ended
                return
            time.sleep(0.005)

    def stop(self, quiet: bool = False, drain_s: float = 0.0) -> None:
        """End the stream; a step applied but not confirmed leaves state matching no step.
        ``drain_s``: first wait that long for rank 0 to end it (the job finished)."""
        self._plan, self._asks, self._retry_at = None, 0, None  # no ask after this
        if self._in is not None:
            if drain_s > 0:
                self._in.join(drain_s)
            self._in.close()
            self._in = None
            if self._at != self._state.last_committed and not quiet:
                self._diverged(f"step {self._at} applied but not confirmed")

    def apply(self, n: int | None = None) -> None:
        """Training thread: apply what the stream delivered (the first ``n`` items; None:
        all). A step is applied when it arrives and held (``last_committed``, the heartbeat)
        once confirmed."""
        if self._retry_at is not None and time.monotonic() >= self._retry_at:
            self._retry_at = None
            self._ask()
        src, st = self._in, self._state
        if src is None:
            return
        from .shadow import state_word

        for kind, val in src.take(n):
            if kind == "state":
                self._at = st.restore(val)
                st.zero_grad()
            elif kind == "step":
                if val.step != self._at + 1:
                    return self._diverged(f"step {val.step} after {self._at}")
                params, bufs = st.params(), st.buffers()
                with torch.no_grad():
                    for b, v in zip(bufs, val.tensors[len(params):]):
                        b.copy_(v)
                for p, g in zip(params, val.tensors):
                    p.grad = g if g.device == p.device else g.to(p.device)
                st.set_hypers(val.hypers)  # as rank 0's script set them for this step
                st.update(val.lr_factor, val.skip)
                st.zero_grad()
                self._at, self._loss = val.step, val.loss
                continue
            elif kind == "rollback":
                return self._rolled_back(val.step)
            else:
                if val.step != self._at:
                    return self._diverged(f"confirmation of step {val.step}, holding {self._at}")
                if state_word(st.modules()) != val.check:
                    return self._diverged(
                        f"state differs from rank 0's after step {val.step} (does the script "
                        "change registered state outside s.step(): a module, an EMA, an "
                        "optimizer setting such as param_group['lr']?)")
                st.last_committed, st.loss = val.step, self._loss
            self._rt.update(step=st.last_committed, digest=st.digest())

    def _rolled_back(self, step: int) -> None:
        """Rank 0 rolled the job back to its verified copy of ``step`` and ended the stream:
        a later step held (or applied) was discarded, so it is dropped, never reported; then
        ask again (rank 0 serves the ask from a step computed again)."""
        self._in.close()
        self._in = None
        if max(self._at, self._state.last_committed) > step \
                or self._at != self._state.last_committed:  # or a step applied, unconfirmed
            log.info("the job rolled back: the spare drops the discarded steps", to_step=step,
                     held=self._state.last_committed)
            self._state.forget()
            self._state.zero_grad()
            self._rt.update(now=True, step=-1, digest="")
        self._asks = 0  # not a failed ask
        if self._plan is not None:
            self._ask()

    def _diverged(self, why: str) -> None:
        """The followed state is not the job's: hold nothing (the broker then sends it)."""
        log.warning("spare stops following the job; it takes the state transfer when promoted",
                    reason=why)
        if self._in is not None:
            self._in.close()
            self._in = None
        self._state.forget()
        self._at = -1
        self._state.zero_grad()
        self._rt.update(now=True, step=-1, digest="")
