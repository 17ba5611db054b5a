"""``sparkd replay``: the click command (registered by ``face.cli``; runnable on its own)."""

from __future__ import annotations

import json
import math
import time
import tomllib
from pathlib import Path
from typing import Any

import click

from sparkd.config import DEFAULT_RULES, SEED_RULES, RuleConfig, Settings, load_settings
from sparkd.core.engine import EngineChange, engine_changes
from sparkd.errors import ConfigError, SparkdError
from sparkd.ops.replay.columns import TraceError, parse_column_options
from sparkd.ops.replay.interpolate import interpolate
from sparkd.ops.replay.report import compare_text, render
from sparkd.ops.replay.run import ReplayResult, replay, rule_configs
from sparkd.ops.replay.traces import Trace, _parse_time, load_csv, load_db
from sparkd.units import GiB, parse_duration_s

# --------------------------------------------------------------------------- CLI


def load_rule_set(spec: str, settings: Settings) -> tuple[str, list[RuleConfig]]:
    """``seed`` | ``default`` | ``config`` | a TOML file with ``[[rules]]`` tables.

    Raises:
        ConfigError: the file is missing, not TOML, has no rules, or a rule is invalid.
    """
    if spec == "seed":
        return "seed", rule_configs(SEED_RULES)
    if spec == "default":
        return "default", rule_configs(DEFAULT_RULES)
    if spec == "config":
        return "configured", list(settings.rules)
    p = Path(spec)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"rules file {p} does not exist (use seed, default or a TOML file)") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"rules file {p} cannot be read as TOML: {e}") from None
    rules = data.get("rules")
    if not isinstance(rules, list) or not rules:
        raise ConfigError(f"rules file {p} has no [[rules]] tables")
    try:
        return p.name, rule_configs(rules)
    except ValueError as e:
        raise ConfigError(f"rules file {p}: {e}") from None


def _db_trace(
    settings: Settings, db_file: str | None, since: str | None, until: str | None
) -> tuple[Trace, list[EngineChange]]:
    """The stored samples in ``--since``/``--until`` and what the daemon told its engine meanwhile.

    Raises:
        click.UsageError: no ``--since``.
        TraceError: no such database, no samples in the range, or too many.
    """
    if since is None:
        raise click.UsageError("--db needs --since (e.g. --since 2h)")
    from sparkd.store.store import Store

    now = time.time()
    path = Path(db_file) if db_file else settings.db_file
    if not path.exists():
        raise TraceError(f"database {path} does not exist")
    store = Store.open(path, migrate=False)
    try:
        trace = load_db(
            store, since=_when(since, "--since", now), until=None if until is None else _when(until, "--until", now)
        )
        return trace, db_engine_changes(store, trace)
    finally:
        store.close()


def db_engine_changes(store: Any, trace: Trace) -> list[EngineChange]:
    """What the daemon told its engine during the runs this trace covers (measured stops,
    demotions, restarts), from the stored events and runs; empty for an empty trace."""
    if not trace.samples:
        return []
    first = trace.samples[0].ts
    starts = sorted(float(r["started_at"]) for r in store.runs(limit=10_000))
    since = max((t for t in starts if t <= first), default=first)
    events = store.events(since=since, kinds=["stopped", "killed", "watermark", "relief"], limit=100_000)
    return engine_changes(events, [t for t in starts if t >= since])


def _when(text: str, option: str, now: float) -> float:
    """``2h`` (ago), an epoch number, or an ISO-8601 time (UTC when naive)."""
    try:
        return now - parse_duration_s(text)
    except ValueError:
        pass
    try:
        return _parse_time(text, "time", 0)
    except TraceError:
        raise click.BadParameter(
            f"{text!r} is neither a duration ago (30s, 10m, 2h) nor a time (epoch or ISO-8601)", param_hint=option
        ) from None


@click.command("replay")
@click.argument("trace_path", metavar="TRACE.csv", required=False, type=click.Path(dir_okay=False))
@click.option("--db", "use_db", is_flag=True, help="Replay sparkd's own samples from its database.")
@click.option("--db-file", type=click.Path(dir_okay=False), default=None, help="Database file (default: settings).")
@click.option("--since", default=None, help="With --db: start, as a duration ago (2h) or a time.")
@click.option("--until", default=None, help="With --db: end, as a duration ago or a time (default now).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="sparkd TOML settings.")
@click.option("--rules", "rules_spec", default=None, help="seed | default | FILE.toml; default: configured.")
@click.option("--compare", "compare_spec", default=None, help="Also replay this rule set and compare first stops.")
@click.option("--interval", type=float, default=None, help="Interpolation interval (s), or row spacing for phases.")
@click.option("--interpolate", is_flag=True, help="Interpolate linearly to --interval (synthetic points, labelled).")
@click.option("--mem-total-gib", type=float, default=None, help="MemTotal for % thresholds when the trace lacks it.")
@click.option("--cooldown", "cooldown_s", type=float, default=None, help="Rule cooldown in s (default: settings).")
@click.option("--all", "show_all", is_flag=True, help="Show every sample, not only active ones in long traces.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--column",
    "columns",
    multiple=True,
    metavar="NAME=FIELD",
    help="Map a CSV column to a field (e.g. avail_g=mem_available_gib, when=epoch); repeatable.",
)
@click.pass_context
def replay_command(ctx: click.Context, **params: Any) -> None:
    """Replay stop rules over a recorded trace: what would have fired, when, and why.

    TRACE.csv is 'sparkd samples --csv' output or a CSV with a time column (t_s, ts, time,
    t, or phase) and MemAvailable/MemFree columns in GiB (mem_available_gib) or bytes.
    """
    params["interpolate_"] = params.pop("interpolate")  # the function of that name is used inside
    try:
        _replay_cli(ctx, **params)
    except SparkdError as e:
        click.echo(f"sparkd replay: {e.message}", err=True)
        ctx.exit(2)


def _replay_cli(
    ctx: click.Context,
    *,
    trace_path: str | None,
    use_db: bool,
    db_file: str | None,
    since: str | None,
    until: str | None,
    config_path: str | None,
    rules_spec: str | None,
    compare_spec: str | None,
    interval: float | None,
    interpolate_: bool,
    mem_total_gib: float | None,
    cooldown_s: float | None,
    show_all: bool,
    as_json: bool,
    columns: tuple[str, ...] = (),
) -> None:
    if (trace_path is None) == (not use_db):
        raise click.UsageError("give either TRACE.csv or --db (with --since)")
    for opt, v in (("--interval", interval), ("--mem-total-gib", mem_total_gib)):
        if v is not None and (not math.isfinite(v) or v <= 0):
            raise click.BadParameter(f"must be a finite number > 0, got {v:g}", param_hint=opt)
    if cooldown_s is not None and (not math.isfinite(cooldown_s) or cooldown_s < 0):
        raise click.BadParameter(f"must be a finite number >= 0, got {cooldown_s:g}", param_hint="--cooldown")
    parent = ctx.find_root().obj if ctx.find_root().obj is not None else {}
    cfg = config_path or (parent.get("config") if isinstance(parent, dict) else None)
    settings = load_settings(cfg)
    changes: list[EngineChange] = []
    if use_db:
        trace, changes = _db_trace(settings, db_file, since, until)
    else:
        if since is not None or until is not None:
            raise click.UsageError("--since/--until apply to --db only")
        assert trace_path is not None
        trace = load_csv(
            trace_path, row_interval_s=interval or settings.interval_s, columns_map=parse_column_options(columns)
        )
    if interpolate_:
        trace = interpolate(trace, interval or settings.fast_interval_s)
    elif interval is not None and not any(trace.labels):
        raise click.UsageError(
            f"--interval {interval:g} resamples a timed trace; add --interpolate to accept synthetic points"
        )
    mem_total = round(mem_total_gib * GiB) if mem_total_gib is not None else None
    cd = settings.cooldown_s if cooldown_s is None else cooldown_s
    name, rules = load_rule_set(rules_spec or "config", settings)
    runs: list[tuple[str, ReplayResult]] = []
    for nm, rs in [(name, rules), *([load_rule_set(compare_spec, settings)] if compare_spec else [])]:
        try:
            res = replay(
                trace,
                rs,
                mem_total_bytes=mem_total,
                fast_interval_s=settings.fast_interval_s,
                cooldown_s=cd,
                horizon_s=settings.container.stop_timeout_s,
                changes=changes if rs is rules else [],  # the daemon's changes belong to its own rules
            )
        except ValueError as e:
            raise ConfigError(
                f"rule set {nm} cannot be compiled against this trace: {e}; give MemTotal with --mem-total-gib"
            ) from None
        runs.append((nm, res))
    if as_json:
        out: dict[str, Any] = {
            "trace": {
                "source": trace.source,
                "samples": len(trace.samples),
                "duration_s": trace.duration_s,
                "interval_s": trace.interval_s,
                "synthetic": sum(trace.synthetic),
                "notes": trace.notes,
            },
            "runs": {nm: res.to_json() for nm, res in runs},
        }
        if len(runs) == 2:
            out["compare"] = compare_text(runs[0][1], runs[0][0], runs[1][1], runs[1][0])
        click.echo(json.dumps(out, indent=2))
        return
    iv = trace.interval_s
    click.echo(
        f"trace: {trace.source} — {len(trace.samples)} samples over {trace.duration_s:.2f} s"
        + (f" (every {iv:g} s)" if iv is not None else "")
    )
    for note in trace.notes:
        click.echo(f"note: {note}")
    click.echo(
        f"cooldown {cd:g} s; predictive horizon {settings.container.stop_timeout_s:g} s (container.stop_timeout_s)"
    )
    for nm, res in runs:
        click.echo("")
        click.echo(render(res, trace, title=nm, show_all=show_all))
    if len(runs) == 2:
        click.echo("")
        click.echo(compare_text(runs[0][1], runs[0][0], runs[1][1], runs[1][0]))
