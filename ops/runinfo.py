"""Run directories and ``cluster.json``: how every command finds a running cluster."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RUNS = Path(os.environ.get("CEASELESS_RUNS", "runs"))


@dataclass
class ClusterInfo:
    nats_url: str
    job: str
    creds: str
    run_dir: str
    pid: int
    started: float
    tls_ca: str | None = None   # the run's CA certificate when the bus serves TLS only

    def write(self) -> None:
        # written whole then renamed: a reader polling for the file (the test harness, `status`)
        # must never see it empty or half written
        p = Path(self.run_dir) / "cluster.json"
        tmp = p.with_name(f".cluster.json.{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, p)

    @classmethod
    def read(cls, run_dir: str | Path) -> "ClusterInfo":
        p = Path(run_dir) / "cluster.json"
        if not p.exists():
            raise FileNotFoundError(f"{p} not found: is this a `ceaseless up` run dir?")
        return cls(**json.loads(p.read_text()))


def new_run_dir(job: str, base: Path | None = None) -> Path:
    base = base or RUNS
    base.mkdir(parents=True, exist_ok=True)
    d = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{job}"
    n = 1
    while d.exists():
        n += 1
        d = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{job}-{n}"
    d.mkdir(parents=True)
    latest = base / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(d.name)
    except OSError:
        pass
    return d


def find_run_dir(arg: str | None) -> Path:
    """An explicit dir, else runs/latest, else the newest runs/* with a cluster.json."""
    if arg:
        return Path(arg)
    latest = RUNS / "latest"
    if (latest / "cluster.json").exists():
        return latest.resolve()
    cands = sorted((p for p in RUNS.glob("*") if (p / "cluster.json").exists()),
                   key=lambda p: p.stat().st_mtime)
    if not cands:
        raise FileNotFoundError("no run found: pass --run-dir DIR (or --nats URL --creds FILE)")
    return cands[-1]
