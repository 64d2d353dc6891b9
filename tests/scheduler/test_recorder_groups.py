"""The recorder's groups: replies that arrive one after another while a group waits are committed
with it, in one transaction, rather than one commit each."""

from __future__ import annotations

import asyncio

from backfill.jobs.execution.claims import ClaimedRequest
from backfill.scheduler.drain.recorder import Done, Recorder


def claimed(line: int) -> ClaimedRequest:
    return ClaimedRequest("b", line, f"r{line}", 0, 1, 0, "key", "/v1/chat/completions", 0)


def test_replies_arriving_one_by_one_are_committed_as_one_group() -> None:
    groups: list[list[int]] = []
    recorder = Recorder(holder="h", max_attempts=3, patience_s=1.0, finish_by=lambda: None)

    async def commit(group: list[Done]) -> None:
        groups.append([d.request.line for d in group])

    recorder._commit_group = commit  # type: ignore[method-assign]

    async def main() -> None:
        writer = asyncio.create_task(recorder.run())
        await recorder.put(Done(claimed(3), None))
        await asyncio.sleep(0)  # the recorder takes the first reply and waits for more
        for line in (1, 2, 5, 4):  # each arrives on its own, while that group waits
            await recorder.put(Done(claimed(line), None))
            await asyncio.sleep(0)
        await recorder.queue.put(None)
        await writer

    asyncio.run(main())
    assert groups == [[1, 2, 3, 4, 5]]  # one commit, in line order
