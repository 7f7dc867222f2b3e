"""Issue 43: the steady step makes at most one host sync (the loss read).

A real single-process Session with a real ``Runtime`` (its NATS connection to a real
nats-server) attached, so each commit runs the distributed commit's heartbeat update: the
step's digest is begun on the device and read a step later, always labelled with its own
step. Per step the test also runs what rank 0 adds while a spare follows (``state_word``).
Host syncs are counted as operations that would wait for a GPU (tests/helpers/host_syncs.py).
"""

from __future__ import annotations

import pytest
import torch

from agent.config import AgentConfig
from agent.digests import DigestSlot, digest
from agent.runtime import Runtime
from agent.shadow import state_word, state_word_begin
from agent.train_state import TrainState
from helpers.host_syncs import counting

pytestmark = pytest.mark.timeout(120)
STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))


def _on_host(opt: torch.optim.Optimizer, device: str):
    """Tensors in host memory whatever the model's device: a CUDA run's CPU tensors; the
    optimizer's step counters (kept on the CPU unless ``capturable``/``fused``)."""
    def on_host(t) -> bool:
        if device != "cpu":
            return t.device.type == "cpu"
        return any(st.get("step") is not None and st["step"].data_ptr() == t.data_ptr()
                   for st in opt.state.values())
    return on_host


def _steady_syncs(s, model, data, device: str, truth: dict[int, str], on_host,
                  at_most: int = 1, **step_kw) -> tuple[list[int], list[tuple[int, str]]]:
    """Syncs per step (the first, warm-up, step left out) and the digests the heartbeat
    carried (step it names, digest); ``truth``: each step's digest, taken after it (not
    counted). ``step_kw``: for ``s.step`` (``max_grad_norm``: the clip's norm is read with
    the loss)."""
    per_step, seen = [], []
    it = s.steps(total=STEPS)
    while True:
        with counting(on_host) as c:
            try:
                step = next(it)
            except StopIteration:
                break
            for x, y in s.batches(data, micro_batch_size=4):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                s.backward(torch.nn.functional.mse_loss(model(x), y))
            assert s.step(**step_kw)
            # rank 0, each step while a spare follows (ShadowLeader.confirm); its stream
            # thread reads the word
            word = state_word_begin(s.state.modules())
        assert word.result() == state_word(s.state.modules())
        truth[step] = s.state.digest()  # the committed state, unchanged since the commit
        hb = s.runtime.hb
        assert hb.step == step
        seen.append((step if hb.digest_step is None else hb.digest_step, hb.digest))
        if step:
            per_step.append(c.count)
            assert c.count <= at_most, f"step {step}: {c.count} host syncs: {c.where}"
    return per_step, seen


def run_session(nats_server, device: str, at_most: int = 1, scaler: dict | None = None,
                **step_kw) -> dict[str, torch.Tensor]:
    """Steps of a real Session on a real runtime, each counted; the final parameters.
    ``scaler``: fp16's GradScaler registered, with these arguments."""
    import agent

    model = _model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {} if scaler is None else {"scaler": torch.amp.GradScaler(device, **scaler)}
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    rt = Runtime(AgentConfig(nats_url=nats_server.url, job="test", pod="w0",
                             creds_path=str(nats_server.creds_path), store_timeout=10.0))
    rt.start()
    truth: dict[int, str] = {}
    try:
        with agent.Session(global_batch_size=8) as s:
            s.register(model=model, optimizer=opt, **extra)
            s.runtime = rt  # the distributed commit's heartbeat update, on a real runtime
            per_step, seen = _steady_syncs(s, model, data, device, truth, _on_host(opt, device),
                                           at_most, **step_kw)
            if step_kw.get("max_grad_norm"):  # the clip was active, its norm read
                assert s.grad_norm is not None and s.grad_norm > step_kw["max_grad_norm"]
    finally:
        rt.stop()
    assert len(per_step) == STEPS - 1
    # every digest the heartbeat carried is the digest of the step it names: the step
    # itself (CPU: ready at once) or the one before (GPU: read a step later)
    assert all(d == truth[named] for named, d in seen if d)
    assert all(step - 1 <= named <= step for step, (named, _) in enumerate(seen))
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_a_steady_step_makes_at_most_one_host_sync(nats_server):
    run_session(nats_server, "cpu")


def test_a_clipped_step_reads_its_norm_with_the_loss(nats_server, monkeypatch):
    """``s.step(max_grad_norm=...)``: the clip's global norm is computed on the device before
    the loss is read and comes to the host in the same read (it was a second host sync:
    ``float`` of ``clip_grad_norm_`` after the read); the parameters are bitwise those of the
    clip done after the read (``Stepper._norm_ahead`` off: the old order, 2 syncs a step)."""
    from agent.stepper import Stepper

    ahead = run_session(nats_server, "cpu", max_grad_norm=0.05)
    monkeypatch.setattr(Stepper, "_norm_ahead", lambda self, params, max_grad_norm: None)
    after = run_session(nats_server, "cpu", at_most=2, max_grad_norm=0.05)
    assert ahead.keys() == after.keys()
    assert all(torch.equal(ahead[k], after[k]) for k in ahead)


def test_digest_begun_on_the_device_is_the_digest():
    """What the heartbeat carries (begun at the commit, read later) equals ``digest()`` (what
    a recovery reports) for the same state: one majority digest at the broker."""
    st = TrainState()
    st.register(model=_model().to(torch.bfloat16).to(torch.float32))
    pending = st.digest_begin()
    assert pending.result() == st.digest() == digest(st.modules()[0])


def test_an_fp16_step_reads_its_checks_with_the_loss(nats_server):
    """fp16 (a registered GradScaler) with a clip: the finite check of the gradients and the
    clip's norm come with the loss in one read, and the scale's backoff/growth runs on its
    host copy (it was 9 host syncs a step: the check, ``get_scale`` for the unscale, the norm,
    the scaler's ``state_dict`` twice per update...). A first scale that overflows makes
    skipped steps and backoffs; growth every 2 good steps."""
    run_session(nats_server, "cpu", scaler={"init_scale": 2.0**127, "growth_interval": 2},
                max_grad_norm=0.05)


def test_the_digest_is_its_definition_for_any_layout():
    """The digest (one strided view per tensor, begun on the device) is its definition: per
    tensor ``k`` of its elements in order, every ``n // k``-th, hashed per dtype with the
    element count; whatever the layout (contiguous, transposed, a view at an offset, a
    Parameter, empty) and dtype. Pods of two versions compare it (the broker's majority)."""
    import hashlib

    def reference(ts: list[torch.Tensor], samples: int) -> str:
        total = sum(t.numel() for t in ts)
        groups: dict[torch.dtype, list[bytes]] = {}
        for t in ts:
            n = t.numel()
            if n:
                k = max(1, min(n, samples * n // total))
                sample = t.detach().reshape(-1)[:: max(1, n // k)][:k]
                flat = torch.empty(k, dtype=t.dtype).copy_(sample)
                groups.setdefault(t.dtype, []).append(flat.view(torch.uint8).numpy().tobytes())
        h = hashlib.blake2b(digest_size=8)
        for dtype, parts in groups.items():
            h.update(str(dtype).encode())
            h.update(b"".join(parts))
        if total:
            h.update(total.to_bytes(8, "little"))
        return h.hexdigest()

    torch.manual_seed(0)
    base = torch.randn(6, 50, 7)
    ts = [torch.nn.Parameter(base.clone()), base.transpose(0, 2), base[2:, 5:],
          base.reshape(-1)[3:40], torch.empty(0), (base * 50).to(torch.int64),
          base.to(torch.bfloat16).transpose(1, 2), torch.randn(3)]
    for samples in (4096, 20, 1):
        assert digest(ts, samples) == reference(ts, samples)
    assert digest(ts) != digest(ts[:-1] + [torch.randn(3)])


def test_a_digest_always_names_its_own_step():
    class Late:
        """A digest whose copy has not landed yet (a GPU behind the host)."""

        def __init__(self, hexdigest: str, landed: bool = False) -> None:
            self.hexdigest, self.landed = hexdigest, landed

        def ready(self) -> bool:
            return self.landed

        def result(self) -> str:
            self.landed = True  # waiting made it land
            return self.hexdigest

    queue: list[Late] = []
    slot = DigestSlot(lambda: queue.pop(0))
    queue.append(Late("aa"))
    assert slot.commit(1) == {"digest": "", "digest_step": None}  # nothing read yet
    queue.append(Late("bb"))
    first = slot._pending[0][1]
    first.landed = True
    assert slot.commit(2) == {"digest": "aa", "digest_step": 1}  # step 1's, labelled so
    assert slot.of(2) == "bb" and slot.of(1) == "aa" and slot.of(0) == ""  # waits for 2
    queue.append(Late("cc", landed=True))
    assert slot.commit(3) == {"digest": "cc", "digest_step": 3}
    assert slot.note(7, "dd") == "dd" and slot.of(7) == "dd" and slot.of(3) == ""


def test_heartbeat_digest_of_another_step_is_not_that_steps():
    from schemas.messages import Heartbeat, Role

    hb = Heartbeat(pod="w0", role=Role.worker, generation=1, step=5, digest="ab", digest_step=4)
    assert hb.step_digest == ""
    assert hb.model_copy(update={"digest_step": None}).step_digest == "ab"
    assert Heartbeat.model_validate_json(hb.model_dump_json()).digest_step == 4


def test_the_digest_views_kept_between_commits_follow_the_state():
    """Issue 44: the heartbeat digest's views of the state are built once and kept while the
    state is updated in place; built again when its tensors change (the optimizer's state
    created or loaded, a parameter's ``.data`` replaced), and dropped by a restore (they would
    keep the replaced tensors alive). Every begun digest equals ``digest()`` of that moment."""
    import copy
    import gc
    import weakref

    st = TrainState()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    st.register(model=model, optimizer=opt)

    def step() -> None:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    def check() -> object:
        assert st.digest_begin().result() == st.digest()
        return st._sampler._views

    first = check()
    step()  # the optimizer's state is created: other tensors
    second = check()
    assert second is not first
    step()  # in place: the same views, the new values
    assert check() is second
    model[0].weight.data = torch.randn(64, 8)  # the same Parameter, another storage
    third = check()
    assert third is not second
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its state tensors replaced
    assert check() is not third
    old = weakref.ref(opt.state[model[0].weight]["exp_avg"])
    st.restore(st.snapshot())  # loads the copy's tensors; the views must not keep the old
    gc.collect()
    assert old() is None
    check()
