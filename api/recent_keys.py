"""Key digests that authenticated recently, in this process: a small LRU with a time to live.

The failed-auth limit counts per client address, and behind a proxy or NAT many clients share
one. A key that authenticated a moment ago is known to be valid, so a flood of bogus keys from
its address must not lock it out; any other key from a limited address is still refused without
a lookup (guessing stays free of database work). Bounded in entries and age, so a stream of
valid keys cannot grow it and a revoked key is forgotten within the TTL (or at once, when a
lookup refuses it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_TTL_S = 60.0


class RecentKeys:
    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # digest -> when it last authenticated
        self._lock = threading.Lock()  # uvicorn serves on one loop, but tests drive apps from threads

    def add(self, digest: str) -> None:
        with self._lock:
            self._seen[digest] = self.clock()
            self._seen.move_to_end(digest)
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)

    def contains(self, digest: str) -> bool:
        with self._lock:
            seen = self._seen.get(digest)
            if seen is None:
                return False
            if self.clock() - seen > self.ttl_s:
                del self._seen[digest]
                return False
            self._seen.move_to_end(digest)
            return True

    def discard(self, digest: str) -> None:
        with self._lock:
            self._seen.pop(digest, None)

    def __len__(self) -> int:
        with self._lock:
            now = self.clock()
            for digest in [d for d, seen in self._seen.items() if now - seen > self.ttl_s]:
                del self._seen[digest]
            return len(self._seen)
