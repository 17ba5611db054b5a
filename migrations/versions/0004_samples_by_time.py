"""samples keyed by time: WITHOUT ROWID, ts the primary key; no id column, no ts index

The 0.1 table stored a rowid per sample and a separate index on ts (an index entry per
row: ts, the rowid and page overhead). Keyed by ts, the table is its own index. Rows are
copied in ts order; two rows with the same ts (a clock stepped back onto the very same
float) keep the first.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
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
SAMPLE_FLOAT = ["psi_some_avg10", "psi_some_avg60", "psi_full_avg10", "psi_full_avg60"]
COLUMNS = ", ".join(["ts", *SAMPLE_INT, *SAMPLE_FLOAT])


def _create(name: str, *, by_time: bool) -> None:
    ints = ", ".join(f"{c} BIGINT" for c in SAMPLE_INT)
    floats = ", ".join(f"{c} FLOAT" for c in SAMPLE_FLOAT)
    if by_time:
        op.execute(f"CREATE TABLE {name} (ts FLOAT NOT NULL PRIMARY KEY, {ints}, {floats}) WITHOUT ROWID")
    else:
        op.execute(f"CREATE TABLE {name} (id INTEGER NOT NULL PRIMARY KEY, ts FLOAT NOT NULL, {ints}, {floats})")


def upgrade() -> None:
    _create("samples_new", by_time=True)
    op.execute(f"INSERT OR IGNORE INTO samples_new ({COLUMNS}) SELECT {COLUMNS} FROM samples ORDER BY ts, id")
    op.drop_index("ix_samples_ts", table_name="samples")
    op.drop_table("samples")
    op.rename_table("samples_new", "samples")


def downgrade() -> None:
    _create("samples_old", by_time=False)
    op.execute(f"INSERT INTO samples_old ({COLUMNS}) SELECT {COLUMNS} FROM samples ORDER BY ts")
    op.drop_table("samples")
    op.rename_table("samples_old", "samples")
    op.create_index("ix_samples_ts", "samples", ["ts"])
    _ = sa  # the module's imports, as in the other revisions
