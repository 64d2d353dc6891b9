"""usage by API key: the key that created a batch, and on each ledger entry

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No foreign keys: usage by key outlives a deleted key, as the ledger outlives its batches.
    # Rows from before stay NULL (no key was recorded then); OpenAI's API shows those as null.
    with op.batch_alter_table('batches') as batch_op:
        batch_op.add_column(sa.Column('api_key_id', sa.String(length=32), nullable=True))
    with op.batch_alter_table('usage_ledger') as batch_op:
        batch_op.add_column(sa.Column('api_key_id', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage_ledger') as batch_op:
        batch_op.drop_column('api_key_id')
    with op.batch_alter_table('batches') as batch_op:
        batch_op.drop_column('api_key_id')
