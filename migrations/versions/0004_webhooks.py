"""webhooks: endpoints per team, the event outbox, the delivery log

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import backfill.jobs.models

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('webhook_endpoints',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('team_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('url', sa.String(length=2048), nullable=False),
    sa.Column('event_types', sa.JSON(), nullable=False),
    sa.Column('secret', sa.String(length=64), nullable=False),
    sa.Column('previous_secret', sa.String(length=64), nullable=True),
    sa.Column('previous_secret_until', backfill.jobs.models.UtcDateTime(), nullable=True),
    sa.Column('created_at', backfill.jobs.models.UtcDateTime(), nullable=False),
    sa.Column('updated_at', backfill.jobs.models.UtcDateTime(), nullable=False),
    sa.ForeignKeyConstraint(['team_id'], ['teams.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_webhook_endpoints_team_created', 'webhook_endpoints', ['team_id', 'created_at', 'id'])
    op.create_table('webhook_events',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('team_id', sa.String(length=32), nullable=False),
    sa.Column('type', sa.String(length=32), nullable=False),
    sa.Column('batch_id', sa.String(length=32), nullable=False),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('created_at', backfill.jobs.models.UtcDateTime(), nullable=False),
    sa.ForeignKeyConstraint(['team_id'], ['teams.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_webhook_events_batch_id', 'webhook_events', ['batch_id'])
    op.create_table('webhook_deliveries',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('event_id', sa.String(length=32), nullable=False),
    sa.Column('endpoint_id', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', backfill.jobs.models.UtcDateTime(), nullable=True),
    sa.Column('last_attempt_at', backfill.jobs.models.UtcDateTime(), nullable=True),
    sa.Column('last_status_code', sa.Integer(), nullable=True),
    sa.Column('last_error', sa.String(length=256), nullable=True),
    sa.Column('history', sa.JSON(), nullable=False),
    sa.Column('created_at', backfill.jobs.models.UtcDateTime(), nullable=False),
    sa.Column('delivered_at', backfill.jobs.models.UtcDateTime(), nullable=True),
    sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoints.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['event_id'], ['webhook_events.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('event_id', 'endpoint_id', name='uq_webhook_deliveries_event_endpoint')
    )
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['status', 'next_attempt_at'])
    op.create_index('ix_webhook_deliveries_endpoint_created', 'webhook_deliveries', ['endpoint_id', 'created_at', 'id'])


def downgrade() -> None:
    op.drop_index('ix_webhook_deliveries_endpoint_created', table_name='webhook_deliveries')
    op.drop_index('ix_webhook_deliveries_due', table_name='webhook_deliveries')
    op.drop_table('webhook_deliveries')
    op.drop_index('ix_webhook_events_batch_id', table_name='webhook_events')
    op.drop_table('webhook_events')
    op.drop_index('ix_webhook_endpoints_team_created', table_name='webhook_endpoints')
    op.drop_table('webhook_endpoints')
