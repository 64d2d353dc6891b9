"""What the administration commands share: a session on the configured database, domain errors
as one line and exit 1, rows as a table or JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import wraps
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import typer

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def admin_session() -> Iterator[Session]:
    from backfill.storage.db import unit_of_work
    from backfill.storage.settings import get_settings

    if get_settings().embedded:
        from backfill.migrate import upgrade

        upgrade()  # the embedded database is created on first use, as `backfill up` would
    with unit_of_work() as session:
        yield session


def domain_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Expected failures (unknown team, duplicate name, bad amount) end with a message, not a trace."""

    @wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        from backfill.jobs.errors import DomainError

        try:
            return command(*args, **kwargs)
        except DomainError as exc:
            typer.secho(f"error: {exc.message}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None

    return run


def emit_rows(
    rows: list[dict[str, Any]], *, as_json: bool, title: str, columns: Sequence[str], single: bool = False
) -> None:
    if as_json:
        typer.echo(json.dumps(rows[0] if single else rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    # Piped or in a narrow terminal, rich would cut the columns to 80 characters: give it room.
    Console(width=None if sys.stdout.isatty() else 200).print(table)
