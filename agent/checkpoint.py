"""Last-resort checkpoints of the committed state (issue 20), with torch.distributed.checkpoint.

Recovery never reads a checkpoint: replacements take the state from their peers' memory.
These are for the case where no holder survives (the whole job lost at once, every replica
of the state gone) and for starting a new job from an old one (``ceaseless up --resume``).

* ``Checkpointer.after_commit(step, state)`` (rank 0, after a committed step): every
  ``every`` steps (or ``interval_s`` seconds after the last one, whichever comes first;
  ``ceaseless up`` asks for one more when it is stopped), a host copy of the committed state (``TrainState.snapshot``, the copy
  shadow spares start from) is taken on the training thread and written by a background
  thread with ``torch.distributed.checkpoint`` (one ``FileSystemWriter`` checkpoint per step:
  the flat buffers as tensors, the picklable skeleton as bytes), into ``.step-N.tmp`` and
  renamed to ``step-N`` once complete, with a ``manifest.json``. A half-written checkpoint is
  never a ``step-N`` directory, so it is never used. The newest ``keep`` are kept. A save
  still running when the next one is due is not queued: that one is skipped (logged).
* ``latest(directory)``: the newest complete checkpoint; ``load(path, state)`` restores it
  into a ``TrainState`` and returns its step.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from plumbing import logs

log = logs.get("agent")

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8,})$")


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs without a process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
        yield


def write(path: Path, flat: Any, step: int) -> Path:
    """Write ``flat`` (a FlatState of step ``step``) as checkpoint directory ``path``,
    atomically (a temporary directory renamed when complete). Returns ``path``."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    blob = pickle.dumps(flat.skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    sd = {"buffers": {f"b{i}": b.cpu() for i, b in enumerate(flat.buffers)},
          "skeleton": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}
    with _quiet():
        _dcp().save(sd, checkpoint_id=str(tmp), no_dist=True)
    (tmp / "manifest.json").write_text(json.dumps(
        {"format": FORMAT, "step": step, "buffers": len(flat.buffers), "time": time.time(),
         "nbytes": flat.nbytes}))
    if path.exists():  # the same step written before (a job resumed from an older one):
        shutil.rmtree(path)  # training is deterministic, so it is the same state; replace it
    os.replace(tmp, path)  # atomic on one filesystem: complete, or not there
    return path


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (None: none)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and (p / "manifest.json").exists():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def resolve(path: str | Path) -> Path | None:
    """``path`` itself if it is a complete checkpoint, else the newest one under it."""
    p = Path(path)
    return p if (p / "manifest.json").exists() else latest(p)


def manifest(path: str | Path) -> dict[str, Any]:
    """A complete checkpoint's manifest: format, step, buffers, time (written), nbytes."""
    return json.loads((Path(path) / "manifest.json").read_text())


def read(path: str | Path) -> tuple[Any, int]:
    """The FlatState stored in checkpoint ``path`` and its step."""
    from .state import FlatState

    path = Path(path)
    man = manifest(path)
    if man.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {man.get('format')} (this code reads "
                         f"{FORMAT})")
    dcp = _dcp()
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd: dict[str, Any] = {"buffers": {}, "skeleton": None}
    for key, meta in md.state_dict_metadata.items():
        size = tuple(meta.size)
        t = torch.empty(size, dtype=meta.properties.dtype)
        if key == "skeleton":
            sd["skeleton"] = t
        elif key.startswith("buffers."):
            sd["buffers"][key.split(".", 1)[1]] = t
    with _quiet():
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    skeleton = pickle.loads(sd["skeleton"].numpy().tobytes())
    buffers = [sd["buffers"][f"b{i}"] for i in range(man["buffers"])]
    return FlatState(skeleton=skeleton, buffers=buffers), int(man["step"])


def load(path: str | Path, state: Any) -> int:
    """Restore checkpoint ``path`` into a ``TrainState``; returns its step."""
    flat, step = read(path)
    return state.restore(flat, default_step=step)


class Checkpointer:
    def __init__(self, directory: str | Path, every: int, keep: int = 3,
                 interval_s: float | None = None) -> None:
        if every < 1 or keep < 1 or (interval_s is not None and not interval_s > 0):
            raise ValueError(f"checkpoints: every >= 1, keep >= 1, interval > 0 (got {every}, "
                             f"{keep}, {interval_s})")
        self.dir = Path(directory)
        self.every, self.keep, self.interval_s = every, keep, interval_s
        self._last = time.monotonic()  # the interval counts from the start
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.saved: list[int] = []      # steps written, in order
        self.skipped: list[int] = []    # steps not written: the previous save still ran
        self.error: str | None = None

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0 or (
            self.interval_s is not None and time.monotonic() - self._last >= self.interval_s)

    def after_commit(self, step: int, state: Any) -> bool:
        """Step ``step`` is committed: start its checkpoint if one is due. True if started."""
        if not self.due(step):
            return False
        return self.save(step, state)

    def save(self, step: int, state: Any) -> bool:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self.skipped.append(step)
                log.warning("checkpoint skipped: the previous one is still being written",
                            step=step)
                return False
            flat = state.snapshot()  # host copy now: the training thread changes the state next
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._write, args=(step, flat),
                                            name=f"checkpoint-{step}", daemon=True)
            self._thread.start()
            return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in progress (e.g. before exiting); True when none runs."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def _write(self, step: int, flat: Any) -> None:
        t0 = time.perf_counter()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = write(self.dir / f"step-{step:08d}", flat, step)
            self.saved.append(step)
            self._prune()
            log.info("checkpoint written", step=step, path=str(path),
                     seconds=round(time.perf_counter() - t0, 3), nbytes=flat.nbytes)
        except Exception as e:  # a full disk must not stop training: say so and go on
            self.error = f"{type(e).__name__}: {e}"[:500]
            log.warning("checkpoint failed", step=step, error=self.error)

    def _prune(self) -> None:
        done = sorted((int(m.group(1)), p) for p in self.dir.iterdir()
                      if (m := _NAME.match(p.name)))
        for _, p in done[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)
