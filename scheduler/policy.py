"""Which requests fill the capacity: earliest deadline first across batches."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from jobs.execution import PendingBatch


def plan(pending: Sequence[PendingBatch], slots: int, *, now: datetime) -> list[tuple[str, int]]:
    """Split `slots` releases over batches: (batch_id, how many), most urgent first."""
    out: list[tuple[str, int]] = []
    for batch in sorted(pending, key=lambda b: (b.expires_at, b.created_at, b.batch_id)):
        if slots <= 0:
            break
        take = min(slots, batch.remaining)
        if take > 0:
            out.append((batch.batch_id, take))
            slots -= take
    return out
