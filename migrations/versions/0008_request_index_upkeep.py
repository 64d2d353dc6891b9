"""request index upkeep: the cheapest table a million-line validation can write

A batch's request lines are written once, by validation, in one COPY, in the transaction that
holds its batch row; each secondary index and trigger on `batch_requests` is paid per line.
- The foreign key to `batches` goes: its check is a trigger per row (about a third of the COPY),
  the rows are only ever written by validation under the batch's row lock, and batches are never
  deleted (they end in a terminal status), so there is nothing for it to catch.
- The unique (batch_id, custom_id) goes: validation rejects duplicate custom_ids line by line
  before any row is written, and nothing looks a line up by its custom_id.
- The running-lines index holds only running lines (partial), and the prefix index only lines
  that ran (whether a prefix was served a while ago): a pending line costs neither anything.
  Pending lines by prefix are found through the tree-order index, within a claim's scan.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 04:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

RUNNING = sa.text("state = 'running'")
SERVED = sa.text("state IN ('running', 'succeeded', 'failed')")
# SQLite's constraints carry no names: batch mode needs them named to drop one.
SQLITE_NAMES = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s", "uq": "uq_%(table_name)s_%(column_0_name)s"}


def upgrade() -> None:
    op.drop_index('ix_batch_requests_state', table_name='batch_requests')
    op.create_index(
        'ix_batch_requests_running', 'batch_requests', ['claim_token'], postgresql_where=RUNNING, sqlite_where=RUNNING
    )
    op.drop_index('ix_batch_requests_pick', table_name='batch_requests')
    op.create_index(
        'ix_batch_requests_served',
        'batch_requests',
        ['batch_id', 'prefix_hash'],
        postgresql_where=SERVED,
        sqlite_where=SERVED,
    )
    if op.get_bind().dialect.name == 'postgresql':
        op.drop_constraint('batch_requests_batch_id_fkey', 'batch_requests', type_='foreignkey')
        op.drop_constraint('uq_batch_requests_custom_id', 'batch_requests', type_='unique')
        return
    # An earlier batch-mode revision may have named the key already; unnamed, the convention does.
    keys = [fk['name'] or 'fk_batch_requests_batch_id_batches' for fk in sa.inspect(op.get_bind()).get_foreign_keys('batch_requests')]
    with op.batch_alter_table('batch_requests', naming_convention=SQLITE_NAMES) as batch_op:
        for name in keys:
            batch_op.drop_constraint(name, type_='foreignkey')
        batch_op.drop_constraint('uq_batch_requests_custom_id', type_='unique')


def downgrade() -> None:
    with op.batch_alter_table('batch_requests', naming_convention=SQLITE_NAMES) as batch_op:
        batch_op.create_unique_constraint('uq_batch_requests_custom_id', ['batch_id', 'custom_id'])
        batch_op.create_foreign_key(
            'batch_requests_batch_id_fkey', 'batches', ['batch_id'], ['id'], ondelete='CASCADE'
        )
    op.drop_index('ix_batch_requests_served', table_name='batch_requests')
    op.create_index('ix_batch_requests_pick', 'batch_requests', ['batch_id', 'state', 'prefix_hash', 'line'])
    op.drop_index('ix_batch_requests_running', table_name='batch_requests')
    op.create_index('ix_batch_requests_state', 'batch_requests', ['state', 'claim_token'])
