"""``python -m sparkd.face.cli``: the ``sparkd`` command."""

from sparkd.face.cli import main

main()
