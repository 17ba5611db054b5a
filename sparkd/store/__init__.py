"""SQLite through SQLAlchemy and Alembic; the only layer that imports them."""
