"""Ceaseless agent: the library a training script imports.

    import agent
    with agent.Session.from_env(global_batch_size=64, seed=0) as s:
        s.register(model=model, optimizer=opt, scheduler=sched)
        for step in s.steps(total=1000):
            for batch in s.batches(dataset, micro_batch_size=8):
                s.backward(loss_fn(model, batch))
            s.step()
"""

from .config import AgentConfig
from .session import Session

__all__ = ["AgentConfig", "Session"]
