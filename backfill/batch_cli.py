"""`backfill batch ...`: a user's batches, over HTTP, on any backfill (or OpenAI-compatible) server.

Everything goes through the official `openai` SDK, the client users' own code talks to. What
backfill adds (a batch's cost so far; the cost and completion forecast of `estimate`, which
validates locally by the server's rules) comes from its extension routes and is left out where
a server has none. Every command takes `--json`. A server error ends in one line and exit
status 2; a batch that `--wait` sees end failed, expired or cancelled exits 1.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar, cast

import typer

from backfill.batch_follow import (
    TERMINAL_STATUSES,
    CostReader,
    detail_lines,
    progress_text,
    summary_lines,
    wait_for_end,
    when,
)

if TYPE_CHECKING:
    import openai
    from openai.types import Batch

P = ParamSpec("P")
R = TypeVar("R")

batch_app = typer.Typer(
    help="Submit and follow batches on a backfill (or any OpenAI-compatible) server.", no_args_is_help=True
)

BaseUrlOption = Annotated[
    str | None,
    typer.Option("--base-url", envvar="OPENAI_BASE_URL", help="The server's API root, e.g. http://127.0.0.1:8080/v1."),
]
ApiKeyOption = Annotated[str | None, typer.Option("--api-key", envvar="OPENAI_API_KEY", help="The API key to use.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
EndpointOption = Annotated[str, typer.Option(help="The endpoint every line calls.")]
WindowOption = Annotated[str, typer.Option(help="Completion window (24h, or one the server adds).")]
WaitOption = Annotated[bool, typer.Option("--wait", help="Follow the batch with a progress bar until it ends.")]
BatchArg = Annotated[str, typer.Argument(metavar="BATCH", help="The batch id (batch_...).")]
InputFileArg = Annotated[
    Path,
    typer.Argument(
        exists=True, dir_okay=False, readable=True, metavar="FILE", help="JSONL in the OpenAI Batch format."
    ),
]

CHAT_COMPLETIONS = "/v1/chat/completions"
# OpenAI's limit on metadata pairs; a retry names its source batch only if a pair is left.
MAX_METADATA_PAIRS = 16


def _fail(message: str, code: int) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def _server_errors(command: Callable[P, R]) -> Callable[P, R]:
    """The server's own message on one line and exit 2, never a traceback."""

    @wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        import openai

        try:
            return command(*args, **kwargs)
        except openai.APIStatusError as exc:
            body = exc.body
            message = body.get("message") if isinstance(body, dict) else None
            param = body.get("param") if isinstance(body, dict) else None
            text = " ".join(str(message or exc.message).split())
            if exc.status_code == 400 and isinstance(param, str) and param and param not in text:
                text += f" ({param})"  # which field was invalid, when the message does not say
            raise _fail(f"{exc.status_code} {text}", 2) from None
        except openai.APIConnectionError as exc:
            raise _fail(f"cannot reach {exc.request.url}: {exc}", 2) from None
        except openai.OpenAIError as exc:  # no key or no base URL configured
            raise _fail(" ".join(str(exc).split()), 2) from None

    return run


def _client(base_url: str | None, api_key: str | None) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=base_url, api_key=api_key)


def _echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2))


def _metadata(pairs: list[str]) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r} is not key=value", param_hint="--metadata")
        metadata[key] = value
    return metadata


def _create(
    client: openai.OpenAI,
    content: IO[bytes],
    *,
    name: str,
    endpoint: str,
    window: str,
    metadata: dict[str, str] | None,
) -> Batch:
    import openai

    uploaded = client.files.create(file=(name, content), purpose="batch")
    # The SDK types endpoint and window as OpenAI's literals; a backfill server accepts more windows.
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint=cast(Any, endpoint),
        completion_window=cast(Any, window),
        metadata=metadata if metadata else openai.omit,
    )


def _follow(client: openai.OpenAI, batch: Batch, *, as_json: bool) -> tuple[Batch, dict[str, Any] | None]:
    """Wait for the end (a progress bar unless --json), print the outcome; the final batch and cost."""
    from rich.console import Console

    if not as_json:
        typer.echo(batch.id)
    try:
        final, cost = wait_for_end(client, batch.id, console=None if as_json else Console(stderr=True))
    except KeyboardInterrupt:
        raise _fail(f"stopped following; the batch goes on: backfill batch status {batch.id}", 130) from None
    if not as_json:
        for line in summary_lines(final, cost):
            typer.echo(line)
    return final, cost


def _with_cost(batch: Batch, cost: dict[str, Any] | None) -> dict[str, Any]:
    """The batch object as the server sent it, plus `cost`: its cost so far (the server's
    `batch.cost` without `object` and `batch_id`), null where the server publishes none."""
    extra = {k: v for k, v in cost.items() if k not in ("object", "batch_id")} if cost is not None else None
    return {**batch.to_dict(), "cost": extra}


def _exit_for(batch: Batch) -> None:
    if batch.status != "completed":
        raise typer.Exit(1)


@batch_app.command()
@_server_errors
def submit(
    file: InputFileArg,
    endpoint: EndpointOption = CHAT_COMPLETIONS,
    window: WindowOption = "24h",
    metadata: Annotated[list[str] | None, typer.Option("--metadata", help="key=value; repeat for more.")] = None,
    wait: WaitOption = False,
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Upload FILE and create a batch from it; print the batch id."""
    pairs = _metadata(metadata or [])
    client = _client(base_url, api_key)
    with file.open("rb") as content:
        batch = _create(client, content, name=file.name, endpoint=endpoint, window=window, metadata=pairs)
    if wait:
        batch, cost = _follow(client, batch, as_json=as_json)
        if as_json:
            _echo_json(_with_cost(batch, cost))
        _exit_for(batch)
    elif as_json:
        _echo_json(batch.to_dict())
    else:
        typer.echo(batch.id)


@batch_app.command("list")
@_server_errors
def list_batches(
    limit: Annotated[int, typer.Option(min=1, max=100, help="How many, newest first.")] = 20,
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Your newest batches: id, status, progress, created."""
    batches = _client(base_url, api_key).batches.list(limit=limit).data
    if as_json:
        _echo_json([b.to_dict() for b in batches])
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Batches")
    for column in ("id", "status", "progress", "created"):
        table.add_column(column, no_wrap=True)
    for b in batches:
        table.add_row(b.id, b.status, progress_text(b), when(b.created_at))
    console = Console()
    if not console.is_terminal:
        console.width = 120  # piped or captured: whole rows rather than rich's 80-column default
    console.print(table)


@batch_app.command()
@_server_errors
def status(
    batch_id: BatchArg, base_url: BaseUrlOption = None, api_key: ApiKeyOption = None, as_json: JsonOption = False
) -> None:
    """Everything about one batch, its cost so far, validation errors with their line numbers."""
    client = _client(base_url, api_key)
    batch = client.batches.retrieve(batch_id)
    cost = CostReader(client).read(batch.id)
    if as_json:
        _echo_json(_with_cost(batch, cost))
        return
    for line in detail_lines(batch, cost):
        typer.echo(line)


@batch_app.command()
@_server_errors
def cancel(
    batch_id: BatchArg, base_url: BaseUrlOption = None, api_key: ApiKeyOption = None, as_json: JsonOption = False
) -> None:
    """Cancel a batch: lines not yet run end as batch_cancelled errors."""
    batch = _client(base_url, api_key).batches.cancel(batch_id)
    if as_json:
        _echo_json(batch.to_dict())
        return
    typer.echo(f"{batch.id}: {batch.status}")


@batch_app.command()
@_server_errors
def results(
    batch_id: BatchArg,
    out: Annotated[Path, typer.Option("-o", "--out", file_okay=False, help="Folder for output.jsonl and error.jsonl.")],
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Download a finished batch's output.jsonl and error.jsonl into a folder; print line counts."""
    from backfill.batch_files import download

    client = _client(base_url, api_key)
    batch = client.batches.retrieve(batch_id)
    if batch.status not in TERMINAL_STATUSES:
        raise _fail(f"{batch.id} is {batch.status}: its files are written when it ends", 1)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Any] | None] = {}
    for kind, file_id in (("output", batch.output_file_id), ("error", batch.error_file_id)):
        path = out / f"{kind}.jsonl"
        files[kind] = (
            {"file_id": file_id, "path": str(path), "lines": download(client, file_id, path)} if file_id else None
        )
    if as_json:
        _echo_json({"batch": batch.id, "status": batch.status, "files": files})
        return
    for kind, info in files.items():
        name = f"{kind}.jsonl"
        typer.echo(f"{name:<13}{info['lines']:>8} lines  {info['path']}" if info else f"{name:<13}    none")


@batch_app.command()
@_server_errors
def estimate(
    file: InputFileArg,
    endpoint: EndpointOption = CHAT_COMPLETIONS,
    window: Annotated[str, typer.Option(help="Completion window whose price applies.")] = "24h",
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Dry run: validate FILE by the server's rules, estimate tokens, cost at current prices and
    completion at the fleet's recent batch throughput; create nothing. Exits 1 if any line is invalid.
    """
    from backfill.batch_estimate import add_cost, add_forecast, estimate_file, report_lines
    from backfill.jobs.endpoints import BATCH_ENDPOINTS

    if endpoint not in BATCH_ENDPOINTS:
        raise typer.BadParameter(f"{endpoint!r}: backfill serves {', '.join(BATCH_ENDPOINTS)}", param_hint="--endpoint")
    client = _client(base_url, api_key)
    served = {m.id for m in client.models.list()}
    result = estimate_file(file, endpoint=endpoint, served_models=served)
    add_cost(result, client, window=window)
    add_forecast(result, client)
    if as_json:
        _echo_json(result.as_json())
    else:
        for line in report_lines(result):
            typer.echo(line)
    if result.errors:
        raise typer.Exit(1)


@batch_app.command("retry-failed")
@_server_errors
def retry_failed(
    batch_id: BatchArg,
    wait: WaitOption = False,
    base_url: BaseUrlOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """A new batch of the failed and expired lines of a finished batch (same endpoint and window)."""
    from backfill.batch_files import copy_lines, retryable_custom_ids

    client = _client(base_url, api_key)
    source = client.batches.retrieve(batch_id)
    if source.status not in TERMINAL_STATUSES:
        raise _fail(f"{source.id} is {source.status}: retry its failed lines once it ends", 1)
    wanted = retryable_custom_ids(client, source.error_file_id) if source.error_file_id else set()
    if not wanted:
        if as_json:
            _echo_json({"source_batch": source.id, "lines": 0, "batch": None})
        else:
            typer.echo(f"nothing to retry: no line of {source.id} failed or expired")
        return
    metadata = dict(source.metadata or {})
    if len(metadata) < MAX_METADATA_PAIRS:
        metadata["retry_of"] = source.id
    with tempfile.TemporaryFile() as spool:
        found = copy_lines(client, source.input_file_id, wanted, spool)
        if missing := len(wanted) - len(found):
            typer.secho(f"warning: {missing} failed lines are not in the input file", fg=typer.colors.YELLOW, err=True)
        spool.seek(0)
        batch = _create(
            client,
            spool,
            name=f"{source.id}-retry.jsonl",
            endpoint=source.endpoint,
            window=source.completion_window,
            metadata=metadata,
        )
    if not as_json:
        typer.echo(f"retrying {len(found)} lines of {source.id}")
    if wait:
        batch, cost = _follow(client, batch, as_json=as_json)
        if as_json:
            _echo_json({"source_batch": source.id, "lines": len(found), "batch": _with_cost(batch, cost)})
        _exit_for(batch)
    elif as_json:
        _echo_json({"source_batch": source.id, "lines": len(found), "batch": batch.to_dict()})
    else:
        typer.echo(batch.id)
