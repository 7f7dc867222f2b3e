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
