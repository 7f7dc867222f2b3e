"""The agent's ports (agent/ports.py, issue 29): the real runtime and membership satisfy
them, and parts run against small fakes that satisfy them (no bus, no process group)."""

from __future__ import annotations

import inspect
import threading
from typing import Any, Protocol

import pytest
import torch

from agent import ports, solo
from agent.config import AgentConfig
from agent.incident import Timeline
from agent.membership import Membership
from agent.reduction import FusedReduction, OverlappedReduction, ShardedReduction
from agent.runtime import Runtime
from agent.script_batch import check_plan_batch
from agent.stepper import Stepper
from agent.train_state import TrainState
from agent.vocab import Aborted, CollectiveTimeout, Phase
from schemas.messages import Member, Plan, ReportKind
from schemas.policy import SCRIPT_KEY, ScriptInfo

pytestmark = pytest.mark.timeout(60)


def _members(proto: type) -> dict[str, Any]:
    """A Protocol's members (its own and its bases'): name -> the declared function,
    property or annotation."""
    out: dict[str, Any] = {}
    for c in reversed(proto.__mro__):
        if c is Protocol or not getattr(c, "_is_protocol", False):
            continue
        out.update(c.__dict__.get("__annotations__", {}))
        out.update({n: v for n, v in c.__dict__.items() if not n.startswith("_")
                    and (inspect.isfunction(v) or isinstance(v, property))})
    return out


def _missing(obj: Any, proto: type) -> list[str]:
    """What ``obj`` lacks of ``proto``: members, or a method's parameters."""
    gaps = []
    for name, decl in _members(proto).items():
        if not hasattr(obj, name):
            gaps.append(name)
            continue
        if inspect.isfunction(decl):
            want = [p for p in inspect.signature(decl).parameters.values() if p.name != "self"]
            have = inspect.signature(getattr(obj, name)).parameters
            if any(p.kind is p.VAR_KEYWORD for p in have.values()):
                continue
            gaps += [f"{name}({p.name})" for p in want if p.kind is not p.VAR_KEYWORD
                     and p.name not in have]
    return gaps


def _cfg(**kw: Any) -> AgentConfig:
    return AgentConfig(nats_url="nats://unused:4222", job="test", pod="p0", **kw)


def _plan(members: list[str], g: int = 1) -> Plan:
    n = len(members)
    return Plan(generation=g, members=[Member(pod=p, rank=r) for r, p in enumerate(members)],
                world_size=n, global_batch_size=4 * n, micro_batch_size=4,
                shares={r: 1 for r in range(n)})


RUNTIME_PORTS = [ports.Heartbeats, ports.Reports, ports.SoloRuntime, ports.InjectRuntime,
                 ports.KVRuntime, ports.ShadowRuntime, ports.PrejoinRuntime,
                 ports.HandoffRuntime, ports.StepRuntime, ports.MembershipRuntime]


def test_the_runtime_and_the_membership_satisfy_their_ports():
    cfg = _cfg()
    rt = Runtime(cfg)  # not started: no bus needed to look at it
    for proto in RUNTIME_PORTS:
        assert _missing(rt, proto) == [], proto.__name__
    state = TrainState()
    state.register(model=torch.nn.Linear(3, 2))
    m = Membership(cfg, rt, state, Timeline())
    for proto in (ports.Entrant, ports.Resumer, ports.StepMember, ports.Placement):
        assert _missing(m, proto) == [], proto.__name__
    assert _missing(state, ports.HeldState) == []
    assert _missing(Timeline(), ports.Incidents) == []


# ---------------------------------------------------------------------------- fakes
class FakeKV:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.puts: list[tuple[str, bytes]] = []

    def put(self, key: str, value: bytes) -> Any:
        self.puts.append((key, value))
        self.data[key] = value
        return 1

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)


class FakeRuntime:
    """A ``StepRuntime`` (and so a ``SoloRuntime``, ``KVRuntime``, ``InjectRuntime``)
    recording what the part under test calls."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg, self.kv, self.stores = cfg, FakeKV(), None
        self.abort = threading.Event()
        self.injected_stall = False
        self.step_began = 0.0
        self.plan_at, self.plan, self.plan_ctx = 0.0, None, None
        self.calls: list[Any] = []
        self.reports: list[tuple[ReportKind, str]] = []

    def update(self, now: bool = False, **fields: Any) -> None:
        self.calls.append(("update", fields))

    def report_sync(self, kind: ReportKind, error: str, timeout: float = 2.0) -> None:
        self.reports.append((kind, error))

    def progress(self) -> None:
        self.calls.append("progress")

    def notify(self) -> None: ...
    def take_injections(self, step: int) -> list: return []
    def refuse_injection(self, inj: Any, reason: str) -> None: ...
    def wait_transfer(self, generation: int, timeout: float) -> Any: return None
    def join(self, generation: int, world_size: int = 0) -> None: ...
    def take_prejoin(self, generation: int) -> Any: return None

    def interrupt(self) -> None:
        self.calls.append("interrupt")

    def claim_collective(self, generation: int) -> Any:
        self.calls.append(("claim", generation))
        return None  # no prejoin: the step is all-reduced in the joined generation

    def enter_collective(self) -> None:
        self.calls.append("enter")

    def end_collective(self) -> None:
        self.calls.append("end")


class FakeGroup:
    """A ``ports.Group`` of ``world`` ranks that all computed what this one did: the sum is
    ``world`` times this rank's (or it raises ``error``)."""

    bucket_bytes = 1 << 20

    def __init__(self, world: int = 2, error: BaseException | None = None) -> None:
        self.world, self.error = world, error
        self.calls: list[dict[str, Any]] = []

    def allreduce_(self, tensors, abort, slice_s=None, timeout_s=None, extend=None,
                   op_timeout_s=None) -> None:
        self.calls.append(dict(n=len(tensors), slice_s=slice_s, timeout_s=timeout_s,
                               op_timeout_s=op_timeout_s, extend=extend))
        if self.error is not None:
            raise self.error
        for t in tensors:
            t.mul_(self.world)

    def close(self) -> None: ...


class FakeMember:
    """A ``ports.StepMember``: rank 0 of a generation of ``group.world`` ranks."""

    def __init__(self, rt: FakeRuntime, cfg: AgentConfig, state: TrainState,
                 group: FakeGroup) -> None:
        self.rt, self.cfg, self.state, self.group = rt, cfg, state, group
        self.generation, self.rank, self.world_size = 1, 0, group.world
        self.backend, self.sharding = "gloo", None
        self.timeline, self.follower, self.leader = Timeline(), None, None
        self.diverged = None  # no handoff found replicas that disagreed
        self.discarded: list[tuple[str, Phase]] = []

    @property
    def is_member(self) -> bool:
        return self.rank is not None

    def discard(self, reason: str, phase: Phase = Phase.INTERRUPTED) -> bool:
        self.discarded.append((reason, phase))
        return False

    def take_early_join(self, plan: Plan, rank: int, backend: str) -> Any: return None
    def newest_plan(self) -> Any: return None
    def joined(self, plan: Plan, rank: int | None) -> None: ...
    def restored(self, plan: Plan, restore_step: int) -> None: ...
    def close_group(self) -> None: ...


class FakeFaults:
    slow = 1.0  # no injected slowness

    def __init__(self) -> None:
        self.seen: list[int] = []

    def before_sync(self, rt: Any, s: int) -> None:
        self.seen.append(s)

    def take_nan(self) -> bool:
        return False

    def flip_bit(self, modules: list) -> None:
        pass

    def summed(self, s: int) -> None:
        pass

    def absent(self, s: int) -> bool:
        return False


def _stepper(group: FakeGroup, **cfg_kw: Any) -> tuple[Stepper, FakeRuntime, FakeMember,
                                                        FakeFaults, torch.nn.Linear]:
    torch.manual_seed(0)
    cfg = _cfg(**cfg_kw)
    state = TrainState()
    model = torch.nn.Linear(3, 1)
    state.register(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))
    rt = FakeRuntime(cfg)
    m = FakeMember(rt, cfg, state, group)
    faults = FakeFaults()
    assert _missing(rt, ports.StepRuntime) == []
    assert _missing(m, ports.StepMember) == []
    assert _missing(faults, ports.Faults) == []
    return Stepper(4, state, cfg, rt, m, faults), rt, m, faults, model


def _one_step(st: Stepper, model: torch.nn.Linear, s: int = 0) -> tuple[Any, list, torch.Tensor]:
    """One micro-batch of 2 samples of a global batch of 4; returns (the step's outcome,
    the gradients the hook saw, this rank's own scaled loss)."""
    seen: list[torch.Tensor] = []
    st.micro_batches(2, range(0, 1), gradient_loop=True)
    loss = model(torch.ones(2, 3)).sum()
    st.backward(loss)
    out = st.step(s, None, lambda ps: seen.extend(p.grad.clone() for p in ps), 1.0,
                  stream=False)
    return out, seen, loss.detach() * 2 / 4


def test_stepper_fused_reduction_through_fakes():
    group = FakeGroup(world=2)
    st, rt, m, faults, model = _stepper(group, overlap=False)
    local = [torch.ones(1, 3) * 0.5 * 2, torch.ones(1) * 0.5 * 2]  # d(sum)/dW over 2 rows, /2
    out, seen, mine = _one_step(st, model)
    loss, sent = out
    assert sent is None and faults.seen == [0] and m.discarded == []
    # one fused all-reduce: every parameter's gradient and the loss, with the config's waits
    assert [c["n"] for c in group.calls] == [3]
    call = group.calls[0]
    assert (call["slice_s"], call["timeout_s"]) == (m.cfg.collective_slice,
                                                    m.cfg.collective_timeout)
    assert call["op_timeout_s"] == m.cfg.collective_timeout + m.cfg.solo_max
    assert loss == pytest.approx(float(mine) * 2)
    for g, want in zip(seen, local):
        assert torch.allclose(g, want * 2)  # summed over the 2 (identical) ranks
    assert rt.calls == ["progress", ("claim", 1), "end"]


def test_the_reduction_is_chosen_once_per_generation():
    st, rt, m, _, model = _stepper(FakeGroup(), overlap=False)
    first = st._reduction()
    assert isinstance(first, FusedReduction) and st._reduction() is first
    m.generation, m.group = 2, FakeGroup()
    assert st._reduction() is not first
    st2, _, m2, _, _ = _stepper(FakeGroup(), overlap=True)
    assert isinstance(st2._reduction(), OverlappedReduction)
    m2.sharding = object()
    assert isinstance(st2._reduction(), ShardedReduction)


@pytest.mark.parametrize("error, reason, phase, report", [
    (Aborted("newer plan"), "aborted: a newer plan arrived", Phase.INTERRUPTED, False),
    (CollectiveTimeout("slow peer"), "peer error: slow peer", Phase.FAILED, True),
])
def test_stepper_discards_a_failed_reduction(error, reason, phase, report):
    st, rt, m, _, model = _stepper(FakeGroup(error=error), overlap=False)
    out, seen, _ = _one_step(st, model)
    assert out is None and seen == []
    assert m.discarded == [(reason, phase)]
    assert [k for k, _ in rt.reports] == ([ReportKind.peer_error] if report else [])
    assert rt.calls[-1] == "end"  # the collective ended whatever happened
    assert all(p.grad is None for p in model.parameters())  # zero-grad: the step is gone


def test_a_discarded_step_of_a_sharded_member_resets_fsdp(monkeypatch):
    """``Stepper.discard``: a sharded member's FSDP iteration state goes with the step
    (``sharded.reset_iteration``; what it does: tests/test_sharded.py), an unsharded one's
    models are left alone."""
    import agent.sharded

    reset: list[list] = []
    monkeypatch.setattr(agent.sharded, "reset_iteration", reset.append)
    st, rt, m, _, model = _stepper(FakeGroup(), overlap=False)
    st.discard("a newer plan arrived")
    assert reset == []
    m.sharding = object()
    st.discard("a newer plan arrived")
    assert reset == [[model]]
    assert [r for r, _ in m.discarded] == ["a newer plan arrived"] * 2


def test_script_batch_through_a_fake_kv_runtime():
    rt = FakeRuntime(_cfg())
    assert _missing(rt, ports.KVRuntime) == []
    script = ScriptInfo(global_batch_size=8, micro_batch_size=4, total=10)
    check_plan_batch(rt, rt.cfg, _plan(["p0", "p1"]), 0, 2, script, 2, first=True)
    assert rt.kv.puts == [(SCRIPT_KEY, script.model_dump_json(exclude_none=True).encode())]
    check_plan_batch(rt, rt.cfg, _plan(["p0", "p1"]), 1, 2, script, 2, first=True)
    check_plan_batch(rt, rt.cfg, _plan(["p0", "p1"]), 0, 2, script, 2, first=False)
    assert len(rt.kv.puts) == 1  # rank 0, once


def test_solo_block_through_a_fake_runtime():
    rt = FakeRuntime(_cfg())
    assert _missing(rt, ports.SoloRuntime) == []
    with solo.block(rt, 3, 7, limit=60.0):
        declared = solo.declared(rt, 3)
        assert declared["pod"] == "p0" and declared["ended"] is None
        # a peer's collective of generation 3 waits longer while the solo holds
        assert solo.collective_args(rt, 3, 10.0, 60.0)["extend"]() is not None
    assert solo.declared(rt, 3)["ended"] is not None
    assert [k for k, _ in rt.kv.puts] == ["solo.g3", "solo.g3"]
    updates = [c[1] for c in rt.calls if isinstance(c, tuple) and c[0] == "update"]
    assert updates[0]["solo_until"] == declared["until"] and updates[-1] == {"solo_until": None}
    assert rt.calls.count("progress") == 2
    assert solo.collective_args(rt, 4, 10.0, 60.0)["extend"]() is None  # another generation


def test_a_pending_step_is_given_up_when_a_step_is_computed_anew():
    """A sharded member kept a discarded step's summed gradients (``TrainState.pending``,
    for ``agent/rollforward.py``); if it computes a step again without a handoff between,
    the kept gradients go first (else summed into the new ones) and its heartbeat says
    nothing is pending."""
    st, rt, m, faults, model = _stepper(FakeGroup(world=2), overlap=False)
    st.micro_batches(2, range(0, 1), gradient_loop=True)
    st.backward(model(torch.ones(2, 3)).sum())
    st.state.pending = (0, 1.0)
    st.micro_batches(2, range(0, 1), gradient_loop=True)
    assert st.state.pending is None and all(p.grad is None for p in model.parameters())
    assert ("update", {"pending_step": None}) in rt.calls
