"""consumer_scans: who holds the memory (one row per process scan: group totals, JSON summary)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "consumer_scans",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("ts", sa.Float, nullable=False, index=True),
        sa.Column("container_bytes", sa.BigInteger, nullable=False),
        sa.Column("host_bytes", sa.BigInteger, nullable=False),
        sa.Column("system_bytes", sa.BigInteger, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("consumer_scans")
