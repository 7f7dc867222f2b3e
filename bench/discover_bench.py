"""What the drop-in's discovery of a script's optimizers costs at a pod's start (issue 43: a
pod's start is part of every join and replacement): ``agent.dropin.discover`` over the
objects of a process that imported what a Lightning script imports, against the scan it
replaced, which kept an (object, isinstance) pair for every object (the baseline, timed in the
same process).

    python -m bench.discover_bench [--repeat 5]

Prints the object count and, per method, median (min–max) seconds."""

from __future__ import annotations

import argparse
import gc
import warnings

import torch

from bench.common import fmt, machine, machine_line, summary, timings

KINDS = (torch.optim.Optimizer, torch.amp.GradScaler, torch.optim.lr_scheduler.LRScheduler)


def pairs_scan() -> list:
    """The scan before (2026-12-07, as it was): an (object, isinstance) pair per object."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objs = gc.get_objects()
        classes = [(o, isinstance(o, KINDS)) for o in objs]
    return [o for o, hit in classes if hit]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    import lightning.pytorch  # noqa: F401  (what a Lightning pod holds)

    import agent.session  # noqa: F401
    from agent.dropin import discover

    m = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(m.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # noqa: F841  (held, as a script does)
    found = sorted(discover(m, {}))
    assert found == ["optimizer", "scheduler"], found
    print(machine_line(machine()))
    print(f"objects tracked: {len(gc.get_objects()):,}")
    for name, fn in (("a pair per object (before)", pairs_scan),
                     ("discover, the candidates only (now)", lambda: discover(m, {})),
                     ("a pair per object (before)", pairs_scan)):
        print(f"{name}: {fmt(summary(timings(fn, a.repeat)), 's', 3)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
