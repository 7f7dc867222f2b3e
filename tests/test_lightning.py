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
pytestmark = [pytest.mark.timeout(300)]


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
    ("accumulate", "accumulate_grad_batches"),
    ("fp16", "precision="),
])
def test_unsupported_is_refused_at_start_with_what_to_do(case, says):
    import torch.distributed as dist

    kw = {"accumulate": {"accumulate_grad_batches": 2}, "fp16": {"precision": "16-mixed"}}
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


@pytest.mark.parametrize("at", [1, 5, 13, 15, 16, 19])
def test_a_received_loop_snapshot_resumes_at_the_jobs_step_epoch_batch_and_data(at):
    """What a promoted spare gets (agent/lightning.py: the fit loop's snapshot as of the last
    committed step, loaded before ``fit`` runs, and the DataLoader skipping the epoch's done
    batches): a second Trainer that loads the first's snapshot at step ``at`` trains on the
    same (global step, epoch, batch index, batch) from there, mid-epoch, at an epoch's first
    batch (the snapshot of a last batch) and at the last step. 5 batches an epoch, shuffled
    by a DistributedSampler."""
    import copy

    import lightning as L
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from agent.lightning import _LoopState, _SkipDone, _Snapshot

    seen: dict[str, list] = {}

    class M(L.LightningModule):
        def __init__(self, tag):
            super().__init__()
            self.tag, self.lin = tag, torch.nn.Linear(4, 1)

        def training_step(self, b, i):
            seen.setdefault(self.tag, []).append(
                (self.trainer.global_step, self.trainer.current_epoch, i, float(b[0].sum()),
                 self.trainer.fit_loop.epoch_loop._batches_that_stepped))  # the logging step
            return self.lin(b[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    taken, received = _LoopState(None), _LoopState(None)

    class Skip(SingleDeviceStrategy):
        def process_dataloader(self, dl):
            train = self.lightning_module.trainer.state.stage.value == "train"
            return _SkipDone(dl, received) if train else dl

    snap: dict = {}

    class Grab(L.Callback):  # what the survivors hold when step `at` starts
        def on_train_batch_start(self, trainer, *a):
            if trainer.global_step == at:
                snap["s"] = copy.deepcopy(taken.snap)

    class Load(L.Callback):  # before the loop runs, as in the spare's strategy.setup
        def setup(self, trainer, pl_module, stage):
            received.trainer = trainer
            received.load_state_dict({"fit_loop": snap["s"]})

    ds = TensorDataset(torch.arange(40.).reshape(10, 4))
    data = DataLoader(ds, batch_size=2,
                      sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True))
    for tag, cbs in (("job", [_Snapshot(taken), Grab()]), ("spare", [Load()])):
        t = L.Trainer(accelerator="cpu", strategy=Skip(device=torch.device("cpu")),
                      max_steps=20, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
        taken.trainer = t if tag == "job" else taken.trainer
        t.fit(M(tag), data)
    job = {x[0]: x for x in seen["job"]}
    assert seen["spare"][0][0] == at and len(seen["spare"]) == 20 - at
    assert seen["spare"] == [job[x[0]] for x in seen["spare"]]
