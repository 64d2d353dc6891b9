"""billing: versioned prices, the usage ledger, per-team quotas

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 10:37:46.008331
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import backfill.jobs.models


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('prices',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=True),
    sa.Column('input_micros_per_million', sa.BigInteger(), nullable=False),
    sa.Column('cached_input_micros_per_million', sa.BigInteger(), nullable=False),
    sa.Column('output_micros_per_million', sa.BigInteger(), nullable=False),
    sa.Column('batch_discount_percent', sa.Integer(), nullable=False),
    sa.Column('effective_from', backfill.jobs.models.UtcDateTime(timezone=True), nullable=False),
    sa.Column('created_at', backfill.jobs.models.UtcDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_prices_model_effective', 'prices', ['model', 'effective_from'], unique=False)
    op.create_table('quotas',
    sa.Column('team_id', sa.String(length=32), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('max_enqueued_tokens', sa.BigInteger(), nullable=True),
    sa.Column('max_concurrent_batches', sa.Integer(), nullable=True),
    sa.Column('updated_at', backfill.jobs.models.UtcDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['team_id'], ['teams.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('team_id', 'model')
    )
    op.create_table('usage_ledger',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('batch_id', sa.String(length=32), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('team_id', sa.String(length=32), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), nullable=False),
    sa.Column('cached_tokens', sa.BigInteger(), nullable=False),
    sa.Column('completion_tokens', sa.BigInteger(), nullable=False),
    sa.Column('reasoning_tokens', sa.BigInteger(), nullable=False),
    sa.Column('price_version', sa.Integer(), nullable=True),
    sa.Column('input_cost_micros', sa.BigInteger(), nullable=False),
    sa.Column('cached_input_cost_micros', sa.BigInteger(), nullable=False),
    sa.Column('output_cost_micros', sa.BigInteger(), nullable=False),
    sa.Column('cost_micros', sa.BigInteger(), nullable=False),
    sa.Column('recorded_at', backfill.jobs.models.UtcDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], ),
    sa.ForeignKeyConstraint(['price_version'], ['prices.id'], ),
    sa.ForeignKeyConstraint(['team_id'], ['teams.id'], ),
    sa.PrimaryKeyConstraint('id'),
    # One ledger row per request: the constraint the idempotent insert relies on.
    sa.UniqueConstraint('batch_id', 'line', name='uq_usage_ledger_request')
    )
    op.create_index('ix_usage_ledger_recorded', 'usage_ledger', ['recorded_at'], unique=False)
    op.create_index('ix_usage_ledger_team_recorded', 'usage_ledger', ['team_id', 'recorded_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_usage_ledger_team_recorded', table_name='usage_ledger')
    op.drop_index('ix_usage_ledger_recorded', table_name='usage_ledger')
    op.drop_table('usage_ledger')
    op.drop_table('quotas')
    op.drop_index('ix_prices_model_effective', table_name='prices')
    op.drop_table('prices')
