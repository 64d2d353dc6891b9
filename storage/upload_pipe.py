"""Feeding an object store's streaming `put` from a producer on another thread.

A producer that reads its bytes a page at a time (finalization reading rows) hands each page to
a put running on a thread of its own, so reading and uploading overlap, through a bounded queue,
so no more than a few pages wait in memory. A put starts with its first bytes, so a stream that
turns out empty creates no object; a producer that fails aborts the put, so no object appears.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from backfill.storage.objects import ObjectStore

QUEUED_CHUNKS = 2  # chunks waiting for each put: with the producer's own, a bounded backlog
_WAIT_S = 0.2  # how long a hand-off waits before it looks again whether its put has stopped
_END, _ABORT = object(), object()  # what a put is handed last: all bytes sent, or the producer failed


class ProducerFailed(Exception):
    """Ends a put whose bytes stopped coming: the object must not be completed."""


class Upload:
    """One object's `store.put` on a thread of its own, fed a chunk at a time through a bounded
    queue. It starts with the first non-empty chunk, so an object without bytes is never created.

    Neither side can wait for good on the other: the put waits only for what the producer always
    hands it last (`end`), and the producer's waits on a full queue look again every _WAIT_S
    whether the put has stopped (a failed put: the producer raises its error at the next `send`)."""

    def __init__(self, pool: ThreadPoolExecutor, store: ObjectStore, key: str) -> None:
        self._pool, self._store, self._key = pool, store, key
        self._queue: queue.Queue[object] = queue.Queue(QUEUED_CHUNKS)
        self._put: Future[int] | None = None

    def send(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._put is None:
            self._put = self._pool.submit(self._store.put, self._key, self._chunks())
        if self._put.done() or not self._hand(chunk):
            self._put.result()  # its failure, now: no point producing further
            raise RuntimeError(f"the put of {self._key} returned before its last chunk")

    def end(self, *, abort: bool = False) -> None:
        """Tell the put there is no more, or (`abort`) that it must fail; never raises its error."""
        if self._put is not None:
            self._hand(_ABORT if abort else _END)

    def size(self) -> int | None:
        """The bytes written (None when nothing was sent), or the put's failure; after `end`."""
        return None if self._put is None else self._put.result()

    def _hand(self, item: object) -> bool:
        """Queue `item` for the put; False if the put stopped before taking it."""
        assert self._put is not None
        while True:
            try:
                self._queue.put(item, timeout=_WAIT_S)
                return True
            except queue.Full:
                if self._put.done():
                    return False

    def _chunks(self) -> Iterator[bytes]:
        while (item := self._queue.get()) is not _END:
            if item is _ABORT:
                raise ProducerFailed(f"the bytes of {self._key} stopped coming")
            assert isinstance(item, bytes)
            yield item


@contextmanager
def uploads(store: ObjectStore, keys: Sequence[str], *, thread_name_prefix: str = "upload") -> Iterator[list[Upload]]:
    """An `Upload` per key; on leaving, each is ended (aborted if the block raised) and waited
    for, so no put is left running or lands later. A put's failure is raised by its `size`."""
    with ThreadPoolExecutor(len(keys), thread_name_prefix=thread_name_prefix) as pool:
        started = [Upload(pool, store, key) for key in keys]
        try:
            yield started
        except BaseException:
            for upload in started:
                upload.end(abort=True)
            raise
        for upload in started:
            upload.end()
