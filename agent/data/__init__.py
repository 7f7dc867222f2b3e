"""Memory-mapped, cached, elastic-aware data loading (see docs/data.md).

Typical use inside a training Session::

    loader = ElasticLoader.from_dir(data_dir, global_batch_size=B, micro_batch_size=m, seed=s)
    loader.seek(restore_step + 1, rank, world_size)      # O(1), after every (re)plan
    for k, (x, y) in loader:                              # this rank's micro-batches of the step
        ...
"""

from .corpus import generate
from .dataset import TokenDataset
from .format import FORMAT_VERSION, DataError, Index, read_index
from .loader import ElasticLoader, open_loader
from .order import GlobalOrder, micro_seed
from .prepare import ByteTokenizer, load_tokenizer, prepare

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
