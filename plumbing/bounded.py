"""A set that forgets its oldest keys past a bound, so input cannot grow a service's memory."""

from __future__ import annotations

from collections import OrderedDict


class BoundedSet(OrderedDict):
    def __init__(self, maxlen: int = 4096) -> None:
        super().__init__()
        self.maxlen = maxlen

    def add(self, key: str) -> None:
        self[key] = None
        self.move_to_end(key)
        while len(self) > self.maxlen:
            self.popitem(last=False)
