"""retention: when a file's object and a batch's response bodies were purged

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 20:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import backfill.jobs.models

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('files') as batch_op:
        batch_op.add_column(sa.Column('purged_at', backfill.jobs.models.UtcDateTime(), nullable=True))
        batch_op.create_index('ix_files_object_key', ['object_key'])
    with op.batch_alter_table('batches') as batch_op:
        batch_op.add_column(sa.Column('bodies_purged_at', backfill.jobs.models.UtcDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch_op:
        batch_op.drop_column('bodies_purged_at')
    with op.batch_alter_table('files') as batch_op:
        batch_op.drop_index('ix_files_object_key')
        batch_op.drop_column('purged_at')
