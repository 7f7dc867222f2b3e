"""Issue 44: the Hugging Face ``Trainer`` of ``agent.hf`` in one process: the "after" example is
the "before" with one line changed and trains to the same parameters; a promoted spare (the
job's progress received, the train DataLoader sharded by the job's rank) trains on the same
(global step, batch) as the uninterrupted rank from there; what it does not support is refused
before any process group, saying what to do. Skipped when transformers is not installed.
(Under ``ceaseless up``, with faults: tests/test_hf_e2e.py.)"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from harness import REPO  # noqa: E402

BEFORE = "examples/frameworks/hf_before.py"
AFTER = "examples/frameworks/hf_after.py"
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.usefixtures("no_trainer_leftovers")]  # conftest.py



def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("CEASELESS_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "LOCAL_WORLD_SIZE")}


def test_after_is_one_changed_line_and_trains_as_the_before_in_one_process(tmp_path):
    diff = subprocess.run(["diff", "-U0", BEFORE, AFTER], cwd=REPO, capture_output=True,
                          text=True).stdout
    changed = [x for x in diff.splitlines() if x[:1] in "+-" and not x.startswith(("+++", "---"))]
    assert len(changed) == 2, diff  # one line removed, one added
    shas = []
    for script in (BEFORE, AFTER):
        out = tmp_path / (script.split("/")[-1] + ".sha")
        r = subprocess.run([sys.executable, script, "--max-steps", "3", "--out", str(out),
                            "--output-dir", str(tmp_path / "o")],
                           cwd=REPO, env=_plain_env(), capture_output=True, text=True,
                           timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        shas.append(out.read_text().strip())
    assert shas[0] == shas[1] and len(shas[0]) == 64


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none",
                disable_tqdm=True, save_strategy="no", logging_strategy="no", seed=0)
    base.update(kw)
    return TrainingArguments(**base)


class _Rows:
    def __init__(self, n: int) -> None:
        import torch

        self.x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.x[i].sum() / 100}


def _model():
    import torch

    class Lin(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            return {"loss": (self.lin(x / 100).squeeze(-1) - labels).pow(2).mean()}

    return Lin()


@pytest.mark.parametrize("case, says", [
    ("fp16", "fp16"),
    ("auto_find_batch_size", "auto_find_batch_size"),
    ("load_best_model_at_end", "load_best_model_at_end"),
    ("ignore_data_skip", "ignore_data_skip"),
    ("group_by_length", "train_sampling_strategy"),
    ("iterable", "iterable train dataset"),
    ("unseeded", "use_seedable_sampler"),
])
def test_unsupported_is_refused_at_start_with_what_to_do(case, says, tmp_path, monkeypatch):
    """Under ``ceaseless up`` (a bus URL in the environment: nothing listens there), refused in
    ``Trainer(...)`` before any process group or connection."""
    import torch
    import torch.distributed as dist

    import agent.ddp
    from agent.hf import Trainer

    kw = {"fp16": {"fp16": True}, "auto_find_batch_size": {"auto_find_batch_size": True},
          "load_best_model_at_end": {"load_best_model_at_end": True, "eval_strategy": "steps",
                                     "save_strategy": "steps"},
          "ignore_data_skip": {"ignore_data_skip": True},
          "group_by_length": {"train_sampling_strategy": "group_by_length"},
          "unseeded": {"accelerator_config": {"use_seedable_sampler": False}}}
    try:
        args = _args(tmp_path, **kw.get(case, {}))
    except (ValueError, ImportError) as e:  # transformers refuses it first on a CPU
        pytest.skip(f"transformers refuses it first: {e}")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_Rows(8))

    data = Stream() if case == "iterable" else _Rows(8)
    monkeypatch.setenv("CEASELESS_NATS_URL", "nats://127.0.0.1:9")
    with pytest.raises(NotImplementedError, match=says) as e:
        Trainer(model=_model(), args=args, train_dataset=data)
    assert "supported yet:" in str(e.value)  # ... and what to do
    assert agent.ddp.active() is None and not dist.is_initialized()


@pytest.mark.parametrize("at", [1, 4, 5, 9, 11])
def test_a_promoted_spare_trains_on_the_jobs_step_and_batches_from_its_received_progress(
        at, tmp_path):
    """What a promoted spare of rank 1 (of 2) gets: the progress (TrainerState at the last step
    end) that the survivors hold when step ``at`` starts, applied before the first epoch, and
    the train DataLoader sharded by the job's rank: it computes the same (global step,
    micro-batch) as the uninterrupted rank 1 from there, mid-epoch, at an epoch's first step
    and at the last step. 40 rows, 2 a micro-batch, 2 micro-batches a step: 5 steps an epoch
    per rank, 12 steps over three epochs, shuffled."""
    from transformers import TrainerCallback

    from agent.hf import Trainer, _Progress, _Snapshot

    seen: dict[str, list] = {}

    class Rec(Trainer):
        tag = ""

        def compute_loss(self, model, inputs, *a, **kw):
            seen.setdefault(self.tag, []).append(
                (self.state.global_step, tuple(inputs["x"][:, 0].tolist())))
            return super().compute_loss(model, inputs, *a, **kw)

    grabbed: dict = {}

    class Grab(TrainerCallback):  # what the survivors hold when step `at` starts
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == at:
                grabbed["sd"] = copy.deepcopy(progress.state_dict())

    class Load(TrainerCallback):  # the received state, applied before the first epoch
        def on_train_begin(self, args, state, control, **kw):
            got = _Progress(spare)
            got.load_state_dict(grabbed["sd"])
            spare._progress = got
            spare._apply_received()

    args = _args(tmp_path, max_steps=12, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2)
    job = Rec(model=_model(), args=args, train_dataset=_Rows(40))
    job.tag, job._shard = "job", (1, 2)
    progress = _Progress(job)
    job.add_callback(_Snapshot(progress))
    job.add_callback(Grab())
    job.train()
    spare = Rec(model=_model(), args=args, train_dataset=_Rows(40), callbacks=[Load()])
    spare.tag, spare._shard = "spare", (1, 2)
    spare.train()
    assert spare.state.global_step == 12
    assert job.state.epoch == pytest.approx(12 / 5)  # rank 1's share: 5 steps an epoch
    want = [r for r in seen["job"] if r[0] >= at]
    assert len(want) == 2 * (12 - at) and seen["spare"] == want


def test_a_spare_that_becomes_rank0_writes_again_the_checkpoint_rank0_died_saving(tmp_path):
    """What a promoted spare of rank 0 does with the job's state at a step the Trainer saves at
    (``save_steps``), whose checkpoint rank 0 died writing (its weights written, the rest
    not: the Trainer writes the files one by one, in place): it writes it again, as the job
    wrote it, then the later ones; a complete checkpoint is left alone. One process."""
    import shutil

    import torch
    from transformers import TrainerCallback

    from agent.hf import Trainer, _Progress, _Snapshot

    at, out = 6, tmp_path / "o"
    grabbed: dict = {}

    class Grab(TrainerCallback):  # the survivors' state when step `at` starts
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == at:
                grabbed["sd"] = copy.deepcopy(progress.state_dict())
                grabbed["model"] = copy.deepcopy(job.model.state_dict())
                grabbed["opt"] = copy.deepcopy(job.optimizer.state_dict())
                grabbed["sched"] = copy.deepcopy(job.lr_scheduler.state_dict())

    class Load(TrainerCallback):  # the received state, applied once the model is wrapped
        def on_train_begin(self, args, state, control, **kw):
            spare.model.load_state_dict(grabbed["model"])
            spare.optimizer.load_state_dict(grabbed["opt"])
            spare.lr_scheduler.load_state_dict(grabbed["sched"])
            got = _Progress(spare)
            got.load_state_dict(grabbed["sd"])
            spare._progress = got
            spare._apply_received()

    args = _args(tmp_path, max_steps=12, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2, save_strategy="steps", save_steps=3,
                 lr_scheduler_type="linear", learning_rate=0.05)
    job = Trainer(model=_model(), args=args, train_dataset=_Rows(40))
    progress = _Progress(job)
    job.add_callback(_Snapshot(progress))
    job.add_callback(Grab())
    job.train()
    shutil.copytree(out, tmp_path / "job")
    lost = out / f"checkpoint-{at}"
    for p in lost.iterdir():  # rank 0 died after the weights
        if p.name != "model.safetensors":
            p.unlink()
    for n in range(at + 3, 13, 3):
        shutil.rmtree(out / f"checkpoint-{n}")
    spare = Trainer(model=_model(), args=args, train_dataset=_Rows(40), callbacks=[Load()])
    spare.train()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "job")
                                                           .iterdir())
    for n in range(at, 13, 3):
        mine, theirs = out / f"checkpoint-{n}", tmp_path / "job" / f"checkpoint-{n}"
        assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())
        assert (mine / "model.safetensors").read_bytes() == \
            (theirs / "model.safetensors").read_bytes(), n
        for name in ("optimizer.pt", "scheduler.pt"):
            a, b = (torch.load(d / name, weights_only=False) for d in (mine, theirs))
            assert _same(a, b), (n, name)
    # a complete checkpoint at the step the job is at: left alone
    before = (out / f"checkpoint-{at}" / "trainer_state.json").stat().st_mtime_ns
    spare._write_lost_checkpoint()  # at step 12: its checkpoint complete
    spare.state.global_step = at
    spare._write_lost_checkpoint()
    assert (out / f"checkpoint-{at}" / "trainer_state.json").stat().st_mtime_ns == before


def _same(a, b) -> bool:
    """Equal bit for bit: tensors by value and dtype, the rest by ==."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_commit_digest_does_not_copy_the_trainers_progress(tmp_path):
    """Issue 44: the heartbeat digest (every commit) covers no tensor of the Trainer's
    progress, and does not build its ``state_dict`` to find out (a copy of the log history,
    which grows with the run)."""
    from agent.digests import covered
    from agent.hf import Trainer, _Progress

    job = Trainer(model=_model(), args=_args(tmp_path, max_steps=1), train_dataset=_Rows(4))
    progress = _Progress(job)
    job.state.log_history = [{"step": i, "loss": 1.0} for i in range(1000)]
    progress.take()

    def copied() -> dict:
        raise AssertionError("state_dict built at a commit")

    progress.state_dict = copied
    assert covered({"hf_progress": progress}) == []
