"""``sparkd`` command line (click). Each command validates settings once and passes them down.

``base`` holds the group and the shared helpers; each module adds its commands to it:
``observe`` (run, status, samples, events), ``control`` (start, stop, restart, rearm, maintenance,
resize), ``plans`` (plan, launches, vllm-log), ``admin`` (config, db, doctor, install, uninstall);
``sparkd replay`` comes from ``sparkd.ops.replay``.
"""

from __future__ import annotations

from sparkd.face.cli import admin, control, observe, plans  # noqa: F401  (their commands join the group)
from sparkd.face.cli.base import main
from sparkd.ops.replay import replay_command

main.add_command(replay_command)

__all__ = ["main"]
