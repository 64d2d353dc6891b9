"""configured keys: marked by a column, not by their name; why a key was revoked

`api_keys.configured` marks the keys installed from BACKFILL_BOOTSTRAP_API_KEY and
BACKFILL_ADMIN_API_KEY. Until now they were found by name ("configured", "configured bootstrap",
"configured admin"), free text an admin can give any key, so rotating the configured key revoked
other teams' keys. The backfill marks the rows the old code wrote: those names, in the team it
wrote them to ("default" for the bootstrap key, "admin" for the admin key).

`api_keys.revoked_reason`: "rotated" when configuring another key revoked it (configuring it
again restores it), "revoked" when an admin did (never undone). Keys revoked before this
revision have none: why is unknown, so a configuration naming one is refused, the safe side.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch_op:
        batch_op.add_column(sa.Column("configured", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column("revoked_reason", sa.String(16), nullable=True))
    op.execute(
        sa.text(
            "UPDATE api_keys SET configured = :yes"
            " WHERE name IN ('configured', 'configured bootstrap', 'configured admin')"
            " AND team_id IN (SELECT id FROM teams WHERE"
            " (teams.name = 'default' AND api_keys.is_admin = :no) OR (teams.name = 'admin' AND api_keys.is_admin = :yes))"
        ).bindparams(yes=True, no=False)
    )


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch_op:
        batch_op.drop_column("revoked_reason")
        batch_op.drop_column("configured")
