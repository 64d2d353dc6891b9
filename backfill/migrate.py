"""Run Alembic migrations programmatically (the `backfill migrate` command and tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import backfill.migrations

SCRIPT_LOCATION = Path(backfill.migrations.__file__).parent


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    return cfg


def upgrade(revision: str = "head") -> None:
    command.upgrade(alembic_config(), revision)
