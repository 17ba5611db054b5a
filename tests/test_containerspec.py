"""``act.containerspec`` figures that need no engine: the swap a ``--memory`` / ``--memory-swap`` pair allows."""

from __future__ import annotations

import pytest

from sparkd.act.containerspec import swap_allowance_bytes
from sparkd.units import GiB, MiB


@pytest.mark.parametrize(
    ("memory", "memory_swap", "swap"),
    [
        (100 * GiB, 100 * GiB, 0),  # as sparkd launches (CONTEXT.md: --memory-swap same as --memory)
        (90 * GiB, 100 * GiB, 10 * GiB),  # `docker update --memory 90g` of that run: Docker keeps --memory-swap
        (100 * GiB, -1, -1),  # --memory-swap -1: unlimited
        (200 * MiB, 0, 200 * MiB),  # unset: as much swap as --memory (Docker's run reference)
        (0, 100 * GiB, 0),  # no --memory: nothing to say about swap
        (100 * GiB, None, 0),  # not read
        (None, 100 * GiB, 0),
        (100 * GiB, 50 * GiB, 0),  # never negative (Docker refuses it; a bad read is not a figure)
    ],
)
def test_the_swap_beyond_memory_follows_dockers_rules(memory: int | None, memory_swap: int | None, swap: int) -> None:
    assert swap_allowance_bytes(memory, memory_swap) == swap
