"""the window price multiplier a batch was quoted at, stored on the batch

`batches.price_multiplier` is the BACKFILL_WINDOW_PRICE_MULTIPLIERS value for the batch's window
when the batch was created, applied to the general price row (no window). Until now it was read
from the settings whenever a result was recorded, so changing the setting, or a worker with other
settings, billed lines of one batch at different prices. Kept as the decimal's text, exact on every
database. NULL for batches created before this revision (billed at 1, as the general row says)
and for batches whose window has its own price row (that row's rates are bound by price_version).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("price_multiplier", sa.Text(), nullable=True))


def downgrade() -> None:
    # recreate="never": SQLite (3.35+) drops the column in place; recreating `batches` would drop
    # a table that other rows reference, which SQLite refuses with foreign keys on.
    with op.batch_alter_table("batches", recreate="never") as batch_op:
        batch_op.drop_column("price_multiplier")
