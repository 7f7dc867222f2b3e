"""Last-resort checkpoints (agent/checkpoint.py): torch.distributed.checkpoint on disk,
atomic, pruned, exact."""

from __future__ import annotations

import torch

from agent import checkpoint as ck
from agent.train_state import TrainState


def _state(seed: int, steps: int) -> TrainState:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(steps):
        m(torch.randn(8, 5)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    st = TrainState()
    st.register(model=m, optimizer=opt, scheduler=sched)
    st.last_committed, st.loss, st.lr_factor = steps - 1, 0.25, 0.5
    return st


def test_a_checkpoint_restores_the_state_exactly(tmp_path):
    src = _state(0, 3)
    c = ck.Checkpointer(tmp_path, every=3)
    assert not c.after_commit(1, src) and c.after_commit(2, src) and c.wait(30)
    assert c.saved == [2] and c.error is None
    path = ck.latest(tmp_path)
    assert path is not None and path.name == "step-00000002"
    dst = _state(1, 1)  # other weights, other optimizer state
    assert dst.param_sha256() != src.param_sha256()
    assert ck.load(path, dst) == 2
    assert dst.param_sha256() == src.param_sha256()
    assert (dst.last_committed, dst.loss, dst.lr_factor) == (2, 0.25, 0.5)
    a, b = src.objs["optimizer"].state_dict(), dst.objs["optimizer"].state_dict()
    for k in a["state"]:
        for n, t in a["state"][k].items():
            assert torch.equal(t, b["state"][k][n]), (k, n)
    assert src.objs["scheduler"].state_dict() == dst.objs["scheduler"].state_dict()


def test_only_complete_checkpoints_count_and_old_ones_go(tmp_path):
    st = _state(0, 1)
    c = ck.Checkpointer(tmp_path, every=1, keep=2)
    for s in range(4):
        st.last_committed = s
        assert c.after_commit(s, st)
        assert c.wait(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    # a save that died half-way: a temporary directory, never a step-N one; ignored
    (tmp_path / ".step-00000009.tmp-123").mkdir()
    (tmp_path / "step-00000010").mkdir()  # no manifest: not complete
    assert ck.latest(tmp_path).name == "step-00000003"
    assert ck.latest(tmp_path / "missing") is None


def test_a_save_due_while_one_runs_is_skipped_not_queued(tmp_path, monkeypatch):
    import threading

    gate = threading.Event()
    real = ck.write

    def slow(*a, **kw):
        gate.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(ck, "write", slow)
    st = _state(0, 1)
    c = ck.Checkpointer(tmp_path, every=1)
    assert c.after_commit(0, st)
    assert not c.after_commit(1, st)
    gate.set()
    assert c.wait(30) and c.saved == [0] and c.skipped == [1]


def test_a_failed_save_is_reported_and_training_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = ck.Checkpointer(blocker, every=1)
    assert c.after_commit(0, _state(0, 1)) and c.wait(30)
    assert c.saved == [] and c.error is not None


def test_a_time_interval_makes_a_checkpoint_due_between_step_multiples(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(ck.time, "monotonic", lambda: now[0])
    c = ck.Checkpointer(tmp_path, every=1000, interval_s=60.0)
    assert not c.due(5)
    now[0] += 61
    assert c.due(6)
    assert c.after_commit(6, _state(0, 1)) and c.wait(30)
    assert not c.due(7)  # the interval counts from the last save
    assert c.due(999)    # and the step multiple still applies


def test_a_step_written_again_replaces_the_old_one(tmp_path):
    st = _state(0, 2)
    c = ck.Checkpointer(tmp_path, every=1)
    assert c.after_commit(3, st) and c.wait(30)
    assert c.save(3, _state(1, 2)) and c.wait(30)  # a job resumed from an older checkpoint
    assert c.error is None and c.saved == [3, 3]
    dst = _state(2, 1)
    ck.load(ck.latest(tmp_path), dst)
    assert dst.param_sha256() == _state(1, 2).param_sha256()


def test_a_spare_does_without_a_resume_checkpoint_that_rotated_away(tmp_path, monkeypatch):
    """Issue 33: CEASELESS_RESUME_FROM names a checkpoint the resumed job's own checkpoints
    have since deleted (keep 1). A spare starts without it (it takes the state from its
    peers when promoted) instead of crashing at start; a worker still refuses to start
    (the job would silently start over), and an existing checkpoint is loaded by both."""
    import pytest

    from agent.outputs import Checkpoints

    src = _state(0, 3)
    c = ck.Checkpointer(tmp_path, every=1, keep=1)
    for s in (2, 3):
        src.last_committed = s
        assert c.after_commit(s, src) and c.wait(30)
    gone, kept = tmp_path / "step-00000002", tmp_path / "step-00000003"
    assert not gone.exists() and (kept / "manifest.json").exists()
    monkeypatch.setenv("CEASELESS_RESUME_FROM", str(gone))
    monkeypatch.setenv("CEASELESS_ROLE", "spare")
    st = _state(1, 1)
    st.last_committed = -1
    Checkpoints().resume(st)
    assert st.last_committed == -1  # nothing loaded: the peers' state comes at promotion
    monkeypatch.setenv("CEASELESS_ROLE", "worker")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        Checkpoints().resume(st)
    for role in ("worker", "spare"):
        monkeypatch.setenv("CEASELESS_ROLE", role)
        monkeypatch.setenv("CEASELESS_RESUME_FROM", str(tmp_path))  # the newest under it
        st = _state(1, 1)
        st.last_committed = -1
        Checkpoints().resume(st)
        assert st.last_committed == 3 and st.param_sha256() == src.param_sha256()


def test_up_tells_the_checkpoints_its_run_wrote(tmp_path):
    """`up`'s proof that its run committed a step (issue 41): a complete checkpoint that was
    not there when the run started, or the same step written again; an incomplete one, or
    one of an earlier run, proves nothing. A later generation that starts from step -1 after
    such a proof is a total loss, whatever the broker knew."""
    from ops.cluster import complete_checkpoints, written_since

    st = _state(0, 1)
    c = ck.Checkpointer(tmp_path, every=1, keep=5)
    for s in (4, 9):
        st.last_committed = s
        assert c.save(s, st) and c.wait(30)
    before = complete_checkpoints(tmp_path)
    assert {n for n, _ in before} == {"step-00000004", "step-00000009"}
    assert written_since(tmp_path, before) is None
    (tmp_path / "step-00000020").mkdir()  # no manifest: not complete
    assert written_since(tmp_path, before) is None
    st.last_committed = 9
    assert c.save(9, st) and c.wait(30)  # step 9 written again by this run
    assert written_since(tmp_path, before) == 9
    assert complete_checkpoints(tmp_path / "missing") == set()
    assert written_since(None, set()) is None
