"""gpu_samples: NVML readings (utilization, temperature, power; memory when the driver reports it)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gpu_samples",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("ts", sa.Float, nullable=False, index=True),
        sa.Column("gpu_index", sa.Integer, nullable=True),
        sa.Column("name", sa.String(128), nullable=True),
        sa.Column("utilization_pct", sa.Float, nullable=True),
        sa.Column("temperature_c", sa.Float, nullable=True),
        sa.Column("power_w", sa.Float, nullable=True),
        sa.Column("memory_total_bytes", sa.BigInteger, nullable=True),
        sa.Column("memory_used_bytes", sa.BigInteger, nullable=True),
        sa.Column("memory_supported", sa.Boolean, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("gpu_samples")
