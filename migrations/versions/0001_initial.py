"""initial schema: samples, aggregates, events, runs, kernel counts, status, launches, revisions

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SAMPLE_INT = [
    "mem_total",
    "mem_free",
    "mem_available",
    "buffers",
    "cached",
    "swap_total",
    "swap_free",
    "shmem",
    "anon_pages",
    "slab",
    "sreclaimable",
    "sunreclaim",
    "page_tables",
    "kernel_stack",
    "cma_total",
    "cma_free",
    "psi_some_total_us",
    "psi_full_total_us",
    "shm_bytes",
    "shm_entries",
    "driver_bytes",
    "nvrm_recent",
    "low_watermark_bytes",
    "mem_available_minus_cma",
]
SAMPLE_FLOAT = ("psi_some_avg10", "psi_some_avg60", "psi_full_avg10", "psi_full_avg60")
AGG = ("mem_available", "mem_free", "cached", "anon_pages", "slab", "driver_bytes", "psi_some_avg10")


def upgrade() -> None:
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("ts", sa.Float, nullable=False, index=True),
        *[sa.Column(c, sa.BigInteger, nullable=True) for c in SAMPLE_INT],
        *[sa.Column(c, sa.Float, nullable=True) for c in SAMPLE_FLOAT],
    )
    op.create_table(
        "sample_minutes",
        sa.Column("minute_ts", sa.Float, primary_key=True),
        sa.Column("n", sa.Integer, nullable=False),
        *[sa.Column(f"{f}_{a}", sa.Float, nullable=True) for f in AGG for a in ("min", "avg", "max")],
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("ts", sa.Float, nullable=False, index=True),
        sa.Column("kind", sa.String(64), nullable=False, index=True),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("details", sa.JSON, nullable=True),
        sa.Column("launch_id", sa.String(64), nullable=True, index=True),
    )
    op.create_index("ix_events_kind_ts", "events", ["kind", "ts"])
    op.create_table(
        "daemon_runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("stopped_at", sa.Float, nullable=True),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("version", sa.String(32), nullable=False),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("exit_reason", sa.Text, nullable=True),
        sa.Column("samples", sa.Integer, nullable=False, server_default="0"),
        sa.Column("config", sa.JSON, nullable=True),
    )
    op.create_table(
        "kernel_counts",
        sa.Column("minute_ts", sa.Float, primary_key=True),
        sa.Column("kind", sa.String(32), primary_key=True),
        sa.Column("count", sa.Integer, nullable=False),
    )
    op.create_table(
        "nvrm_windows",
        sa.Column("window_start", sa.Float, primary_key=True),
        sa.Column("window_s", sa.Float, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
    )
    op.create_table(
        "status",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
    )
    op.create_table(
        "launches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("revision", sa.Integer, nullable=True),
        sa.Column("started_at", sa.Float, nullable=False, index=True),
        sa.Column("ready_at", sa.Float, nullable=True),
        sa.Column("stopped_at", sa.Float, nullable=True),
        sa.Column("container_id", sa.String(80), nullable=True),
        sa.Column("image", sa.String(255), nullable=True),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("plan", sa.JSON, nullable=True),
        sa.Column("actual", sa.JSON, nullable=True),
        sa.Column("trough_bytes", sa.BigInteger, nullable=True),
        sa.Column("driver_baseline_bytes", sa.BigInteger, nullable=True),
        sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_table(
        "config_revisions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("who", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sa.Column("diff", sa.JSON, nullable=True),
    )


def downgrade() -> None:
    for t in (
        "config_revisions",
        "launches",
        "status",
        "nvrm_windows",
        "kernel_counts",
        "daemon_runs",
        "events",
        "sample_minutes",
        "samples",
    ):
        op.drop_table(t)
