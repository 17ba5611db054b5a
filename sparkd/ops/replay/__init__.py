"""Replay stop rules over a recorded trace: what would have fired, when, and why.

Pure core, thin edges:

* loaders turn a trace into a ``Trace`` (a list of ``Sample``; ``mono`` = seconds
  from the trace start, sizes in bytes): ``load_db`` (sparkd's own samples table),
  ``load_csv`` (``sparkd samples --csv`` output, or a generic CSV with a time
  column and GiB/byte memory columns such as the shared meminfo fixtures); they refuse
  non-finite or negative values and repeated or backward times (naming the row and
  column), drop exact duplicate rows with a note, and hold at most ``MAX_TRACE_POINTS``;
* ``interpolate`` resamples linearly to a finer interval; every point that is not
  a recorded sample is flagged synthetic and the trace carries a note saying so; a grid
  over ``MAX_TRACE_POINTS`` is refused before it is built;
* ``replay`` runs the real ``rules.evaluate`` over the samples, exactly as the
  guard does (slope window fed first, same ``now``, same cooldown), and returns
  a ``ReplayResult`` with each sample's decisions and each rule's first trip;
* ``replay_command`` is the ``sparkd replay`` click command (registered by
  ``cli.main.add_command``); it is importable and runnable on its own.

What a replay does not model: the daemon's adaptive sampling (it samples every
``interval_s`` and switches to ``fast_interval_s`` near a floor) — a replay sees
exactly the samples it is given; and the re-check before a stop reads a *fresh*
sample in the daemon, here the next recorded one.
"""

from sparkd.ops.replay.cli import load_rule_set, replay_command
from sparkd.ops.replay.columns import (
    ACCEPTED_COLUMNS_TEXT,
    COLUMN_ALIASES,
    EPOCH_COLUMNS,
    TIME_COLUMNS,
    parse_column_options,
    resolve_field,
)
from sparkd.ops.replay.interpolate import interpolate
from sparkd.ops.replay.report import compare_text, render
from sparkd.ops.replay.run import (
    SLOPE_MIN_POINTS,
    ReplayDecision,
    ReplayResult,
    ReplayStep,
    replay,
    rule_configs,
)
from sparkd.ops.replay.traces import (
    MAX_TRACE_POINTS,
    Trace,
    TraceError,
    load_csv,
    load_db,
    loads_csv,
    samples_from_rows,
)

__all__ = [
    "ACCEPTED_COLUMNS_TEXT",
    "COLUMN_ALIASES",
    "EPOCH_COLUMNS",
    "MAX_TRACE_POINTS",
    "SLOPE_MIN_POINTS",
    "TIME_COLUMNS",
    "ReplayDecision",
    "ReplayResult",
    "ReplayStep",
    "Trace",
    "TraceError",
    "compare_text",
    "interpolate",
    "load_csv",
    "load_db",
    "load_rule_set",
    "loads_csv",
    "parse_column_options",
    "render",
    "replay",
    "replay_command",
    "resolve_field",
    "rule_configs",
    "samples_from_rows",
]
