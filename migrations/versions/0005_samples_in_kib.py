"""samples in integer KiB and PSI hundredths: the same columns, fewer bytes per row

Sizes were stored as bytes: a figure above 2 GiB takes 6 bytes in SQLite's record format,
one above 8 MiB at least 4. Every /proc/meminfo figure is a whole number of kB, so integer
KiB loses nothing and a 128 GiB figure fits in 4 bytes. PSI averages (two decimals in
/proc/pressure) were REAL (8 bytes when not zero); integer hundredths take 1-2. The models
(``sparkd.store.schema.KiB``, ``Hundredths``) convert, so readers still see bytes and floats.
Rows are rewritten in ts order (issue 18: history per day).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# as of this revision (not imported from the package: a migration must not change with it)
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
NOT_BYTES = {"psi_some_total_us", "psi_full_total_us", "shm_entries", "nvrm_recent"}
SAMPLE_FLOAT = ["psi_some_avg10", "psi_some_avg60", "psi_full_avg10", "psi_full_avg60"]
COLUMNS = ", ".join(["ts", *SAMPLE_INT, *SAMPLE_FLOAT])


def _create(name: str, *, compact: bool) -> None:
    ints = ", ".join(f"{c} BIGINT" for c in SAMPLE_INT)
    floats = ", ".join(f"{c} {'INTEGER' if compact else 'FLOAT'}" for c in SAMPLE_FLOAT)
    op.execute(f"CREATE TABLE {name} (ts FLOAT NOT NULL PRIMARY KEY, {ints}, {floats}) WITHOUT ROWID")


def _copy(into: str, ints: list[str], floats: list[str]) -> None:
    op.execute(f"INSERT INTO {into} ({COLUMNS}) SELECT ts, {', '.join(ints + floats)} FROM samples ORDER BY ts")
    op.drop_table("samples")
    op.rename_table(into, "samples")


def upgrade() -> None:
    _create("samples_new", compact=True)
    # (x + 512) / 1024: to the nearest KiB, as sparkd.store.schema.bytes_to_kib (exact for meminfo)
    ints = [c if c in NOT_BYTES else f"CAST(({c} + 512) / 1024 AS INTEGER)" for c in SAMPLE_INT]
    floats = [f"CAST(round({c} * 100) AS INTEGER)" for c in SAMPLE_FLOAT]
    _copy("samples_new", ints, floats)


def downgrade() -> None:
    _create("samples_old", compact=False)
    ints = [c if c in NOT_BYTES else f"{c} * 1024" for c in SAMPLE_INT]
    floats = [f"{c} / 100.0" for c in SAMPLE_FLOAT]
    _copy("samples_old", ints, floats)
    _ = sa  # the module's imports, as in the other revisions
