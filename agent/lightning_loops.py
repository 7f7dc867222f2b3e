"""The fit loop's progress as ``fit_loop.state_dict()`` gives it, made for less (issue 44).

``CeaselessStrategy`` snapshots the loop at every step's end (agent/lightning.py,
``_LoopState.take``). Lightning's ``_Loop.state_dict`` turns each progress counter object
into a dict with ``dataclasses.asdict``, which deep-copies every field on its way (~80 us
of a 4 ms step here). ``loop_state`` walks the loops as ``_Loop.state_dict`` does and builds
the same dicts (the same keys, in the same order, fresh objects) from each dataclass's
field names, cached per class; a loop or a progress class that makes its own
``state_dict`` is asked for it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress

_FIELDS: dict[type, tuple[str, ...]] = {}
_PLAIN = (int, float, bool, str, type(None))  # immutable: asdict's deepcopy returns them


def progress_dict(obj: Any) -> dict:
    """``dataclasses.asdict(obj)`` for a progress dataclass (counters, nested trackers)."""
    names = _FIELDS.get(type(obj))
    if names is None:
        names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    out = {}
    for n in names:
        v = getattr(obj, n)
        if type(v) in _PLAIN:
            out[n] = v
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[n] = progress_dict(v)
        else:
            out[n] = copy.deepcopy(v)
    return out


def loop_state(loop: Any, destination: dict | None = None, prefix: str = "") -> dict:
    """``loop.state_dict()`` (``_Loop.state_dict``'s walk, progress by ``progress_dict``)."""
    if destination is None:
        destination = {}
    if type(loop).state_dict is not _Loop.state_dict:
        return loop.state_dict(destination, prefix)
    destination[prefix + "state_dict"] = loop.on_save_checkpoint()
    for k, v in loop.__dict__.items():
        key = prefix + k
        if isinstance(v, _BaseProgress):
            own = type(v).state_dict is not _BaseProgress.state_dict
            destination[key] = v.state_dict() if own else progress_dict(v)
        elif isinstance(v, _Loop):
            loop_state(v, destination, key + ".")
    return destination
