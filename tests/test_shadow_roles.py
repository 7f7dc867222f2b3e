"""Shadow spares' two ends in one process, against a real nats-server: rank 0's
``ShadowLeader`` and a spare's ``ShadowFollower``, each with its own ``Runtime`` (NATS
connection, store bucket), find each other through the spare's KV request and stream over
a real gloo pair. The spare ends up holding rank 0's committed state bit for bit, step by
step (also when the script sets the learning rate itself every step), and stops following
(holding nothing) when rank 0's state changes outside a step."""

from __future__ import annotations

import time

import pytest
import torch

from agent.config import AgentConfig
from agent.runtime import Runtime
from agent.shadow_roles import ShadowFollower, ShadowLeader
from agent.train_state import TrainState
from schemas.messages import Member, Plan

pytestmark = pytest.mark.timeout(120)


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    st = TrainState()
    st.register(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    return st


def _runtime(nats_server, pod: str) -> Runtime:
    rt = Runtime(AgentConfig(nats_url=nats_server.url, job="test", pod=pod,
                             creds_path=str(nats_server.creds_path), collective_timeout=10.0,
                             store_timeout=10.0))
    rt.start()
    return rt


def _until(pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _train_step(st: TrainState, s: int) -> tuple[list[torch.Tensor], list[float]]:
    """A member's step: forward/backward, the script's own learning rate for this step
    (nanoGPT's way: ``param_group['lr'] = lr``), update, zero-grad; returns the gradients
    and the optimizer's hyper-parameters the update used."""
    model = st.objs["model"]
    g = torch.Generator().manual_seed(s)
    loss = model(torch.randn(16, 4, generator=g)).pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in st.params()]
    for group in st.objs["optimizer"].param_groups:
        group["lr"] = 1e-2 / s
    hypers = st.hypers()
    st.update(1.0)
    st.zero_grad()
    st.last_committed, st.loss = s, float(loss.detach())
    return grads, hypers


def test_a_spare_follows_rank_0_bit_for_bit_and_stops_on_divergence(nats_server):
    rt0, rt1 = _runtime(nats_server, "p0"), _runtime(nats_server, "p1")
    lead_state, spare_state = _state(0), _state(1)  # the spare starts from other weights
    plan = Plan(generation=1, members=[Member(pod="p0", rank=0)], world_size=1,
                global_batch_size=16, micro_batch_size=16, shares={0: 1}, spares=["p1"])
    leader = ShadowLeader(rt0, rt0.cfg, lead_state)
    follower = ShadowFollower(rt1, rt1.cfg, spare_state)
    try:
        assert lead_state.digest() != spare_state.digest()
        follower.follow(plan)         # the spare asks (its KV request) ...
        assert follower.following
        lead_state.last_committed = 0
        leader.lead(plan, lead_state.snapshot())   # ... rank 0 answers it with the state
        assert leader.streaming

        def caught_up(step: int) -> bool:
            follower.apply()
            return spare_state.last_committed == step

        _until(lambda: caught_up(0), "the spare to hold the initial state")
        assert spare_state.param_sha256() == lead_state.param_sha256()

        for s in (1, 2, 3):
            grads, hypers = _train_step(lead_state, s)
            leader.offer(s, grads, 1.0, hypers=hypers)
            leader.confirm(s)
            _until(lambda: caught_up(s), f"the spare to hold step {s}")
            assert spare_state.param_sha256() == lead_state.param_sha256(), s
            assert spare_state.loss == lead_state.loss
            assert spare_state.objs["optimizer"].param_groups[0]["lr"] == 1e-2 / s
        assert rt1.hb.step == 3 and rt1.hb.digest == lead_state.digest()

        # rank 0's script changes registered state outside s.step(): the confirmation's
        # checksum no longer matches what the spare replayed, so it holds nothing
        grads, hypers = _train_step(lead_state, 4)
        with torch.no_grad():
            lead_state.objs["model"][0].bias.add_(1.0)
        leader.offer(4, grads, 1.0, hypers=hypers)
        leader.confirm(4)
        _until(lambda: (follower.apply(), not follower.following)[1], "the spare to stop")
        assert spare_state.last_committed == -1 and rt1.hb.step == -1
    finally:
        follower.stop(quiet=True)
        leader.end()
        rt0.stop()
        rt1.stop()
