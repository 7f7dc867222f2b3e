"""The overlapped gradient sync (agent/grad_sync.py) over a real two-rank gloo group (two
threads of this process, an in-memory store)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from helpers.thread_ranks import run_ranks
from agent.collectives import AbortableGroup, Aborted
from agent.grad_sync import GradSync

pytestmark = [pytest.mark.timeout(120)]


torch.manual_seed(0)
_BASE = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                            torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _model() -> torch.nn.Module:
    """The same model in every thread (copied: the global RNG is shared by the threads)."""
    return copy.deepcopy(_BASE)


def _batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + k)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _grads(micro: list[int], rank: int) -> list[torch.Tensor]:
    m = _model()
    for k in micro:
        x, y = _batch(rank, k)
        torch.nn.functional.mse_loss(m(x), y).backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]



@pytest.mark.parametrize("micro", [([0, 1], [2]), ([0, 1, 2], [])])
def test_buckets_posted_during_the_last_backward_give_the_sum(micro):
    """Rank 0 computes several micro-batches, rank 1 one or none (it posts every bucket in
    finish): the result is the sum of both ranks' gradients, exactly, and rank 0 posted
    buckets during its last backward (several small buckets)."""
    expect = [a + b for a, b in zip(_grads(micro[0], 0), _grads(micro[1], 1))]

    def fn(r: int, g: AbortableGroup):
        m = _model()
        sync = GradSync(list(m.parameters()), bucket_bytes=2048)
        assert len(sync.buckets) >= 3
        for i, k in enumerate(micro[r]):
            if i == len(micro[r]) - 1:
                sync.arm(g)
            x, y = _batch(r, k)
            torch.nn.functional.mse_loss(m(x), y).backward()
        loss = torch.tensor([float(r + 1)], dtype=torch.float64)
        sync.finish(g, [loss], None, timeout_s=20)
        return [p.grad for p in m.parameters()], float(loss), sync.overlapped

    (g0, l0, o0), (g1, l1, o1) = run_ranks(fn)
    assert l0 == l1 == 3.0
    for a, b, e in zip(g0, g1, expect):
        assert torch.equal(a, b)
        assert torch.allclose(a, e, rtol=0, atol=1e-6)
    assert o0 == len(GradSync(list(_model().parameters()), 2048).buckets)  # all during backward
    assert o1 == (0 if not micro[1] else o0)


def test_an_aborted_sync_leaves_the_gradients_as_they_were():
    """Abort before the wait (a newer plan): Aborted, and every gradient is still this rank's
    own (the buckets were copies), so the step can be all-reduced again elsewhere."""
    def fn(r: int, g: AbortableGroup):
        m = _model()
        sync = GradSync(list(m.parameters()), bucket_bytes=2048)
        sync.arm(g)
        x, y = _batch(r, 0)
        torch.nn.functional.mse_loss(m(x), y).backward()
        mine = [p.grad.clone() for p in m.parameters()]
        abort = threading.Event()
        abort.set()
        with pytest.raises(Aborted):
            sync.finish(g, [], abort, timeout_s=20)
        return all(torch.equal(p.grad, c) for p, c in zip(m.parameters(), mine))

    assert run_ranks(fn) == [True, True]


def test_a_metric_reduced_after_the_loop_stays_in_order_on_a_rank_without_micro_batches():
    """Rank 1 computes no micro-batch; both reduce a metric after the micro-batch loop.
    ``flush`` (the end of the loop) posts every bucket first on both ranks, so the metric's
    all-reduce meets its counterpart and the gradients are the sum."""
    expect = _grads([0, 1], 0)

    def fn(r: int, g: AbortableGroup):
        m = _model()
        sync = GradSync(list(m.parameters()), bucket_bytes=2048)
        micro = [0, 1] if r == 0 else []
        for i, k in enumerate(micro):
            if i == len(micro) - 1:
                sync.arm(g)
            x, y = _batch(r, k)
            torch.nn.functional.mse_loss(m(x), y).backward()
        sync.flush(g)
        metric = torch.tensor([10.0 * (r + 1)])
        g.allreduce_([metric], None, timeout_s=20)
        sync.finish(g, [], None, timeout_s=20)
        return [p.grad for p in m.parameters()], float(metric)

    (g0, m0), (g1, m1) = run_ranks(fn)
    assert m0 == m1 == 30.0
    for a, b, e in zip(g0, g1, expect):
        assert torch.equal(a, b) and torch.allclose(a, e, rtol=0, atol=1e-6)


def test_a_collective_between_the_drop_ins_forward_and_its_backward_leaves_the_gradients():
    """The drop-in (and so the Lightning strategy) arms the sync at the synchronising
    micro-batch's forward; Lightning's ``self.log(..., sync_dist=True)`` in ``training_step``
    then all-reduces (``s.all_reduce``: ``flush`` first) before the backward. No bucket may go
    before the backward filled it: three SGD steps, each with that metric all-reduce, end
    with the parameters of the same training on the mean gradient (what torch's DDP gives)."""
    from types import SimpleNamespace

    from agent.dropin import DropIn

    steps, lr = 3, 0.1
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for t in range(steps):
        grads = [_grads_at(ref, r, t) for r in (0, 1)]
        for p, a, b in zip(ref.parameters(), *grads):
            p.grad = (a + b) / 2
        opt.step()

    def fn(r: int, g: AbortableGroup):
        m = _model()
        sync = GradSync(list(m.parameters()), bucket_bytes=2048)
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        st = SimpleNamespace(zero_on_discard=True, _grad_sync=lambda: sync,
                             collective_args=lambda: {"op_timeout_s": None})
        d = object.__new__(DropIn)  # only _arm: the session's parts it reads
        d.s = SimpleNamespace(_stepper=st, m=SimpleNamespace(group=g),
                              runtime=SimpleNamespace(abort=threading.Event()))
        d.dry, metrics = False, []
        for t in range(steps):
            opt.zero_grad(set_to_none=True)
            d._arm()  # the forward of the synchronising micro-batch
            x, y = _batch(r, t)
            loss = torch.nn.functional.mse_loss(m(x), y)
            metric = loss.detach().clone().reshape(1)  # self.log(..., sync_dist=True)
            if sync.armed:  # as Stepper.all_reduce
                sync.flush(g)
            g.allreduce_([metric], None, timeout_s=20)
            metrics.append(float(metric))
            loss.backward()
            sync.finish(g, [], None, timeout_s=20)
            for p in m.parameters():
                p.grad /= 2
            opt.step()
        return [p.detach() for p in m.parameters()], metrics

    (p0, m0), (p1, m1) = run_ranks(fn)
    assert m0 == m1
    for a, b, e in zip(p0, p1, ref.parameters()):
        assert torch.equal(a, b)
        assert torch.allclose(a, e.detach(), rtol=0, atol=1e-6)


def _grads_at(m: torch.nn.Module, rank: int, k: int) -> list[torch.Tensor]:
    m.zero_grad(set_to_none=True)
    x, y = _batch(rank, k)
    torch.nn.functional.mse_loss(m(x), y).backward()
    return [p.grad.clone() for p in m.parameters()]
