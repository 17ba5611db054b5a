"""``python -m sparkd.store.migrate PATH``: open the database at PATH and migrate it to the head.

The daemon runs this in a child process (``Store.upgrade_in_child``) so that Alembic stays out of
its memory. Exit status 0 when the database is at the head; 1 with one line on stderr
(``sparkd: <why>``) when it cannot be opened or migrated; 2 on bad arguments.
"""

from __future__ import annotations

import sys

from sparkd.errors import StoreError
from sparkd.store.store import Store


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m sparkd.store.migrate PATH", file=sys.stderr)
        return 2
    try:
        Store.open(argv[0], migrate=True).close()
    except StoreError as e:  # its first line: SQLAlchemy appends a "Background on this error" line
        print(f"sparkd: {(e.message.splitlines() or ['?'])[0]}", file=sys.stderr)
        return 1
    except Exception as e:
        text = str(getattr(e, "orig", None) or e).splitlines() or [type(e).__name__]
        print(f"sparkd: cannot migrate database {argv[0]}: {text[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
