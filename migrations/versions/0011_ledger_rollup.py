"""ledger rolled up per batch: a request count per ledger row, and when a batch's rows were rolled up

Once a batch ends, its ledger rows (one per billed line) are rolled up into one row per minute,
model, key and price (`requests` says how many lines a row stands for), so the ledger grows with
batches and minutes, not with lines served. Rows written before this revision stand for one line.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 11:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

import backfill.jobs.models

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch_op:
        batch_op.add_column(sa.Column("requests", sa.BigInteger(), nullable=False, server_default="1"))
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("ledger_rolled_up_at", backfill.jobs.models.UtcDateTime(), nullable=True))


def downgrade() -> None:
    # Without `requests`, a rolled-up row (a negative line standing for many) reads as one
    # request: usage by request count would silently shrink. Refuse rather than lose that.
    if context.is_offline_mode():
        raise RuntimeError(
            "downgrading below 0011 needs a database connection: rolled-up usage_ledger rows must be checked"
        )
    rolled_up = op.get_bind().execute(sa.text("SELECT count(*) FROM usage_ledger WHERE line < 0")).scalar_one()
    if rolled_up:
        raise RuntimeError(
            f"cannot downgrade below 0011: {rolled_up} usage_ledger rows are rolled up (line < 0, each "
            "standing for `requests` lines), and the schema before 0011 counts every row as one request. "
            "Keep this revision, or export the ledger and remove those rows first."
        )
    # recreate="never": SQLite (3.35+) drops the columns in place; recreating `batches` would drop
    # a table that other rows reference, which SQLite refuses with foreign keys on.
    with op.batch_alter_table("batches", recreate="never") as batch_op:
        batch_op.drop_column("ledger_rolled_up_at")
    with op.batch_alter_table("usage_ledger", recreate="never") as batch_op:
        batch_op.drop_column("requests")
