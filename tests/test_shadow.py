"""Shadow spares' building blocks (agent/shadow.py); the protocol itself runs end to end in
tests/test_recovery_e2e.py (a promoted spare receives nothing; an EMA makes it fall back)."""

from __future__ import annotations

import torch

from agent.shadow import layout_hash, state_word


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))


def test_state_word_is_exact_over_parameters_and_buffers():
    a, b = _model(), _model()
    assert state_word([a]) == state_word([b])
    with torch.no_grad():
        # the smallest change of one parameter element
        w = b[0].weight.view(-1)
        w[5] = torch.nextafter(w[5], torch.tensor(1.0))
    assert state_word([a]) != state_word([b])
    c = _model()
    c[1].running_mean[3] += 1e-7  # a buffer, not a parameter
    assert state_word([a]) != state_word([c])


def test_state_word_covers_every_module_and_its_order():
    a, b = _model(), _model()
    ema = _model()
    assert state_word([a, ema]) == state_word([b, _model()])
    with torch.no_grad():
        ema[0].bias.mul_(0.5)
    assert state_word([a, _model()]) != state_word([a, ema])


def test_layout_hash_tells_shapes_and_dtypes_apart():
    x = [torch.zeros(2, 3), torch.zeros(4)]
    assert layout_hash(x) == layout_hash([torch.ones(2, 3), torch.ones(4)])
    assert layout_hash(x) != layout_hash([torch.zeros(3, 2), torch.zeros(4)])
    assert layout_hash(x) != layout_hash([torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4)])
    assert layout_hash(x) != layout_hash(x[:1])


def test_a_stream_carries_steps_and_ends_cleanly_with_end():
    """Sender and receiver over a real two-rank gloo pair (in-process store): the state, a
    step (with the fp16 skip flag) and a confirmation arrive in order; ``finish`` sends END
    and both threads end with nothing pending (a receive left pending made pods abort in
    interpreter teardown, exit -6, when rank 0 exited at the same moment)."""
    import threading

    import torch.distributed as dist

    from agent.shadow import Confirm, ShadowReceiver, ShadowSender, Update
    from agent.state import snapshot

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    store = dist.HashStore()
    factory = lambda: dist.PrefixStore("t.", store)  # noqa: E731
    arrived = threading.Event()
    rx = ShadowReceiver(factory, list(m.parameters()), arrived.set, timeout_s=20, slice_s=0.05)
    tx = ShadowSender("s0", factory, snapshot({"m": m}, {"step": 4}), 4, timeout_s=20,
                      slice_s=0.05)
    grads = [torch.full_like(p, 0.5) for p in m.parameters()]
    tx.offer(Update(step=5, loss=1.25, lr_factor=0.5, tensors=grads, skip=True))
    tx.offer(Confirm(step=5, check=123))
    tx.finish()
    items: list = []  # taken as they come, as a spare's training thread applies them: the
    while rx.ended is None or rx.ready():  # receiver keeps at most AHEAD_STEPS waiting
        arrived.wait(0.05)
        arrived.clear()
        items += rx.take()
    assert tx.join(20) and rx.join(20)
    assert (tx.ended, rx.ended) == ("finished", "finished")
    assert [k for k, _ in items] == ["state", "step", "confirm"]
    u = items[1][1]
    assert (u.step, u.loss, u.lr_factor, u.skip) == (5, 1.25, 0.5, True)
    assert all(torch.equal(a, b) for a, b in zip(u.tensors, grads))
    assert (items[2][1].step, items[2][1].check) == (5, 123)
