"""uploads: a completion claim that can be taken over once stale

`completing_since` is when the completion in progress took the upload (NULL once it let go after
a failure): a claim older than the completion lease was left by a process that died, and a retry
takes it over. `completion_part_ids` are the parts that claim named, in order: the store may
already hold what they made, so only a completion of the same parts may take it over.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from backfill.jobs.models import UtcDateTime

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("uploads") as batch_op:
        batch_op.add_column(sa.Column("completing_since", UtcDateTime(), nullable=True))
        batch_op.add_column(sa.Column("completion_part_ids", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("uploads") as batch_op:
        batch_op.drop_column("completion_part_ids")
        batch_op.drop_column("completing_since")
