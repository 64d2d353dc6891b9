"""a partial index of the batches retention has yet to retire; the multiplier of batches that
were running when 0012 came in

Retention looks for terminal batches whose ledger is not rolled up or whose line rows are not
deleted yet (`jobs.retention.batches_to_retire`); without an index each pass read every batch
ever made. Retired batches leave this partial index, so a pass reads only what is left to do.

Migration 0012 stored the window's price multiplier on each new batch and left older ones NULL,
billed at 1. A batch still running then had been quoted its window's multiplier (the code before
0012 read it from the settings at each result), so its remaining lines dropped to 1x. Such
batches get the multiplier of their window from the settings in force now, as the code before
0012 would have used.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

UNRETIRED = "ledger_rolled_up_at IS NULL OR bodies_purged_at IS NULL"
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")


def upgrade() -> None:
    op.create_index(
        "ix_batches_unretired",
        "batches",
        ["status"],
        postgresql_where=sa.text(UNRETIRED),
        sqlite_where=sa.text(UNRETIRED),
    )
    from backfill.storage.settings import get_settings

    batches = sa.table(
        "batches",
        sa.column("status", sa.String),
        sa.column("completion_window", sa.String),
        sa.column("price_multiplier", sa.Text),
    )
    for window, multiplier in get_settings().window_price_multipliers.items():
        op.execute(
            batches.update()
            .where(
                batches.c.price_multiplier.is_(None),
                batches.c.completion_window == window,
                batches.c.status.in_(RUNNING),
            )
            .values(price_multiplier=str(multiplier))
        )


def downgrade() -> None:
    # (The multipliers set stay: they are what those batches were quoted.)
    op.drop_index("ix_batches_unretired", table_name="batches")
