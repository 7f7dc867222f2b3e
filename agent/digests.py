"""What the majority digest and the transfer's agreement check cover: every registered object.

* ``covered(objs)``: the tensors of every registered object's state: each module's
  parameters (tied ones once; buffers left out: BatchNorm statistics may differ per rank by
  design, as in ``verify.py``), each optimizer's state, and the tensors in any other
  object's ``state_dict()`` (a user's extra). Sharded (FSDP2): this rank's shards.
* ``state.digest(covered(objs))``: the cheap heartbeat digest the broker takes the majority
  of, computed at every commit: a strided sample of all of them (the sample is taken on the
  device; a few thousand elements reach the host).
* ``exact(tensors)``: an int64 on the tensors' device, the sum of every tensor's bit patterns
  as integers weighted by its index (exact and order-free: equal states give equal values on
  any rank, one changed element changes it). No copy of the state: one pass over it on its
  device, one number read back. A transfer's sources send it in their header, and a recipient
  refuses sources that disagree (each stripe is checked against its own sender only: sources
  holding different states would otherwise hand it a mix). Once per transfer, not per step.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

_AS_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def covered(objs: Mapping[str, Any]) -> list[Tensor]:
    """The tensors the digests cover, in registration order (see module docstring)."""
    from .state import local

    out: list[Tensor] = []
    seen: set[int] = set()

    def add(t: Tensor) -> None:
        t = local(t)
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)

    for o in objs.values():
        if isinstance(o, torch.nn.Module):
            for p in o.parameters():
                add(p)
        elif isinstance(o, torch.optim.Optimizer):
            for st in o.state.values():
                for v in st.values():
                    if isinstance(v, Tensor):
                        add(v)
        elif hasattr(o, "state_dict"):
            for t in _tensors_in(o.state_dict()):
                add(t)
    return out


def _tensors_in(x: Any) -> Iterable[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _tensors_in(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors_in(v)


def exact(tensors: Iterable[Tensor]) -> Tensor:
    """An int64 scalar on the first tensor's device (see module docstring); no host sync."""
    acc: Tensor | None = None
    for i, t in enumerate(tensors):
        b = t.detach()
        if acc is None:
            acc = torch.zeros((), dtype=torch.int64, device=b.device)
        if b.numel() == 0:
            continue
        b = b if b.is_contiguous() else b.contiguous()
        if b.dtype == torch.bool:
            b = b.view(torch.uint8)
        x = b.view(_AS_INT[b.element_size()]) if b.element_size() in _AS_INT else \
            b.reshape(-1).view(torch.uint8)
        acc += x.sum(dtype=torch.int64).to(acc.device) * (i + 1)
    return acc if acc is not None else torch.zeros((), dtype=torch.int64)
