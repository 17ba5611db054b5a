"""sample_minutes: usable memory (MemAvailable − CmaFree) per minute, for the chart's usable line

The default stop rules judge usable memory (CONTEXT.md "CMA"); the chart draws it, and beyond the
raw samples' retention (48 h) it comes from the minute aggregates. Minutes aggregated before this
revision have no usable figures (NULL: the line has a gap there, nothing is made up).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

COLUMNS = [f"mem_available_minus_cma_{agg}" for agg in ("min", "avg", "max")]


def upgrade() -> None:
    with op.batch_alter_table("sample_minutes") as b:
        for c in COLUMNS:
            b.add_column(sa.Column(c, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sample_minutes") as b:
        for c in COLUMNS:
            b.drop_column(c)
