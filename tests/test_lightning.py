"""Issue 44: PyTorch Lightning's ``Trainer(strategy=CeaselessStrategy())`` (agent/lightning.py)
in one process: the "after" example is the "before" with one line changed and trains to the
same parameters; what the strategy does not support is refused before any process group,
saying what to do. Skipped when lightning is not installed. (Under ``ceaseless up``, with
faults: tests/test_lightning_e2e.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

from harness import REPO  # noqa: E402

BEFORE = "examples/frameworks/lightning_before.py"
AFTER = "examples/frameworks/lightning_after.py"
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
        r = subprocess.run([sys.executable, script, "--max-steps", "6", "--out", str(out)],
                           cwd=REPO, env=_plain_env(), capture_output=True, text=True,
                           timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        shas.append(out.read_text().strip())
    assert shas[0] == shas[1] and len(shas[0]) == 64


def _trainer(**kw):
    import lightning as L

    from agent.lightning import CeaselessStrategy

    return L.Trainer(accelerator="cpu", devices=1, strategy=CeaselessStrategy(), max_steps=2,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kw)


def _module(manual: bool = False):
    import lightning as L
    import torch

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return M()


def _data():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)


@pytest.mark.parametrize("case, says", [
    ("manual", "manual optimization"),
    ("fp16", "precision="),
])
def test_unsupported_is_refused_at_start_with_what_to_do(case, says):
    import torch.distributed as dist

    kw = {"fp16": {"precision": "16-mixed"}}
    try:
        trainer = _trainer(**kw.get(case, {}))
    except Exception as e:  # Lightning itself refuses 16-mixed on a CPU in some versions
        if case == "fp16":
            pytest.skip(f"Lightning refuses it first: {e}")
        raise
    if case == "fp16" and trainer.precision != "16-mixed":
        pytest.skip(f"Lightning made it {trainer.precision} here (a CPU)")
    with pytest.raises(NotImplementedError, match=says):
        trainer.fit(_module(manual=case == "manual"), _data())
    assert not dist.is_initialized()  # refused before any process group


def test_the_name_is_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    import agent.lightning  # noqa: F401

    assert "ceaseless" in StrategyRegistry


def _same(a, b, path="") -> None:
    """Checkpoint contents equal: tensors bit for bit, everything else ==."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("at, accumulate", [(1, 1), (5, 1), (12, 1), (13, 1), (15, 1),
                                            (16, 1), (19, 1), (1, 2), (4, 2), (5, 2), (6, 2),
                                            (10, 2)])
def test_a_received_loop_snapshot_resumes_at_the_jobs_step_epoch_batch_and_data(
        at, accumulate, tmp_path):
    """What a promoted spare gets (agent/lightning.py: the fit loop's snapshot and the
    callbacks' state as of the last committed step, loaded before ``fit`` runs, and the
    DataLoader skipping the epoch's done batches): a second Trainer that loads the first's
    snapshot at step ``at`` trains on the same (global step, epoch, batch index, batch, the
    whole fit loop's state) from there, mid-epoch, at an epoch's first batch (the snapshot of
    a last batch), after a validation (every 3 steps) and at the last step; its
    ModelCheckpoint (every 3 steps) writes the same files as the job's, and the one the job
    wrote at step ``at`` (12, 15), absent as if rank 0 died writing it, is written again,
    the same. 5 batches an epoch, shuffled by a DistributedSampler. With
    ``accumulate_grad_batches=2`` (3 steps an epoch, the last of one batch; validation every
    3 batches, inside a window too): the snapshot is a window's end and the spare computes
    every micro-batch of the job's step ``at`` onwards, each with the job's batch."""
    import copy
    import shutil

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from agent.lightning import _LoopState, _SkipDone, _Snapshot, write_lost_checkpoint

    seen: dict[str, list] = {}

    class M(L.LightningModule):
        def __init__(self, tag):
            super().__init__()
            self.tag, self.lin = tag, torch.nn.Linear(4, 1)

        def training_step(self, b, i):
            seen.setdefault(self.tag, []).append(
                (self.trainer.global_step, self.trainer.current_epoch, i, float(b[0].sum()),
                 self.trainer.fit_loop.epoch_loop._batches_that_stepped,  # the logging step
                 copy.deepcopy(self.trainer.fit_loop.state_dict())))
            return self.lin(b[0]).pow(2).mean()

        def validation_step(self, b, i):
            self.log("val", self.lin(b[0]).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    taken, received = _LoopState(None), _LoopState(None)

    class Skip(SingleDeviceStrategy):
        def process_dataloader(self, dl):
            train = self.lightning_module.trainer.state.stage.value == "train"
            return _SkipDone(dl, received) if train else dl

    snap: dict = {}
    ckdir = tmp_path / "ck"

    class Grab(L.Callback):  # what the survivors hold when step `at` starts
        def on_train_batch_start(self, trainer, *a):
            if trainer.global_step == at:
                snap["s"] = copy.deepcopy(taken.state_dict())
                snap["model"] = copy.deepcopy(trainer.lightning_module.state_dict())
                snap["opt"] = copy.deepcopy(trainer.optimizers[0].state_dict())

    class Load(L.Callback):  # before the loop runs, as in the spare's strategy.setup
        def setup(self, trainer, pl_module, stage):
            received.trainer = trainer
            received.load_state_dict(snap["s"])

        def on_fit_start(self, trainer, pl_module):  # after the strategy's set-up
            pl_module.load_state_dict(snap["model"])  # the rest of the job's state
            trainer.optimizers[0].load_state_dict(snap["opt"])
            write_lost_checkpoint(trainer, received)  # the job's at `at`: not in ckdir

    ds = TensorDataset(torch.arange(40.).reshape(10, 4) / 40)
    data = DataLoader(ds, batch_size=2,
                      sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True))
    val = DataLoader(TensorDataset(torch.ones(4, 4)), batch_size=2)
    for tag, cbs in (("job", []), ("spare", [Load()])):
        mc = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=3, save_top_k=-1)
        t = L.Trainer(accelerator="cpu", strategy=Skip(device=torch.device("cpu")),
                      max_steps=20, logger=False, accumulate_grad_batches=accumulate, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[*cbs, mc], val_check_interval=3,
                      check_val_every_n_epoch=None, num_sanity_val_steps=0)
        if tag == "job":
            taken.trainer = t
            t.callbacks += [_Snapshot(taken), Grab()]  # after ModelCheckpoint, as in setup
        t.fit(M(tag), data, val)
        if tag == "job":
            shutil.copytree(ckdir, tmp_path / "job")
            shutil.rmtree(ckdir)
    job = [x for x in seen["job"] if x[0] >= at]  # every micro-batch from step `at` on
    assert seen["spare"][0][0] == at and len(seen["spare"]) == len(job)
    for got, want in zip(seen["spare"], job):
        _same(got, want, f"step {got[0]} batch {got[2]}")
    written = sorted(p.name for p in ckdir.iterdir()) if ckdir.exists() else []
    want = sorted(p.name for p in (tmp_path / "job").iterdir()
                  if int(p.stem.split("step=")[1]) >= at)
    assert written == want
    for name in written:
        _same(torch.load(ckdir / name, weights_only=False),
              torch.load(tmp_path / "job" / name, weights_only=False), name)


def test_the_commit_digest_covers_the_callbacks_tensors_not_a_walk_of_the_loop():
    """The heartbeat digest (every commit) takes the loop state's tensors from
    ``digest_tensors`` (the callbacks' scores), not by walking the loop's counters: that walk
    cost as much as the rest of the digest per step (bench lightning)."""
    import torch

    from agent.digests import covered
    from agent.lightning import _LoopState

    loops = _LoopState(trainer=None)
    score = torch.tensor(0.5)
    loops.snap = {"epoch_progress": {"total": {"completed": 3}}, "stray": torch.ones(2)}
    loops.callbacks = {"ModelCheckpoint{'monitor': 'val_loss'}": {"best_model_score": score}}
    got = covered({"lightning_loops": loops})
    assert [id(t) for t in got] == [id(score)]


def test_fabric_is_refused_at_once_saying_what_to_do():
    """``Fabric(strategy="ceaseless")`` is not supported yet: this module's error (the DDP
    drop-in is what to use), not Lightning's "invalid strategy", and no process group."""
    import torch.distributed as dist
    from lightning.fabric import Fabric

    import agent.lightning  # noqa: F401  (registers the names)

    with pytest.raises(NotImplementedError, match="drop-in"):
        Fabric(accelerator="cpu", devices=1, strategy="ceaseless")
    assert not dist.is_initialized()


def test_the_loop_snapshot_is_the_loops_state_dict_made_for_less():
    """``lightning_loops.loop_state`` (the snapshot at every step's end, issue 44) gives what
    ``fit_loop.state_dict()`` gives at every batch end, validation and epoch's end of a fit
    (the same keys in the same order, equal values), as fresh objects. (Its cost is
    measured in docs/benchmarks.md, not here.)"""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from agent.lightning_loops import loop_state

    checked: list[int] = []

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, b, i):
            return self.lin(b[0]).pow(2).mean()

        def validation_step(self, b, i):
            self.log("val", self.lin(b[0]).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def check(trainer):
        want, got = trainer.fit_loop.state_dict(), loop_state(trainer.fit_loop)
        assert list(got) == list(want) and got == want
        assert all(list(got[k]) == list(want[k]) for k in want if isinstance(want[k], dict))
        got["epoch_progress"]["total"]["completed"] += 100  # a copy, not the loop's
        assert trainer.fit_loop.state_dict() == want
        checked.append(trainer.global_step)

    class Check(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            check(trainer)

        def on_validation_end(self, trainer, *a):
            check(trainer)

        def on_train_epoch_end(self, trainer, *a):
            check(trainer)


    data = DataLoader(TensorDataset(torch.arange(40.).reshape(10, 4) / 40), batch_size=2)
    val = DataLoader(TensorDataset(torch.ones(4, 4)), batch_size=2)
    t = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False,
                  accumulate_grad_batches=2, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, callbacks=[Check()],
                  val_check_interval=3, check_val_every_n_epoch=None, num_sanity_val_steps=0)
    t.fit(M(), data, val)
    assert len(checked) > 20
