"""Following a batch and describing it: the live progress bar of `batch submit --wait`, the
summary at its end, and the details `batch status` prints.

The cost so far comes from backfill's extension route `GET /v1/batches/{id}/cost` (any team
key); against a server without it (OpenAI's), the cost is simply not shown.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import datetime
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

if TYPE_CHECKING:
    import openai
    from openai.types import Batch

TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
POLL_S = 1.0
# Rates are measured over the last half minute: long enough to smooth the steps in which results
# are recorded, short enough to follow the fleet's idle capacity as it comes and goes.
RATE_WINDOW_S = 30.0


class TokenRate:
    """Tokens per second from the deltas of `batch.usage.total_tokens` over a sliding window."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, at: float, total_tokens: int) -> None:
        self.samples.append((at, total_tokens))
        while len(self.samples) > 2 and at - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    @property
    def per_second(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class CostReader:
    """The batch's cost so far (`batch.cost`, as the server publishes it), or None once the server
    has said it has no such route (a 404 outside backfill's own envelope codes, or a 405)."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.supported = True

    def read(self, batch_id: str) -> dict[str, Any] | None:
        import openai

        if not self.supported:
            return None
        try:
            body = self.client.get(f"/batches/{batch_id}/cost", cast_to=object)
        except openai.APIStatusError as exc:
            error = exc.body if isinstance(exc.body, dict) else {}
            if exc.status_code == 405 or (exc.status_code == 404 and error.get("code") is None):
                self.supported = False
                return None
            raise
        return body if isinstance(body, dict) else None


def cost_text(cost: dict[str, Any] | None) -> str:
    return f"{cost['amount']} {cost['currency']}" if cost is not None else "-"


def total_tokens(batch: Batch) -> int:
    return batch.usage.total_tokens if batch.usage is not None else 0


def progress_text(batch: Batch) -> str:
    """`done/total`, with the failed part named: "18/20 (2 failed)"; "-" before validation ends."""
    counts = batch.request_counts
    if counts is None or not counts.total:
        return "-"
    text = f"{counts.completed + counts.failed}/{counts.total}"
    return f"{text} ({counts.failed} failed)" if counts.failed else text


def when(unix_s: int | None) -> str:
    return datetime.fromtimestamp(unix_s).astimezone().strftime("%Y-%m-%d %H:%M:%S") if unix_s else "-"


def wait_for_end(
    client: openai.OpenAI, batch_id: str, *, console: Console | None, poll_s: float = POLL_S
) -> tuple[Batch, dict[str, Any] | None]:
    """Poll until the batch reaches a terminal status; with a console, draw the progress bar on
    it (with the cost so far, read again whenever the batch's tokens move). Returns the final
    batch and its final cost (None where the server publishes no cost)."""
    costs = CostReader(client)
    batch = client.batches.retrieve(batch_id)
    if console is None:
        while batch.status not in TERMINAL_STATUSES:
            time.sleep(poll_s)
            batch = client.batches.retrieve(batch_id)
        return batch, costs.read(batch_id)
    rate = TokenRate()
    columns = (
        TextColumn("[bold]{task.fields[status]:<11}"),
        BarColumn(),
        TextColumn("{task.fields[counts]}"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("{task.fields[cost]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    cost: dict[str, Any] | None = None
    priced_at_tokens = -1
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(batch_id, total=None, status="", counts="", rate="", cost="")
        while True:
            tokens = total_tokens(batch)
            rate.add(time.monotonic(), tokens)
            if tokens != priced_at_tokens or batch.status in TERMINAL_STATUSES:
                cost, priced_at_tokens = costs.read(batch_id), tokens
            counts = batch.request_counts
            bar.update(
                task,
                total=counts.total if counts is not None and counts.total else None,
                completed=counts.completed + counts.failed if counts is not None else 0,
                status=batch.status,
                counts=progress_text(batch),
                rate=f"{rate.per_second:,.0f} tok/s",
                cost=cost_text(cost) if cost is not None else "",
            )
            if batch.status in TERMINAL_STATUSES:
                return batch, cost
            time.sleep(poll_s)
            batch = client.batches.retrieve(batch_id)


def _ended_at(batch: Batch) -> int | None:
    return batch.completed_at or batch.failed_at or batch.expired_at or batch.cancelled_at


def _error_lines(batch: Batch) -> list[str]:
    if batch.errors is None or not batch.errors.data:
        return []
    return [
        f"  line {e.line if e.line is not None else '-'}: {e.code}: {e.message}"
        + (f" (param {e.param})" if e.param else "")
        for e in batch.errors.data
    ]


def summary_lines(batch: Batch, cost: dict[str, Any] | None = None) -> list[str]:
    """What a finished `--wait` prints: outcome, counts, tokens, throughput, cost, files, errors."""
    counts = batch.request_counts
    lines = [f"{batch.id} {batch.status}"]
    ended = _ended_at(batch)
    elapsed = ended - batch.created_at if ended else None
    if elapsed is not None:
        lines[0] += f" in {elapsed}s"
    if counts is not None:
        lines.append(f"  requests : {counts.total} total, {counts.completed} completed, {counts.failed} failed")
    if batch.usage is not None and batch.usage.total_tokens:
        throughput = f" ({batch.usage.total_tokens / elapsed:,.0f} tok/s)" if elapsed else ""
        lines.append(f"  tokens   : {batch.usage.input_tokens} in, {batch.usage.output_tokens} out{throughput}")
    if cost is not None:
        lines.append(f"  cost     : {cost_text(cost)}")
    lines.append(f"  output   : {batch.output_file_id or '-'}")
    lines.append(f"  errors   : {batch.error_file_id or '-'}")
    if batch.output_file_id or batch.error_file_id:
        lines.append(f"  download : backfill batch results {batch.id} -o DIR")
    return lines + _error_lines(batch)


def detail_lines(batch: Batch, cost: dict[str, Any] | None = None) -> list[str]:
    """Everything the server says about a batch (its cost so far too, where the server publishes
    it), timestamps in local time, errors with their lines."""
    usage = batch.usage
    rows: list[tuple[str, object]] = [
        ("id", batch.id),
        ("status", batch.status),
        ("endpoint", batch.endpoint),
        ("model", batch.model or "-"),
        ("window", batch.completion_window),
        ("input file", batch.input_file_id),
        ("output file", batch.output_file_id or "-"),
        ("error file", batch.error_file_id or "-"),
        ("progress", progress_text(batch)),
    ]
    if batch.request_counts is not None:
        c = batch.request_counts
        rows.append(("requests", f"{c.total} total, {c.completed} completed, {c.failed} failed"))
    if usage is not None:
        rows.append(
            (
                "usage",
                f"{usage.input_tokens} in ({usage.input_tokens_details.cached_tokens} cached), "
                f"{usage.output_tokens} out ({usage.output_tokens_details.reasoning_tokens} reasoning), "
                f"{usage.total_tokens} total",
            )
        )
    if cost is not None:
        rows.append(("cost", f"{cost_text(cost)} so far ({cost['requests']} billed requests)"))
    if batch.metadata:
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in sorted(batch.metadata.items()))))
    for label in (
        "created_at",
        "in_progress_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expires_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    ):
        value = getattr(batch, label)
        if value:
            rows.append((label.removesuffix("_at").replace("_", " "), when(value)))
    lines = [f"{label:<12} {value}" for label, value in rows]
    errors = _error_lines(batch)
    return [*lines, f"errors ({len(errors)}):", *errors] if errors else lines
