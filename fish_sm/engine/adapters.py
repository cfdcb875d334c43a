"""Which adapter is in which slot: adapters are read on first use (on a thread of their own,
so the rows already decoding carry on), copied into a free slot, kept while there is room and
let go least recently used first, never while a request holds them."""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

from fish_sm.kernels import AdapterSlots
from fish_sm.model.lora import Adapter, AdapterError

logger = logging.getLogger("fish_sm.adapters")


class AdapterSource(Protocol):
    """Where adapters come from (the package, S3 sources: `serving.adapters.AdapterRegistry`)."""

    def load(self, name: str) -> Adapter: ...


class AdapterCache:
    """Adapters in the slots of `AdapterSlots`, by name. `claim` and `release` run on the one
    thread that runs the model (the copies into slots are ordered with its work); reads from
    `source` run on a loader thread, and `on_ready` is called when one finishes."""

    def __init__(self, slots: AdapterSlots, source: AdapterSource, on_ready: Callable[[], None] = lambda: None):
        self.slots, self.source = slots, source
        self.on_ready = on_ready
        self._resident: collections.OrderedDict[str, int] = collections.OrderedDict()  # name -> slot, LRU first
        self._holders: collections.Counter[int] = collections.Counter()  # slot -> requests holding it
        self._free = list(range(slots.slots, 0, -1))
        self._reading: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fish-sm-adapter")
        self.loads = 0  # adapters copied into a slot so far
        self.load_seconds: dict[str, float] = {}  # the last read-and-copy time of each adapter
        self._versions: dict[str, int] = {}  # name -> which load put it in its slot
        self._stale: set[str] = set()  # changed or removed at their source: read afresh when next claimed

    # -- the model's thread ------------------------------------------------------------

    def forget(self, name: str) -> None:
        """`name` changed or was removed at its source (any thread): the copy in memory leaves
        its slot once no request holds it, and the next claim reads it afresh."""
        with self._lock:
            self._stale.add(name)
            self._reading.pop(name, None)

    def ready(self, name: str | None) -> bool:
        """Whether `claim(name)` can answer now (a slot, or the adapter's error) rather than None;
        starts reading the adapter if nobody has."""
        if name is None:
            return True
        if not self._drop_stale(name):
            return False
        if name in self._resident:
            return True
        future = self._read(name)
        return future.done() and (future.exception() is not None or self._room())

    def claim(self, name: str | None) -> int | None:
        """The adapter's slot, held until `release` (0: no adapter); None while it is being read
        or while every slot is held. Raises `AdapterError` if it cannot be read or served."""
        if name is None:
            return 0
        if not self._drop_stale(name):
            return None
        slot = self._resident.get(name)
        if slot is None:
            future = self._read(name)
            if not future.done():
                return None
            with self._lock:
                self._reading.pop(name, None)
            adapter, seconds = future.result()  # raises the read's AdapterError
            if not self._room():
                with self._lock:
                    self._reading[name] = future  # keep what was read for when a slot frees
                return None
            slot = self._place(adapter, seconds)
        self._resident.move_to_end(name)
        self._holders[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        if slot > 0:
            self._holders[slot] -= 1

    def acquire(self, name: str | None) -> int:
        """`claim`, waiting for the read (a caller outside the batching engine's scheduler)."""
        if name is None:
            return 0
        slot = self.claim(name)
        if slot is None and self._drop_stale(name) and name not in self._resident:
            self._read(name).exception()  # wait for it
            slot = self.claim(name)
        if slot is None:
            raise AdapterError(f"adapter {name!r}: every adapter slot is in use")
        return slot

    def version(self, name: str) -> int:
        """Which load put the resident adapter `name` in its slot (what was computed with an
        earlier one, e.g. a prefix's KV cache, may not hold for this one)."""
        return self._versions[name]

    def resident(self) -> list[str]:
        return list(self._resident)

    def _drop_stale(self, name: str) -> bool:
        """Let a stale copy of `name` go: False while requests still hold it."""
        with self._lock:
            if name not in self._stale:
                return True
            slot = self._resident.get(name)
            if slot is not None and self._holders[slot]:
                return False
            self._stale.discard(name)
        if slot is not None:
            del self._resident[name]
            self._free.append(slot)
        return True

    def _room(self) -> bool:
        return bool(self._free) or any(self._holders[s] == 0 for s in self._resident.values())

    def _place(self, adapter: Adapter, read_seconds: float) -> int:
        """Copy a read adapter into a free slot, or the least recently used one nobody holds."""
        if self._free:
            slot = self._free.pop()
        else:
            evicted = next(n for n, s in self._resident.items() if self._holders[s] == 0)
            slot = self._resident.pop(evicted)
            logger.info("adapters: %s leaves slot %d for %s", evicted, slot, adapter.name)
        t0 = time.perf_counter()
        try:
            self.slots.load(slot, adapter)
        except AdapterError:
            self._free.append(slot)
            raise
        self._resident[adapter.name] = slot
        self.loads += 1
        self._versions[adapter.name] = self.loads
        self.load_seconds[adapter.name] = read_seconds + time.perf_counter() - t0
        return slot

    # -- reads -------------------------------------------------------------------------

    def _read(self, name: str) -> Future:
        """The read of `name` under way or done (a failed one is tried again by the next claim)."""
        with self._lock:
            future = self._reading.get(name)
            if future is None:
                future = self._reading[name] = self._pool.submit(self._timed_read, name)
                future.add_done_callback(lambda _: self.on_ready())
        return future

    def _timed_read(self, name: str) -> tuple[Adapter, float]:
        t0 = time.perf_counter()
        try:
            adapter = self.source.load(name)
        except AdapterError:
            raise
        except Exception as exc:  # a source's own failure is this adapter's, not the server's
            raise AdapterError(f"adapter {name!r} could not be read ({type(exc).__name__}: {exc})") from None
        if adapter.rank > self.slots.rank:
            raise AdapterError(f"adapter {name!r} has rank {adapter.rank}; this server serves ranks up to "
                               f"{self.slots.rank} (FISH_SM_ADAPTER_RANK)")
        return adapter, time.perf_counter() - t0

    def stats(self) -> dict:
        return {"slots": self.slots.slots, "resident": self.resident(), "rank": self.slots.rank,
                "bytes_per_adapter": self.slots.bytes_per_slot, "loads": self.loads}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
