"""``Fabric(strategy="ceaseless")``: not supported yet (issue 44), refused with what to do.

Registered in Fabric's own strategy registry (once ``agent.lightning`` is imported, as for the
Trainer's name), so the user gets this module's error at ``Fabric(...)``, not Lightning's
"invalid strategy name", and no process group is created first. A Fabric script owns its loop:
the DDP drop-in (``agent.ddp``) is what runs it under ``ceaseless up`` today.
"""

from __future__ import annotations

from typing import Any

NAME = "ceaseless"
WHAT_TO_DO = (
    "Fabric(strategy='ceaseless') is not supported yet: only the Trainer is "
    "(Trainer(strategy='ceaseless')). A Fabric script owns its training loop: port it with "
    "the DDP drop-in instead (`import agent.ddp as dist`, `model = dist.DistributedDataParallel"
    "(model)`, `dist.iteration(step)` in the loop's condition; docs/porting.md, \"The drop-in\")")


class CeaselessFabricStrategy:
    """What ``Fabric``'s registry builds for the name: refuses at once."""

    def __init__(self, **kwargs: Any) -> None:
        raise NotImplementedError(WHAT_TO_DO)


def register() -> None:
    """Add the name to Fabric's registry (idempotent; nothing without lightning.fabric)."""
    try:
        from lightning.fabric.strategies import STRATEGY_REGISTRY
    except ImportError:
        return
    if NAME not in STRATEGY_REGISTRY:
        STRATEGY_REGISTRY.register(NAME, CeaselessFabricStrategy,
                                   description="not supported yet: refused with what to do "
                                   "(agent.lightning_fabric)")
