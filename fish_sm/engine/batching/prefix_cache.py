"""KV caches of prompt prefixes: a reference voice's part of a prompt is prefilled once."""

from __future__ import annotations

import collections

from torch import Tensor


class PrefixCache:
    """KV caches of prompt prefixes (the reference voices' part), least recently used out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        # key -> `cache_rows` of the prefix: k, v of each layer in turn, cloned
        self._entries: collections.OrderedDict[tuple, list[Tensor]] = collections.OrderedDict()

    def get(self, key: tuple):
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple, kv: list[Tensor]) -> None:
        if self.capacity < 1:
            return
        self._entries[key] = kv
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
