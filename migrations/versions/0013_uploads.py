"""uploads: files sent in parts (OpenAI's Uploads API)

`uploads` holds an upload from its creation to its completion (then it names the file it made),
cancellation or expiry; `upload_parts` its parts until then: each a run of the object store's
multipart parts, or an object of its own when smaller than a middle part may be.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-10 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from backfill.jobs.models import UtcDateTime

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("team_id", sa.String(32), sa.ForeignKey("teams.id", ondelete="CASCADE"), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("mime_type", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", UtcDateTime(), nullable=False),
        sa.Column("expires_at", UtcDateTime(), nullable=False),
        sa.Column("file_expires_after_s", sa.Integer(), nullable=True),
        sa.Column("file_id", sa.String(40), nullable=False),
        sa.Column("multipart_key", sa.String(512), nullable=False),
        sa.Column("multipart_id", sa.Text(), nullable=False),
        sa.Column("next_part_number", sa.Integer(), nullable=False),
        sa.Column("part_count", sa.Integer(), nullable=False),
        sa.Column("received_bytes", sa.BigInteger(), nullable=False),
        sa.Column("completed_at", UtcDateTime(), nullable=True),
        sa.Column("cancelled_at", UtcDateTime(), nullable=True),
        sa.Column("cleaned_at", UtcDateTime(), nullable=True),
    )
    op.create_index("ix_uploads_cleanup", "uploads", ["cleaned_at", "expires_at"])
    op.create_table(
        "upload_parts",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("upload_id", sa.String(32), sa.ForeignKey("uploads.id", ondelete="CASCADE"), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("first_number", sa.Integer(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("object_key", sa.String(512), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
    )
    op.create_index("ix_upload_parts_upload_id", "upload_parts", ["upload_id"])


def downgrade() -> None:
    op.drop_index("ix_upload_parts_upload_id", table_name="upload_parts")
    op.drop_table("upload_parts")
    op.drop_index("ix_uploads_cleanup", table_name="uploads")
    op.drop_table("uploads")
