"""A module whose import sets an environment variable, as `import torch` sets
TORCHINDUCTOR_CACHE_DIR: preloaded by a zygote in tests/test_prefork.py."""

import os

os.environ.setdefault("SET_BY_IMPORT", "1")
