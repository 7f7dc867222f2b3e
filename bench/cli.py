"""`ceaseless bench ...`: the benchmarks, as CLI subcommands.

``register(sub)`` adds ``bench`` to the top-level subparsers (ops.cli finds it through the
entry-point group ``ceaseless.commands`` in pyproject.toml). Each benchmark adds one
subcommand through a ``_<name>`` function here; the heavy imports happen only when a
subcommand runs.
"""

from __future__ import annotations

import argparse


def _data(bsub) -> None:
    from bench import data_bench

    p = bsub.add_parser("data", help=HELP["data"],
                        description=data_bench.__doc__.split("\n")[0])
    data_bench.add_arguments(p)

    def run(args: argparse.Namespace) -> int:
        import sys

        argv = sys.argv[sys.argv.index("data") + 1:] if "data" in sys.argv else []
        return data_bench.run(args, argv)

    p.set_defaults(func=run)


def _module(bsub, name: str, module: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    p = bsub.add_parser(name, help=HELP[name], description=mod.__doc__.split("\n")[0])
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)


HELP = {"data": "data loading: throughput vs DataLoader, reposition, spare first batch",
        "recovery": "downtime and phases of in-process recovery",
        "overhead": "step time under Ceaseless vs plain DDP (or --bus-servers N vs 1)",
        "control-plane": "simulated agents vs the services: detection, plan delivery, CPU",
        "message-sizes": "messages that grow with the job (plan, health view, status), by size",
        "init": "process-group creation: NATS-backed store vs TCPStore, per generation",
        "elastic": "capacity/priority events: join and release times, pause of the others",
        "goodput": "fixed-length run with a fault every K seconds: useful time / wall time",
        "liveness": "rank-0 SIGKILLs with a spare under CPU load, repeated: hangs, bitwise",
        "healing": "replacement pods (refill, grow back) and last-resort checkpoints' cost",
        "sharded": "sharded models (FSDP2/HSDP): step time, state bytes, crash, replica join",
        "size": "real model sizes: peak memory per role, transfer vs the link, kill bitwise",
        "dropin": "the DDP drop-in's step time against the Session API's, side by side",
        "lightning": "Lightning (or --framework hf: the HF Trainer) step time against its own DDP",
        "guards": "state verification's cost; a preemption's hand-over against a crash"}


def register(sub, lazy: bool = False) -> argparse.ArgumentParser:
    """``lazy``: list the benchmarks without importing them (not running one)."""
    p = sub.add_parser("bench", help="run a benchmark", description="Benchmarks (see docs/benchmarks.md).")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bsub.required = True
    if lazy:
        for name, h in HELP.items():
            bsub.add_parser(name, help=h)
        return p
    _data(bsub)
    _module(bsub, "recovery", "bench.recovery")
    _module(bsub, "overhead", "bench.overhead")
    _module(bsub, "control-plane", "bench.control_plane")
    _module(bsub, "message-sizes", "bench.message_sizes")
    _module(bsub, "init", "bench.init_bench")
    _module(bsub, "elastic", "bench.elastic")
    _module(bsub, "goodput", "bench.goodput")
    _module(bsub, "liveness", "bench.liveness")
    _module(bsub, "healing", "bench.healing")
    _module(bsub, "sharded", "bench.sharded")
    _module(bsub, "size", "bench.size")
    _module(bsub, "dropin", "bench.dropin")
    _module(bsub, "lightning", "bench.lightning_bench")
    _module(bsub, "guards", "bench.guards")
    return p
