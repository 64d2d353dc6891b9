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
from alembic import op

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
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("ledger_rolled_up_at")
    with op.batch_alter_table("usage_ledger") as batch_op:
        batch_op.drop_column("requests")
