"""``python -m sparkd``: the same entry point as the ``sparkd`` console script."""

from sparkd.face.cli import main

if __name__ == "__main__":
    main()
