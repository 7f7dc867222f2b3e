"""Ceaseless agent: the library a training script imports.

    import agent
    with agent.Session.from_env(global_batch_size=64, seed=0) as s:
        s.register(model=model, optimizer=opt, scheduler=sched)
        for step in s.steps(total=1000):
            for batch in s.batches(dataset, micro_batch_size=8):
                s.backward(loss_fn(model, batch))
            s.step()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import AgentConfig
    from .session import Session, init

__all__ = ["AgentConfig", "Session", "init"]


def __getattr__(name: str) -> Any:
    # Lazy: `agent.data` and the other torch-free parts are imported by the launcher and the
    # CLI, which should not pay for importing torch (about 2 s on a small machine).
    if name == "Session":
        from .session import Session

        return Session
    if name == "init":  # s = agent.init(global_batch_size=64): a session without `with`
        from .session import init

        return init
    if name == "AgentConfig":
        from .config import AgentConfig

        return AgentConfig
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
