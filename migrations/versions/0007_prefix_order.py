"""prefix order: each request line's place in its batch's prefix tree

Revision ID: 0007
Revises: 0005
Create Date: 2026-12-01 21:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Lines validated before this revision keep rank 0 and are released by line, as before.
    with op.batch_alter_table('batch_requests') as batch_op:
        batch_op.add_column(sa.Column('prefix_rank', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('after_line', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('prefix_tokens', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('kv_tokens', sa.Integer(), nullable=False, server_default='0'))
        batch_op.create_index('ix_batch_requests_rank', ['batch_id', 'state', 'prefix_rank', 'line'])


def downgrade() -> None:
    with op.batch_alter_table('batch_requests') as batch_op:
        batch_op.drop_index('ix_batch_requests_rank')
        batch_op.drop_column('kv_tokens')
        batch_op.drop_column('prefix_tokens')
        batch_op.drop_column('after_line')
        batch_op.drop_column('prefix_rank')
