"""Lease pool names carry a model: a deployment serving several models has a pool per model.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # SQLite (the embedded mode) has no ALTER COLUMN: batch mode copies the table there.
    with op.batch_alter_table("leases") as batch_op:
        batch_op.alter_column("kind", type_=sa.String(320), existing_type=sa.String(16), existing_nullable=False)


def downgrade() -> None:
    op.execute("DELETE FROM leases WHERE length(kind) > 16")
    with op.batch_alter_table("leases") as batch_op:
        batch_op.alter_column("kind", type_=sa.String(16), existing_type=sa.String(320), existing_nullable=False)
