"""``sparkd`` command line (click). Each command validates settings once and passes them down."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import datetime as dt
import io
import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError

from sparkd import __version__
from sparkd.config import Settings, effective_config, load_settings
from sparkd.core.choices import KV_CACHE_DTYPES
from sparkd.errors import SparkdError, StoreError
from sparkd.loop.status import ResizeResult, Status
from sparkd.store.store import Store
from sparkd.units import GiB, fmt_gib, parse_duration_s

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


def _store(settings: Settings, *, migrate: bool = False) -> Store:
    """The daemon's database for reading (no migration: the daemon owns the schema)."""
    if not migrate and not settings.db_file.exists():
        raise StoreError(
            f"no database at {settings.db_file} yet: start the daemon (sparkd run), or pass the "
            "--config / SPARKD_STATE_DIR it runs with"
        )
    return Store.open(settings.db_file, migrate=migrate)


def _snapshot(store: Store) -> Status | None:
    """The status the daemon stored last, typed; None when there is none or it is from another
    sparkd version (its shape no longer matches ``Status``: said on stderr, ignoring it)."""
    raw = store.status_snapshot()
    if not raw:
        return None
    try:
        return Status.model_validate(raw)
    except ValidationError as e:
        click.echo(f"sparkd: ignoring the stored status snapshot (another sparkd version?): {e.errors()[0]}", err=True)
        return None


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
    from sparkd.face.app import create_app
    from sparkd.logsetup import setup_logging
    from sparkd.loop.daemon import Daemon
    from sparkd.loop.supervisor import make_actions

    os.umask(0o077)  # state dir 0700, database, logs, archives and token 0600 whatever the caller's umask
    setup_logging(settings.logs_path)
    from sparkd.loop.cluster import Cluster

    daemon = Daemon(
        settings, actions=make_actions(settings), serve_api=False if no_api else None, app_factory=create_app
    )
    if settings.cluster.peers:
        daemon.cluster = Cluster(settings.cluster)
        daemon.cluster.attach(daemon)
    try:
        asyncio.run(daemon.serve())
    except SparkdError as e:
        click.echo(f"sparkd: {e.message}", err=True)
        sys.exit(1)
    except OSError as e:
        click.echo(f"sparkd: {e}", err=True)
        sys.exit(1)


def _echo_snapshot(st: Status) -> None:
    """Rules, watermark warnings, driver memory, GPUs and the container of a stored status."""
    if st.rules:
        click.echo("rules:")
        for r in st.rules:
            extra = f", near misses {r.near_misses}" if r.evidence else ""
            if r.demoted:
                extra += f"  DEMOTED to warn: {r.demoted}"
            need = f"{r.counter}/{r.samples}" + (f" ({r.for_s:g} s)" if r.for_s else "")
            if r.blind:  # a rule whose input is missing is never shown as a quiet 0/N
                need = f"BLIND ({r.blind})"
            click.echo(f"  {r.name:<26} {need}  trips {r.trips}{extra}  [{r.action}: {' and '.join(r.when)}]")
    for name, blind_why in st.blind.sensors.items():
        click.echo(f"BLIND: {name}: {blind_why}")
    if st.kernel_log.lost:
        click.echo(f"kernel log: {st.kernel_log.lost} line(s) lost to the kernel's ring buffer before sparkd read them")
    for w in st.watermark.warnings:
        click.echo(f"WATERMARK WARNING: {w}")
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
    what = "monitor-only" if c.mode == "monitor-only" else c.state.value
    line = f"container: {what}"
    if c.name:
        line += f" {c.name}" + (f" ({c.container_id[:12]})" if c.container_id else "")
    if c.image:
        line += f", image {c.image}"
    if c.uptime_s is not None:
        line += f", up {_span(c.uptime_s)}"
    if c.memory_bytes:
        line += f", --memory {fmt_gib(c.memory_bytes)}"
    why = c.reason or c.state_reason
    if why:
        line += f" — {why}"
    if c.restart_count:
        line += f" — Docker restarted it {c.restart_count} times (restart policy {c.restart_policy})"
    click.echo(line)
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
    settings = _settings(ctx)
    if cluster:
        _cluster_status(settings, as_json)
        return
    try:
        store = _store(settings)
        st = _snapshot(store)
        latest = store.latest_sample()
        events = store.events(limit=10)
    except (SQLAlchemyError, sqlite3.Error, OSError) as err:  # disk full, corrupt, locked: one line, no traceback
        why = (str(getattr(err, "orig", None) or err).splitlines() or ["?"])[0][:200]
        raise StoreError(
            f"cannot read the database {settings.db_file}: {why}. A running sparkd keeps guarding from "
            "memory: see `sparkd doctor` and /api/status"
        ) from None
    running = st is not None and st.running and time.time() - st.ts < STALE_S + 2 * settings.interval_s
    snap = st.model_dump(mode="json") if st else {}
    data = {
        "daemon_running": running,
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
        "events": events,
        "db_path": str(settings.db_file),
    }
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    age = _age(data["snapshot_age_s"])
    click.echo(
        f"sparkd {'running (status of ' + age + ')' if running else 'NOT running (last snapshot ' + age + ')'}"
        f" — db {settings.db_file}"
    )
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
            click.echo(f"  {label:<14} {fmt_gib(latest.get(key)):>12}")
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
        _echo_snapshot(st)
    if events:
        click.echo("recent events:")
        for e in events:
            click.echo(f"  {_ts(e['ts'])} {e['severity']:<8} {e['kind']:<22} {e['message'][:110]}")


def _age(s: float | None) -> str:
    return "never" if s is None else f"{s:.0f} s ago"


def _span(s: float) -> str:
    """A duration for people: ``42 s``, ``17 min``, ``5.2 h``, ``3.1 d``."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.1f} d"


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
    from sparkd.tomlout import dumps

    click.echo(dumps(data))


@main.group("db")
def db_group() -> None:
    """Database maintenance."""


@db_group.command("upgrade")
@click.pass_context
def db_upgrade(ctx: click.Context) -> None:
    """Create or upgrade the SQLite schema (Alembic) to the newest revision."""
    settings = _settings(ctx)
    store = _store(settings, migrate=True)
    click.echo(f"{settings.db_file}: schema at revision {store.current_revision()}")


def _last_trip(settings: Settings) -> Any:
    from sparkd.ops.doctor import LastTrip

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
    from sparkd.ops import doctor as doc

    checks = doc.run_checks(
        doc.DoctorContext(
            proc_root=Path(settings.proc_root),
            shm_dir=Path(settings.shm_dir),
            last_trip=lambda: _last_trip(settings),
            shm_ignore_unreadable_pids=settings.shm_ignore_unreadable_pids,
            db_file=settings.db_file,
            rules=settings.rules,
        )
    )
    click.echo(doc.format_report(checks))
    ctx.exit(doc.exit_code(checks))


def _running_managed(settings: Settings) -> str | None:
    """Id of the running sparkd-managed container, if the engine answers (for install's GPU check)."""
    from sparkd.act.docker import ContainerManager

    try:
        info = ContainerManager(settings.container.docker_url, selector=settings.container.selector).adopt()
    except SparkdError:
        return None
    return info.id if info else None


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
    from sparkd.ops.install import install as do_install

    report = do_install(Path(root), sparkd_exe=_sparkd_exe(), enable=not no_enable, accept_gpu_risk=accept_gpu_risk)
    click.echo(report.format())
    sys.exit(report.exit_code)


@main.command()
@click.option("--root", type=click.Path(file_okay=False), default="/", show_default=True)
@click.option("--purge", is_flag=True, help="Also delete /etc/sparkd and /var/lib/sparkd (data, token, archives).")
def uninstall(root: str, purge: bool) -> None:
    """Disable and remove the unit; configuration and data are kept unless --purge."""
    from sparkd.ops.install import uninstall as do_uninstall

    report = do_uninstall(Path(root), purge=purge)
    click.echo(report.format())
    sys.exit(report.exit_code)


# ---------------------------------------------------------------- control (through the daemon's API)
def _api(
    settings: Settings, method: str, path: str, *, json_body: dict[str, Any] | None = None, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Call the running daemon's API with the bearer token from the state directory.

    Exits 1 with the API's ``{"error", "detail"}`` message on refusal; 3 when no daemon answers.
    """
    import httpx

    try:
        token = settings.token_file.read_text().strip()
    except OSError as e:
        click.echo(f"sparkd: cannot read the API token {settings.token_file}: {e} (is sparkd running here?)", err=True)
        sys.exit(3)
    host = "127.0.0.1" if settings.api.host in ("0.0.0.0", "::") else settings.api.host
    url = f"http://{host}:{settings.api.port}{path}"
    try:
        r = httpx.request(method, url, json=json_body, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as e:
        click.echo(f"sparkd: no daemon answers at {url}: {e}", err=True)
        sys.exit(3)
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"detail": r.text}
    if r.status_code >= 400:
        detail = data.get("detail")
        msg = detail.get("message", detail) if isinstance(detail, dict) else detail
        click.echo(f"sparkd: {data.get('error', r.status_code)}: {msg}", err=True)
        sys.exit(1)
    result: dict[str, Any] = data
    return result


def _control(ctx: click.Context, action: str, as_json: bool, force: bool = False) -> None:
    settings = _settings(ctx)
    out = _api(
        settings,
        "POST",
        f"/api/container/{action}" + ("?force=true" if force else ""),
        timeout_s=settings.container.stop_timeout_s + settings.container.startup_timeout_s + 60,
    )
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
        return
    stop = out.get("stop")
    if stop:
        click.echo(
            f"stopped: {stop.get('outcome')} (exit {stop.get('exit_code')}) in "
            f"{stop.get('durations_s', {}).get('total', 0):.1f} s; archive {stop.get('archive')}"
        )
    if out.get("launch_id"):
        click.echo(f"launched: launch {out['launch_id']} (follow with `sparkd status`)")


@main.command()
@click.option("--force", is_flag=True, help="Launch even if the preflight fails (recorded).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def start(ctx: click.Context, force: bool, as_json: bool) -> None:
    """Launch the serving container (preflight first)."""
    _control(ctx, "start", as_json, force)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def stop(ctx: click.Context, as_json: bool) -> None:
    """Stop the serving container: archive, graceful 30 s stop, kill fallback, /dev/shm cleanup."""
    _control(ctx, "stop", as_json)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def restart(ctx: click.Context, as_json: bool) -> None:
    """Stop (as ``stop``) and launch again."""
    _control(ctx, "restart", as_json)


_RESIZE_OPTS = [
    ("--kv-target-gib", "kv_target_gib", float),
    ("--max-model-len", "max_model_len", int),
    ("--max-num-seqs", "max_num_seqs", int),
    ("--host-reserve-gib", "host_reserve_gib", float),
    ("--kv-cache-dtype", "kv_cache_dtype", click.Choice(KV_CACHE_DTYPES)),
    ("--gmu-override", "gmu_override", float),
    ("--docker-headroom-gib", "docker_headroom_gib", float),
]


def _resize_options(f: Any) -> Any:
    for flag, dest, typ in reversed(_RESIZE_OPTS):
        f = click.option(flag, dest, type=typ, default=None)(f)
    return f


@main.command()
@_resize_options
@click.option("--dry-run", is_flag=True, help="Show the new plan and the differences; change nothing.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def resize(ctx: click.Context, dry_run: bool, as_json: bool, **changes: Any) -> None:
    """Change budget inputs: dry run shows the new plan; apply drains, stops and relaunches (rollback on failure)."""
    settings = _settings(ctx)
    body = {k: v for k, v in changes.items() if v is not None}
    if not body:
        raise click.UsageError("give at least one of " + ", ".join(f for f, _d, _t in _RESIZE_OPTS))
    out = _api(
        settings,
        "POST",
        "/api/resize",
        json_body={**body, "dry_run": dry_run},
        timeout_s=settings.container.drain_timeout_s + 2 * settings.container.startup_timeout_s + 120,
    )
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
        return
    r = ResizeResult.model_validate(out)
    click.echo(
        ("dry run: " if dry_run else "")
        + f"new plan: GMU {r.plan.gmu}, budget {r.plan.budget_gib:.2f} GiB, KV {r.plan.kv_exp_gib:.2f}"
        f" GiB, --memory {r.plan.docker_memory_gib:.2f} GiB"
    )
    for k, change in r.diff.items():
        click.echo(f"  {k:<22} {change.old} -> {change.new}")
    if not dry_run:
        click.echo("applied" if r.applied else f"NOT applied: {r.error} (rolled back: {r.rolled_back})")


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--limit", default=20, show_default=True)
@click.pass_context
def launches(ctx: click.Context, as_json: bool, limit: int) -> None:
    """Launch records: the plan beside what vLLM reported and the start-up trough."""
    settings = _settings(ctx)
    rows = _store(settings).launches(limit=limit)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        click.echo("no launches recorded")
    for r in rows:
        plan, act = r.get("plan") or {}, r.get("actual") or {}
        ready = f"ready after {r['ready_at'] - r['started_at']:.1f} s" if r.get("ready_at") else "never ready"
        click.echo(
            f"{_ts(r['started_at'])} {r['id']} {r['status']:<10} {ready}; trough "
            f"{fmt_gib(r.get('trough_bytes'))}; rev {r.get('revision')}{' FORCED' if r.get('forced') else ''}"
        )
        click.echo(
            f"    estimate: GMU {plan.get('gmu', '-')}, KV {_f(plan.get('kv_exp_gib'))} GiB, "
            f"max-len concurrency {_f(plan.get('max_len_concurrency'))}"
        )
        click.echo(
            f"    actual:   weights {_f(act.get('model_load_gib'))} GiB in {_f(act.get('model_load_s'))} s, "
            f"KV {_f(act.get('kv_cache_available_gib'))} GiB = {act.get('kv_cache_tokens', '-')} tokens, concurrency "
            f"{_f(act.get('max_concurrency'))}x, graphs {_f(act.get('graph_capture_gib'))} GiB"
        )
        if act.get("failure_summary"):
            click.echo(f"    failed:   {act['failure_summary']}")
        for text in (act.get("warnings") or {}).values():
            click.echo(f"    warning:  {text}")


_PLAN_OPTS = [
    ("--weights-gib", "weights_gib", float, "GPU-resident weights after PLE (GiB); default: measure model_dir"),
    ("--ple-gib", "ple_gib", float, "mmap'ed embedding tables (PLE) in the checkpoint"),
    ("--overhead-gib", "overhead_gib", float, "CUDA graphs, activations, workspaces"),
    ("--mtp-gib", "mtp_gib", float, "MTP memory (with --mtp)"),
    ("--mtp-off-credit-gib", "mtp_off_credit_gib", float, "weights not loaded with MTP off"),
    ("--kv-target-gib", "kv_target_gib", float, "KV cache wanted"),
    ("--host-reserve-gib", "host_reserve_gib", float, "left to the host"),
    ("--max-model-len", "max_model_len", int, "vLLM --max-model-len"),
    ("--kv-bytes-per-token", "kv_bytes_per_token", int, "16-bit KV bytes per token; default: from config.json"),
    ("--kv-cache-dtype", "kv_cache_dtype", click.Choice(KV_CACHE_DTYPES), "vLLM --kv-cache-dtype"),
    ("--kv-fp8-mult", "kv_fp8_mult", float, "KV_MULT of an fp8 KV cache; default 0.5 (0.58 for the notes' model)"),
    ("--max-num-seqs", "max_num_seqs", int, "vLLM --max-num-seqs"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "vLLM --max-num-batched-tokens"),
    ("--gmu-override", "gmu_override", float, "explicit --gpu-memory-utilization"),
    ("--docker-headroom-gib", "docker_headroom_gib", float, "Docker --memory = budget + this"),
]


def _plan_options(f: Any) -> Any:
    for flag, dest, typ, help_ in reversed(_PLAN_OPTS):
        f = click.option(flag, dest, type=typ, default=None, help=help_)(f)
    return f


@main.command()
@_plan_options
@click.option("--mem-total-gib", type=float, default=None, help="MemTotal (GiB); default: read /proc/meminfo now.")
@click.option("--model-dir", type=click.Path(), default=None, help="Checkpoint directory to measure.")
@click.option("--mtp/--no-mtp", default=None, help="Multi-token prediction on/off (counts --mtp-gib).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def plan(
    ctx: click.Context,
    mem_total_gib: float | None,
    model_dir: str | None,
    mtp: bool | None,
    as_json: bool,
    **inputs: Any,
) -> None:
    """The memory budget without launching (the seed's --no-launch): inputs with their sources,
    intermediate values, results. An incomplete checkpoint (a shard of the index missing or
    short) is refused (exit 1)."""
    from sparkd.core.budget import make_plan
    from sparkd.core.plan_table import render_plan_table
    from sparkd.errors import Refused
    from sparkd.loop.launch import budget_inputs, setting_sources
    from sparkd.sense.checkpoint import check_checkpoint

    settings = _settings(ctx)
    changes = {k: v for k, v in inputs.items() if v is not None}
    if mtp is not None:
        changes["mtp"] = mtp
    from pydantic import ValidationError

    from sparkd.config import BudgetSettings, format_validation_error

    try:
        b = BudgetSettings(**{**settings.budget.model_dump(), **changes, "enabled": True})
    except ValidationError as e:
        click.echo("sparkd: " + format_validation_error(e, "plan inputs"), err=True)
        sys.exit(2)
    c = settings.container.model_copy(update={"model_dir": model_dir} if model_dir else {})
    if mem_total_gib is not None:
        mem_total = int(mem_total_gib * 2**30)
    else:
        from sparkd.sense.procfs import read_meminfo

        mem_total = read_meminfo(settings.proc_root).fields["MemTotal"]
    check = check_checkpoint(c.model_dir) if c.model_dir else None
    if check is not None and not check.ok:
        raise Refused(
            check.describe() + ": vLLM would fail on it after loading the rest; complete the download",
            detail={"missing": list(check.missing), "problems": list(check.problems)},
        )
    sources = setting_sources(settings.budget, flags=changes)
    mem_src = "flag" if mem_total_gib is not None else "measured"
    p = make_plan(budget_inputs(b, c, mem_total, sources=sources, mem_total_source=mem_src))
    learned = _learned_reserve(settings.model_copy(update={"budget": b, "container": c}), mem_total, p)
    if (
        learned is not None
        and b.apply_learned_reserve
        and (learned.recommended_reserve_bytes or 0) > int(b.host_reserve_gib * GiB)
    ):  # the learned reserve, applied: the plan is made again with it (its evidence is printed below)
        b = b.model_copy(update={"host_reserve_gib": learned.recommended_reserve_bytes / GiB})
        sources = {**sources, "host_reserve_gib": "measured"}  # from the launch records
        p = make_plan(budget_inputs(b, c, mem_total, sources=sources, mem_total_source=mem_src))
        learned = dataclasses.replace(learned, applied=True)
    if as_json:
        out = p.to_json()
        out["checkpoint"] = None if check is None else {"ok": check.ok, "describe": check.describe()}
        out["learned"] = learned.to_json() if learned is not None else None
        click.echo(json.dumps(out, indent=2))
    else:
        from sparkd.loop.launch import launch_spec

        spec = launch_spec(
            settings.model_copy(
                update={"container": c.model_copy(update={"image": c.image or "vllm/vllm-openai:latest"})}
            ),
            p,
        )
        click.echo(render_plan_table(p, command=spec.docker_run_command()))
        if check is not None:
            click.echo(check.describe())
        if learned is not None:
            click.echo("\n".join(learned.lines()))


def _learned_reserve(settings: Settings, mem_total: int, p: Any) -> Any:
    """``loop.launch.learned_reserve`` over the daemon's stored launch records; None without a database."""
    from sparkd.loop.launch import learned_reserve

    if not settings.db_file.exists():
        return None
    store = _store(settings)
    try:
        launches = store.launches(limit=500)
    finally:
        store.close()
    return learned_reserve(
        settings,
        launches,
        mem_total_bytes=mem_total,
        budget_bytes=int(p.budget_gib * GiB),
        image=settings.container.image,
    )


def _cluster_status(settings: Any, as_json: bool) -> None:
    """``sparkd status --cluster``: this node and its peers, through the running daemon's ``/api/cluster``."""
    import httpx

    base = f"http://127.0.0.1:{settings.api.port}"
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


@main.command("vllm-log")
@click.argument("file", type=click.File("rb"))
@click.option("--json", "as_json", is_flag=True, help="The launch record as JSON.")
def vllm_log(file: Any, as_json: bool) -> None:
    """Why did this launch fail? Parse a saved vLLM log (or `docker logs` output; FILE - reads stdin)
    into the launch record: state, phase reached, figures, root cause and warnings.
    Exit status: 0 ready or still starting, 1 failed (or an empty log)."""
    from sparkd.sense.vllm_log import LaunchLogParser

    parser = LaunchLogParser()
    for raw in file:
        parser.feed(raw)
    rec = parser.record
    if as_json:
        click.echo(json.dumps(rec.to_json(), indent=2))
        sys.exit(1 if rec.failed else 0)
    if rec.lines_seen == 0:
        click.echo("sparkd: the log is empty", err=True)
        sys.exit(1)
    state = rec.state + (" (the log ends before 'Application startup complete')" if rec.state == "starting" else "")
    out = [f"state:   {state}", f"phase:   {rec.phase} (last start-up step the log shows)"]
    if rec.failed:
        out.append(f"cause:   {rec.failure_summary()}")
        if rec.failure_message:
            out.append(f"root cause line: {rec.failure_message}")
        if rec.failure_generic:
            out.append(f"generic line (not the reason): {rec.failure_generic}")
    skip = {"state", "phase", "failed", "failure_message", "failure_generic", "failure_summary", "warnings"}
    figures = {k: v for k, v in rec.to_json().items() if k not in skip and v not in (None, False)}
    if figures:
        out.append("figures:")
        width = max(len(k) for k in figures) + 2
        out += [f"  {k:<{width}}{json.dumps(v) if isinstance(v, dict) else v}" for k, v in figures.items()]
    for text in rec.warnings().values():
        out.append(f"WARNING: {text}")
    if rec.phase == "starting" and not rec.failed:
        out.append(
            f"NOTE: none of the {rec.lines_seen} lines is a vLLM start-up line sparkd knows "
            "(is this vLLM's output? `docker logs` writes it to stderr: add 2>&1)"
        )
    click.echo("\n".join(out))
    if rec.failed:
        sys.exit(1)  # a failed launch: scripts can branch on it (the report above says why)


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _register() -> None:
    from sparkd.ops.replay import replay_command

    main.add_command(replay_command)


_register()

if __name__ == "__main__":
    main()
