"""Reading what the daemon sees: ``run``, ``status`` (and ``--cluster``), ``samples``, ``events``."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import sys
import time
from collections.abc import Coroutine
from typing import Any

import click

from sparkd.config import Settings
from sparkd.core.supervision import of_this_run
from sparkd.errors import SparkdError
from sparkd.face.cli.base import (
    CLOCK_SLACK_S,
    STALE_S,
    _age,
    _config_path,
    _settings,
    _since,
    _snapshot,
    _span,
    _store,
    _ts,
    api_base,
    main,
    unreadable,
)
from sparkd.face.presenters import (
    HOLDS_AGAIN_TEXT,
    NO_DRIVER_TEXT,
    config_file_text,
    guard_missing_mode_text,
    idle_trips_text,
    mode_text,
    no_nvidia_driver,
    nothing_guarded,
    rule_cond,
    stop_not_kept,
    unarmed,
)
from sparkd.loop.status import Status
from sparkd.store.store import READ_OR_OPEN_ERRORS
from sparkd.units import fmt_gib


@main.command()
@click.option("--dry-run", is_flag=True, help="Record what would happen; never stop anything.")
@click.option("--no-api", is_flag=True, help="Do not serve the REST API / dashboard.")
@click.pass_context
def run(ctx: click.Context, dry_run: bool, no_api: bool) -> None:
    """Run the daemon in the foreground (systemd: Type=notify)."""
    if dry_run:
        ctx.obj["overrides"] = {**ctx.obj.get("overrides", {}), "dry_run": True}
    settings = _settings(ctx, starting=True)
    from sparkd.face.app import create_app
    from sparkd.logsetup import setup_logging
    from sparkd.loop.daemon import Daemon, make_actions

    os.umask(0o077)  # state dir 0700, database, logs, archives and token 0600 whatever the caller's umask
    setup_logging(settings.logs_path, background=True)  # never a write from the event loop (logsetup)

    daemon = Daemon(
        settings, actions=make_actions(settings), serve_api=False if no_api else None, app_factory=create_app
    )
    daemon.config_path = _config_path(ctx)  # an edit that breaks it is said at once
    daemon.config_baseline = _file_settings(daemon.config_path, settings, ctx.obj.get("overrides"))
    if settings.cluster.peers:
        # the cluster and httpx (with pygments and idna, ~4 MiB resident) only where there are peers (issue 18)
        from sparkd.loop.cluster import Cluster

        daemon.cluster = Cluster(settings.cluster)
        daemon.cluster.attach(daemon)
    try:
        _run_loop(daemon.serve())
    except SparkdError as e:
        click.echo(f"sparkd: {e.message}", err=True)
        sys.exit(1)
    except OSError as e:
        click.echo(f"sparkd: {e}", err=True)
        sys.exit(1)


def _file_settings(path: Any, settings: Settings, overrides: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the file (with the environment) gave the daemon, as ``Settings.model_dump(mode="json")``: the config
    watch's "as started" (``loop.daemon_db.config_watch_loop``). Taken now, not when the watch first runs: an edit
    made while the daemon started was taken for what it runs, and never said (helper-49). The command line's
    overrides (``--dry-run``) are not the file's: loaded again without them."""
    if path is None:
        return None
    if not overrides:
        return settings.model_dump(mode="json")
    from sparkd.config import load_settings

    try:
        return load_settings(path).model_dump(mode="json")
    except SparkdError:
        return None


def _run_loop(main_coro: Coroutine[Any, Any, None]) -> None:
    """Run the daemon on uvloop (libuv's event loop, in C) where it is installed, else on asyncio's.

    Issue 18: the idle daemon's cost is mostly its wake-ups. Measured side by side on the 2-vCPU test
    VM (3 daemons each, one 120 s window, 1 Hz): 768 µs CPU per s on asyncio's loop, 720 on uvloop;
    an event loop that only wakes once a second: 192 against 136 (``bench/idle.py``). The daemon's
    ``daemon_started`` event names the loop it runs on (``details.event_loop``)."""
    try:
        import uvloop
    except ImportError:  # a platform without a uvloop wheel: the same daemon on asyncio's loop
        asyncio.run(main_coro)
    else:
        uvloop.run(main_coro)


def _archive_of(settings: Settings, stop: dict[str, Any] | None, st: Status | None = None) -> str | None:
    """The path of the last stop's postmortem archive, or None: what the daemon holds of its last stop
    (``ContainerStatus.last_stop.archive``, as the dashboard reads it: an archive written after the stop event, late,
    is named too) when that is the stop of the newest stop event ``stop`` (it began before the event) or there is no
    event; else the archive the event names (``details.archive``)."""
    mine = st.container.last_stop if st is not None else None
    ts = (stop or {}).get("ts")
    if mine is not None and mine.archive and (not isinstance(ts, int | float) or mine.at <= ts):
        return str(settings.archives_path / mine.archive)
    name = ((stop or {}).get("details") or {}).get("archive")
    return str(settings.archives_path / name) if name else None


def _echo_snapshot(st: Status, last_stop: dict[str, Any] | None = None) -> None:
    """Rules, watermark warnings, driver memory, GPUs and the container of a stored status; ``last_stop``: the
    newest stop event (``stopped``, ``killed``, ``stop_unconfirmed``), whose outcome the ``stopped by:`` line says."""
    if st.rules:
        click.echo("rules:")
        for r in st.rules:
            extra = f", near misses {r.near_misses}" if r.evidence else ""
            if r.demoted:
                extra += f"  DEMOTED to warn: {r.demoted}"
            need = f"{r.counter}/{r.samples}"
            if r.for_s:  # a duration rule: how long it has held, of for_s ("16/3" read as overrun, note 10 C1)
                within = f" in the last {r.in_last_s:g} s" if r.in_last_s else ""
                need = f"held {r.held_s or 0:.0f}/{r.for_s:g} s{within} ({r.counter} samples, at least {r.samples})"
            if r.holds and r.counter == 0:  # a trip started its count again: not a quiet 0/N
                need += f" ({HOLDS_AGAIN_TEXT})"
            if r.blind:  # a rule whose input is missing is never shown as a quiet 0/N
                need = f"BLIND ({r.blind})"
            trips = f"{r.trips} ({idle})" if (idle := idle_trips_text(r.idle_trips)) else f"{r.trips}"
            click.echo(f"  {r.name:<26} {need}  trips since start {trips}{extra}  [{r.action}: {rule_cond(r)}]")
    for name, blind_why in st.blind.sensors.items():
        click.echo(f"BLIND: {name}: {blind_why}")
    if st.kernel_log.lost:
        click.echo(f"kernel log: {st.kernel_log.lost} line(s) lost to the kernel's ring buffer before sparkd read them")
    for w in st.watermark.warnings:
        click.echo(f"WATERMARK WARNING: {w}")
    for w in st.watermark.notes:
        click.echo(f"floors: {w}")
    if (why := unarmed([r.model_dump() for r in st.rules])) is not None and st.sample is not None:
        click.echo(f"NOT GUARDED: no rule would stop the model: {why}")  # the dashboard's headline (helper-48)
    if said := config_file_text(st.config_file.model_dump() if st.config_file else None):
        click.echo(f"CONFIG: {said}")
    if st.api_error:  # the dashboard cannot say it: the API is what is missing
        click.echo(f"API: NOT SERVED: {st.api_error} (the guard runs without it; tried again every api.retry_s)")
    leak = st.leak
    if leak.baseline_bytes is not None:
        click.echo(
            f"driver memory: {fmt_gib(leak.current_bytes)} now, baseline {fmt_gib(leak.baseline_bytes)}, "
            f"growth {fmt_gib(leak.growth_bytes)} ({leak.state})"
        )
    else:
        click.echo(f"driver memory: {fmt_gib(leak.current_bytes)} ({leak.state})")
    for g in st.gpu:
        if g.available:
            mem = fmt_gib(g.memory_used_bytes) if g.memory_supported else "memory Not Supported"
            click.echo(f"GPU {g.index}: {g.name} util {g.utilization_pct}% {g.temperature_c} C {g.power_w} W, {mem}")
    c = st.container
    # state none: "container: none vllm" read as a name (helper-44)
    what = "monitor-only" if c.mode == "monitor-only" else c.state.value
    if what == "none":
        what = "not found:" if nothing_guarded(c) else "not running:"
    line = f"container: {what}"
    if c.name:
        line += f" {c.name}" + (f" ({c.container_id[:12]})" if c.container_id else "")
    if c.image:
        line += f", image {c.image}"
    if c.uptime_s is not None:
        # the snapshot is written on a change or every STATUS_QUIET_S: its uptime is as old as it is (a new user
        # saw "up 12 s" three times over 15 s)
        line += f", up {_span(c.uptime_s + max(0.0, time.time() - st.ts))}"
    if c.memory_bytes:
        line += f", --memory {fmt_gib(c.memory_bytes)}"
    why = c.reason or c.state_reason
    if why:
        line += f" — {why}"
    if c.ignored:
        line += f" — {c.ignored} is NOT GUARDED: sparkd never stops it"
    if c.restart_count:
        line += f" — Docker restarted it {c.restart_count} times (restart policy {c.restart_policy})"
    click.echo(line)
    missing = nothing_guarded(c)
    mode = guard_missing_mode_text(c.name, st.dry_run) if missing else mode_text(c.mode, st.dry_run)
    if mode:  # which mode: it was said nowhere (helper-37)
        click.echo(f"mode: {mode}")
    if missing:
        click.echo(
            f"NOTHING GUARDED since {_ts(c.guard_missing_since)} UTC: no container named {c.name} (`docker ps -a` "
            "lists none by that name or id), so a trip has nothing to stop; set container.guard to the name "
            "`docker ps -a` shows, or start the container by that name"
            + (f"; running now: {', '.join(c.guard_candidates)}" if c.guard_candidates else "")
        )
    if c.mode != "monitor-only" and c.start_error:
        held = "nothing is launched at start until they succeed" if c.mode == "managed" else "guarding it as ever"
        click.echo(
            f"START-UP STEPS FAILED: {c.start_error} — the budget revision and how the last launch ended could not "
            f"be read or written; tried again with back-off; Docker is watched and a trip stops the model; {held}"
        )
    if c.mode != "monitor-only" and c.watch_error:
        click.echo(
            f"CONTAINER NOT WATCHED: sparkd's looks at the container fail ({c.watch_error}) — the state shown may be "
            "stale; "
            "exits, OOM kills and /health are not observed; a trip still stops the model (by its processes if the "
            "engine refuses)"
        )
    if c.mode != "monitor-only" and c.engine == "down":
        click.echo(
            f"DOCKER ENGINE UNREACHABLE: {c.engine_error or 'no answer'} — a stop acts on the model's "
            "processes (its archive without the container's log); start, restart and resize wait for the engine"
        )
    sv = c.supervision
    run_at = c.started_at
    i = c.down_because()  # not an earlier incident's intent (helper-36)
    if sv is not None and i is not None:
        after = (
            f"relaunch scheduled at {_ts(sv.pending_relaunch.get('at'))} UTC"
            if sv.pending_relaunch
            # guard mode: sparkd never starts the container, and refuses `sparkd start` (helper-37)
            else "stays stopped until `sparkd start`"
            if c.mode == "managed"
            else f"stays stopped until you start it (`docker start {c.name}`: guard mode, sparkd does not start it)"
        )
        # how that stop ended: "killed (hard floor)" read only in the events and the dashboard's card (helper-35).
        # The newest stop event is this run's when it came after the run's start (an operator's stop records its
        # intent after its stop event, so the intent's time cannot tell)
        stop = last_stop or {}
        d = stop.get("details") or {}
        how = ""
        if d.get("outcome") and of_this_run(stop.get("ts", 0.0), run_at if run_at is not None else i.since - 1.0):
            code = d.get("exit_code")
            how = f", {d['outcome']}" + (f" (exit code {code})" if code is not None else "")
            how += " (not confirmed by Docker)" if stop.get("kind") == "stop_unconfirmed" else ""
        click.echo(f"stopped by: {i.intent} ({i.who}) at {_ts(i.since)} UTC{how} — {after}")
    ended = c.stop_of_this_run()  # its archive not written, its intent not saved: the dashboard's cards say it too
    for lost in stop_not_kept(ended.model_dump() if ended else None, c.mode):
        click.echo(f"{lost['head'].upper()}: {lost['text']}")
    if sv is not None and sv.breaker.open:
        b = sv.breaker
        click.echo(
            f"CIRCUIT BREAKER OPEN since {_ts(b.open_since)} UTC: {b.count} emergency stops (threshold {b.threshold} "
            f"in {_span(b.window_s)}); no automatic relaunch until `sparkd rearm`"
        )
    if c.unguarded is not None:
        u = c.unguarded
        click.echo(
            f"NOT GUARDED: container {u.name} ({u.id[:12]}) runs without sparkd's label since {_ts(u.since)} UTC: "
            "sparkd will not stop it, so no stop rule protects this host from it"
        )
    if st.consumers is not None:
        cs = st.consumers
        over = f" — {fmt_gib(cs.cotenant_excess_bytes)} over the co-tenant limit" if cs.cotenant_excess_bytes else ""
        click.echo(f"who holds the memory ({_ts(cs.at)} UTC): {cs.text}{over}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--cluster", "cluster", is_flag=True, help="Every node of the cluster side by side (asks the daemon).")
@click.pass_context
def status(ctx: click.Context, as_json: bool, cluster: bool) -> None:
    """Latest sample, each rule's counter, container state and recent events."""
    settings = _settings(ctx, reading=True)
    if cluster:
        _cluster_status(settings, as_json)
        return
    try:
        store = _store(settings)
        st = _snapshot(store)
        now = time.time()
        # a wall clock stepped back leaves samples dated in the future: they are not the latest reading
        latest = store.latest_sample(until=now + CLOCK_SLACK_S)
        events = store.events(limit=10)
        last_stop = store.events(kinds=("stopped", "killed", "stop_unconfirmed"), limit=1)
    except READ_OR_OPEN_ERRORS as err:  # disk full, corrupt, locked, read-only: one line, no traceback
        raise unreadable(settings, err) from None
    # alive: the newest record it wrote (the snapshot when something changes or every STATUS_QUIET_S,
    # samples every store.WRITE_EVERY_S) is recent
    # ... nor a snapshot dated in the future (a dead daemon's, written before the step) a sign of life
    stamps = [t for t in (st.ts if st else None, float(latest["ts"]) if latest else None) if t is not None]
    newest = max((t for t in stamps if t <= now + CLOCK_SLACK_S), default=0.0)
    recording = st is not None and st.running and now - newest < STALE_S + 2 * settings.interval_s
    # nothing recent in the database is not a daemon that is gone: one that cannot write (a full disk, a lock, a
    # hung write) guards from memory. It read "sparkd NOT running", and an operator restarted a working guard
    # (helper-53); the state dir's socket says whether one holds it
    from pathlib import Path

    from sparkd.loop.statelock import daemon_pid

    holder = daemon_pid(Path(settings.state_dir))  # the live daemon's pid, or None ("daemon_pid" in --json)
    running = recording or holder is not None
    snap = st.model_dump(mode="json") if st else {}
    data = {
        "daemon_running": running,
        "recording": recording,  # False with daemon_running: it runs and its database shows nothing recent
        "daemon_pid": holder,
        "snapshot_age_s": (time.time() - st.ts) if st else None,
        "sample": latest,
        "rules": snap.get("rules", []),
        "container": snap.get("container"),
        "mode": snap.get("mode"),
        "interval_s": snap.get("interval_s"),
        "kernel_log": snap.get("kernel_log"),
        "blind": snap.get("blind"),
        "usable_bytes": snap.get("usable_bytes"),
        "leak": snap.get("leak"),
        "watermark": snap.get("watermark"),
        "notify": snap.get("notify"),
        "gpu": snap.get("gpu"),
        "consumers": snap.get("consumers"),
        "nearest_stop": snap.get("nearest_stop"),
        "last_archive": _archive_of(settings, last_stop[0] if last_stop else None, st),
        "events": events,
        "db_path": str(settings.db_file),
    }
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    age = _age(data["snapshot_age_s"])
    if recording:
        said = f"running (status of {age})"
    elif holder is not None:
        said = (
            f"running (pid {holder}) but NOT RECORDING: its database shows nothing recent (last snapshot {age}); it "
            "guards from memory: see /api/status and `sparkd doctor` (disk full, a lock, a hung write?); what "
            "follows is old"
        )
    else:
        said = f"NOT running (last snapshot {age})"
    click.echo(f"sparkd {said} — db {settings.db_file}")
    if latest:
        click.echo(f"sample at {_ts(latest['ts'])} UTC:")
        for key, label in (
            ("mem_total", "MemTotal"),
            ("mem_available", "MemAvailable"),
            ("mem_available_minus_cma", "usable"),
            ("mem_free", "MemFree"),
            ("cached", "Cached"),
            ("anon_pages", "AnonPages"),
            ("slab", "Slab"),
            ("page_tables", "PageTables"),
            ("driver_bytes", "driver (est.)"),
            ("shm_bytes", "/dev/shm"),
        ):
            # the estimate's remainder on a host without the driver is no driver memory (the Now card says so too)
            no_driver = key == "driver_bytes" and st is not None and no_nvidia_driver(st)
            click.echo(f"  {label:<14} {NO_DRIVER_TEXT if no_driver else fmt_gib(latest.get(key)):>12}")
        if latest.get("psi_some_avg10") is not None:
            click.echo(
                f"  {'PSI some/full':<14} {latest['psi_some_avg10']:.2f}% / {latest.get('psi_full_avg10') or 0:.2f}%"
                " (avg10)"
            )
    else:
        click.echo("no samples yet")
    if st is None:
        click.echo("no status snapshot yet")
    else:
        _echo_snapshot(st, last_stop[0] if last_stop else None)
    if data["last_archive"]:
        click.echo(f"last stop's postmortem archive: {data['last_archive']}")
    if events:
        click.echo("recent events:")
        for e in events:
            click.echo(f"  {_ts(e['ts'])} {e['severity']:<8} {e['kind']:<22} {e['message'][:110]}")


@main.command()
@click.option("--since", default="10m", show_default=True, help="How far back (e.g. 30s, 10m, 2h; a bare number: s).")
@click.option("--json", "as_json", is_flag=True, help="All columns, sizes in bytes.")
@click.option("--csv", "as_csv", is_flag=True, help="All columns, sizes in bytes.")
@click.pass_context
def samples(ctx: click.Context, since: str, as_json: bool, as_csv: bool) -> None:
    """Stored samples since a time ago: a table in GiB, or every column in bytes (--json, --csv)."""
    if as_json and as_csv:
        raise click.UsageError("--json and --csv: choose one")
    settings = _settings(ctx, reading=True)
    since_s = _since(since)
    rows = _store(settings).samples(since=time.time() - since_s)
    if as_json:
        click.echo(json.dumps(rows))
    elif as_csv:
        buf = io.StringIO()
        if rows:
            w = csv.DictWriter(buf, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        click.echo(buf.getvalue(), nl=False)
    else:
        click.echo(f"{'time (UTC)':<20} {'MemAvailable':>13} {'MemFree':>11} {'Cached':>11} {'driver':>11}")
        for r in rows:
            click.echo(
                f"{_ts(r['ts']):<20} {fmt_gib(r['mem_available']):>13} {fmt_gib(r['mem_free']):>11} "
                f"{fmt_gib(r['cached']):>11} {fmt_gib(r['driver_bytes']):>11}"
            )


@main.command()
@click.option("--since", default="1h", show_default=True)
@click.option("--kind", "kinds", multiple=True, help="Only these kinds (repeatable).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def events(ctx: click.Context, since: str, kinds: tuple[str, ...], as_json: bool) -> None:
    """Recorded events (trips, stops, driver errors, OOM kills, ...)."""
    settings = _settings(ctx, reading=True)
    try:
        rows = _store(settings).events(since=time.time() - _since(since), kinds=kinds or None, limit=10000)
    except READ_OR_OPEN_ERRORS as err:  # a traceback before (helper-55)
        raise unreadable(settings, err) from None
    if as_json:
        click.echo(json.dumps(rows, default=str))
        return
    if not rows:  # said, not an empty screen (`launches` says "no launches recorded")
        what = f"of kind {', '.join(kinds)} " if kinds else ""
        click.echo(f"no events {what}in the last {since}", err=True)
    for e in reversed(rows):
        click.echo(f"{_ts(e['ts'])} {e['severity']:<8} {e['kind']:<22} {e['message']}")


def _cluster_status(settings: Any, as_json: bool) -> None:
    """``sparkd status --cluster``: this node and its peers, through the running daemon's ``/api/cluster``."""
    import httpx

    base = api_base(settings)
    try:
        local = httpx.get(base + "/api/status", timeout=5).json()
        view = httpx.get(base + "/api/cluster", timeout=15)
    except httpx.HTTPError as e:
        raise SparkdError(f"the daemon's API at {base} does not answer ({e}); is `sparkd run` running?") from None
    if view.status_code == 404:
        raise SparkdError("no cluster: [cluster] has no peers in this node's configuration")
    nodes = [{"node": view.json()["node"], "reachable": True, "age_s": 0.0, "status": local}, *view.json()["peers"]]
    if as_json:
        click.echo(json.dumps(nodes, indent=2, default=str))
        return
    click.echo(f"{'node':<16} {'reachable':<10} {'MemAvailable':>13} {'container':<12} last stop")
    for n in nodes:
        st = n.get("status") or {}
        sample = st.get("sample") or {}
        cont = st.get("container") or {}
        seen = "yes" if n["reachable"] else f"no ({_age(n.get('age_s'))} old)" if n.get("age_s") is not None else "no"
        last = next((e for e in st.get("events", []) if e.get("kind") in ("stopped", "killed")), None)
        click.echo(
            f"{n['node']:<16} {seen:<10} {fmt_gib(sample.get('mem_available')):>13} "
            f"{cont.get('state', 'n/a')!s:<12} {last['message'][:60] if last else '-'}"
        )
