"""Memory-mapped, cached, elastic-aware data loading (see docs/data.md).

Typical use inside a training Session::

    loader = ElasticLoader.from_dir(data_dir, global_batch_size=B, micro_batch_size=m, seed=s)
    loader.seek(restore_step + 1, rank, world_size)      # O(1), after every (re)plan
    for k, (x, y) in loader:                              # this rank's micro-batches of the step
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .corpus import generate
from .format import FORMAT_VERSION, DataError, Index, read_index
from .order import GlobalOrder, micro_seed
from .prepare import ByteTokenizer, load_tokenizer, prepare

if TYPE_CHECKING:
    from .dataset import TokenDataset
    from .loader import ElasticLoader, open_loader

__all__ = [
    "FORMAT_VERSION",
    "ByteTokenizer",
    "DataError",
    "ElasticLoader",
    "GlobalOrder",
    "Index",
    "TokenDataset",
    "generate",
    "load_tokenizer",
    "micro_seed",
    "open_loader",
    "prepare",
    "read_index",
]


def __getattr__(name: str) -> Any:
    # The torch-backed parts load on first use: the launcher and the CLI generate and
    # inspect data without importing torch (about 2 s on a small machine).
    if name == "TokenDataset":
        from .dataset import TokenDataset

        return TokenDataset
    if name in ("ElasticLoader", "open_loader"):
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'agent.data' has no attribute {name!r}")
