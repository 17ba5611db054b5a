"""HTTP and CLI: the only layer that the console script and ``python -m sparkd`` import."""
