"""``sparkd`` command line (click). Each command validates settings once and passes them down."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from . import __version__
from .config import Settings, effective_config, load_settings
from .errors import SparkdError
from .store import Store
from .units import fmt_gib, parse_duration_s

STALE_S = 10.0


def _settings(ctx: click.Context) -> Settings:
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        try:
            obj["settings"] = load_settings(obj.get("config"), overrides=obj.get("overrides"))
        except SparkdError as e:
            click.echo(f"sparkd: {e.message}", err=True)
            ctx.exit(2)
    settings: Settings = obj["settings"]
    return settings


def _store(settings: Settings) -> Store:

    return Store.open(settings.db_file)


def _ts(t: float | None) -> str:
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SparkdError as e:
            click.echo(f"sparkd: {e.message}", err=True)
            sys.exit(1 if e.status_code < 500 or e.status_code == 503 else 3)


@click.group(cls=_Group)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML settings file (default /etc/sparkd/sparkd.toml if present).",
)
@click.version_option(__version__, prog_name="sparkd")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """sparkd — memory guard and cockpit for vLLM on DGX Spark."""
    ctx.ensure_object(dict)["config"] = config_path


@main.command()
@click.option("--dry-run", is_flag=True, help="Record what would happen; never stop anything.")
@click.option("--no-api", is_flag=True, help="Do not serve the REST API / dashboard.")
@click.pass_context
def run(ctx: click.Context, dry_run: bool, no_api: bool) -> None:
    """Run the daemon in the foreground (systemd: Type=notify)."""
    if dry_run:
        ctx.obj["overrides"] = {**ctx.obj.get("overrides", {}), "dry_run": True}
    settings = _settings(ctx)
    from .daemon import Daemon
    from .logsetup import setup_logging
    from .supervisor import make_actions

    setup_logging(settings.logs_path)
    daemon = Daemon(settings, actions=make_actions(settings), serve_api=False if no_api else None)
    try:
        asyncio.run(daemon.serve())
    except SparkdError as e:
        click.echo(f"sparkd: {e.message}", err=True)
        sys.exit(1)
    except OSError as e:
        click.echo(f"sparkd: {e}", err=True)
        sys.exit(1)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Latest sample, each rule's counter, container state and recent events."""
    settings = _settings(ctx)
    store = _store(settings)
    snap = store.status_snapshot() or {}
    latest = store.latest_sample()
    events = store.events(limit=10)
    running = (
        bool(snap) and snap.get("running", True) and time.time() - snap.get("ts", 0) < STALE_S + 2 * settings.interval_s
    )
    data = {
        "daemon_running": running,
        "snapshot_age_s": (time.time() - snap["ts"]) if snap else None,
        "sample": latest,
        "rules": snap.get("rules", []),
        "container": snap.get("container"),
        "mode": snap.get("mode"),
        "interval_s": snap.get("interval_s"),
        "kernel_log": snap.get("kernel_log"),
        "leak": snap.get("leak"),
        "watermark": snap.get("watermark"),
        "notify": snap.get("notify"),
        "events": events,
        "db_path": str(settings.db_file),
    }
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    click.echo(
        f"sparkd {'running' if running else 'NOT running (last snapshot ' + _age(data['snapshot_age_s']) + ')'}"
        f" — db {settings.db_file}"
    )
    if latest:
        click.echo(f"sample at {_ts(latest['ts'])} UTC:")
        for key, label in (
            ("mem_total", "MemTotal"),
            ("mem_available", "MemAvailable"),
            ("mem_free", "MemFree"),
            ("cached", "Cached"),
            ("anon_pages", "AnonPages"),
            ("slab", "Slab"),
            ("page_tables", "PageTables"),
            ("driver_bytes", "driver (est.)"),
            ("shm_bytes", "/dev/shm"),
        ):
            click.echo(f"  {label:<14} {fmt_gib(latest.get(key)):>12}")
        if latest.get("psi_some_avg10") is not None:
            click.echo(
                f"  {'PSI some/full':<14} {latest['psi_some_avg10']:.2f}% / {latest.get('psi_full_avg10') or 0:.2f}%"
                " (avg10)"
            )
    else:
        click.echo("no samples yet")
    if data["rules"]:
        click.echo("rules:")
        for r in data["rules"]:
            extra = f", near misses {r['near_misses']}" if r.get("evidence") else ""
            if r.get("demoted"):
                extra += f"  DEMOTED to warn: {r['demoted']}"
            click.echo(
                f"  {r['name']:<26} {r['counter']}/{r['samples']}  trips {r['trips']}{extra}  "
                f"[{r['action']}: {' and '.join(r['when'])}]"
            )
    wm = data["watermark"] or {}
    for w in wm.get("warnings") or []:
        click.echo(f"WATERMARK WARNING: {w}")
    leak = data["leak"] or {}
    if leak.get("baseline_bytes") is not None:
        click.echo(
            f"driver memory: {fmt_gib(leak.get('current_bytes'))} now, baseline "
            f"{fmt_gib(leak.get('baseline_bytes'))}, growth {fmt_gib(leak.get('growth_bytes'))} "
            f"({leak.get('state')})"
        )
    elif leak:
        click.echo(f"driver memory: {fmt_gib(leak.get('current_bytes'))} ({leak.get('state')})")
    c = data["container"] or {}
    if c:
        click.echo(f"container: {c.get('state') or c.get('mode')} {('— ' + c['reason']) if c.get('reason') else ''}")
    if events:
        click.echo("recent events:")
        for e in events:
            click.echo(f"  {_ts(e['ts'])} {e['severity']:<8} {e['kind']:<22} {e['message'][:110]}")


def _age(s: float | None) -> str:
    return "never" if s is None else f"{s:.0f} s ago"


@main.command()
@click.option("--since", default="10m", show_default=True, help="How far back (e.g. 30s, 10m, 2h).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--csv", "as_csv", is_flag=True)
@click.pass_context
def samples(ctx: click.Context, since: str, as_json: bool, as_csv: bool) -> None:
    """Stored samples (bytes) since a time ago."""
    settings = _settings(ctx)
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


def _since(text: str) -> float:
    try:
        return parse_duration_s(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from None


@main.command()
@click.option("--since", default="1h", show_default=True)
@click.option("--kind", "kinds", multiple=True, help="Only these kinds (repeatable).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def events(ctx: click.Context, since: str, kinds: tuple[str, ...], as_json: bool) -> None:
    """Recorded events (trips, stops, driver errors, OOM kills, ...)."""
    settings = _settings(ctx)
    rows = _store(settings).events(since=time.time() - _since(since), kinds=kinds or None, limit=10000)
    if as_json:
        click.echo(json.dumps(rows, default=str))
        return
    for e in reversed(rows):
        click.echo(f"{_ts(e['ts'])} {e['severity']:<8} {e['kind']:<22} {e['message']}")


@main.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def config_show(ctx: click.Context, as_json: bool) -> None:
    """Print the effective configuration (file + SPARKD_* env + defaults)."""
    settings = _settings(ctx)
    data = effective_config(settings)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    from .tomlout import dumps

    click.echo(dumps(data))


@main.group("db")
def db_group() -> None:
    """Database maintenance."""


@db_group.command("upgrade")
@click.pass_context
def db_upgrade(ctx: click.Context) -> None:
    """Create or upgrade the SQLite schema (Alembic) to the newest revision."""
    settings = _settings(ctx)
    store = _store(settings)
    click.echo(f"{settings.db_file}: schema at revision {store.current_revision()}")


def _last_trip(settings: Settings) -> Any:
    from .doctor import LastTrip

    try:
        rows = _store(settings).events(kinds=["trip"], limit=1) if settings.db_file.exists() else []
    except SparkdError:
        return None
    return LastTrip(rows[0]["ts"], rows[0]["message"]) if rows else None


@main.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """Is this host ready? One line per check: OK, WARN or FAIL with what to do. Exit 1 on FAIL."""
    settings = _settings(ctx)
    from . import doctor as doc

    checks = doc.run_checks(
        doc.DoctorContext(
            proc_root=Path(settings.proc_root),
            shm_dir=Path(settings.shm_dir),
            last_trip=lambda: _last_trip(settings),
        )
    )
    click.echo(doc.format_report(checks))
    ctx.exit(doc.exit_code(checks))


def _sparkd_exe() -> str:
    import shutil

    exe = Path(sys.argv[0]).resolve() if Path(sys.argv[0]).name == "sparkd" else None
    found = shutil.which("sparkd")
    return str(exe or (Path(found).resolve() if found else Path(sys.executable).parent / "sparkd"))


@main.command()
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default="/",
    show_default=True,
    help="Install into this directory tree instead of the live system.",
)
@click.option("--no-enable", is_flag=True, help="Lay the files down but do not enable/start the unit.")
@click.option(
    "--accept-gpu-risk", is_flag=True, help="Reload systemd even though a running GPU container could lose its GPU."
)
def install(root: str, no_enable: bool, accept_gpu_risk: bool) -> None:
    """Lay down the systemd unit, an example /etc/sparkd/sparkd.toml and the API token; enable the service."""
    from .install import install as do_install

    report = do_install(Path(root), sparkd_exe=_sparkd_exe(), enable=not no_enable, accept_gpu_risk=accept_gpu_risk)
    click.echo(report.format())
    sys.exit(report.exit_code)


@main.command()
@click.option("--root", type=click.Path(file_okay=False), default="/", show_default=True)
@click.option("--purge", is_flag=True, help="Also delete /etc/sparkd and /var/lib/sparkd (data, token, archives).")
def uninstall(root: str, purge: bool) -> None:
    """Disable and remove the unit; configuration and data are kept unless --purge."""
    from .install import uninstall as do_uninstall

    report = do_uninstall(Path(root), purge=purge)
    click.echo(report.format())
    sys.exit(report.exit_code)


def _register() -> None:
    from .replay import replay_command

    main.add_command(replay_command)


_register()

if __name__ == "__main__":
    main()
