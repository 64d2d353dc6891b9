"""index written in parts: how many of a batch's index rows are written

Validation writes a large batch's request index in parts (in release order, each part its own
transaction): the batch starts once the first part is in, and finalization waits for the last.
`unindexed` counts the rows still to be written; a batch validated before this revision has
none left.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 19:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('batches') as batch_op:
        batch_op.add_column(sa.Column('unindexed', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch_op:
        batch_op.drop_column('unindexed')
