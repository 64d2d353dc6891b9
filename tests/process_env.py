"""The one way a test points this process at other services: set the environment, drop the
process's cached adapters (`storage.process_state.reset`), and put both back afterwards."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from backfill.devfleet.services import PG_ADMIN_URL, create_database, drop_database
from backfill.storage.process_state import reset as reset_process_state


@contextmanager
def process_env(env: Mapping[str, str | None]) -> Iterator[None]:
    """Run the block with `env` applied (None unsets a variable) and fresh adapters."""
    saved = {k: os.environ.get(k) for k in env}
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    reset_process_state()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reset_process_state()


@contextmanager
def scratch_database(prefix: str, home: Path, **env: str | None) -> Iterator[str]:
    """A migrated Postgres database of its own, used in-process through the usual settings
    (the code under test opens its own units of work), with state under `home`; dropped after."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    url = create_database(PG_ADMIN_URL, name)
    try:
        with process_env({"BACKFILL_DATABASE_URL": url, "BACKFILL_HOME": str(home), **env}):
            yield url
    finally:
        drop_database(PG_ADMIN_URL, name)
