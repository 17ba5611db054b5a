"""Control through the running daemon: ``start``, ``stop``, ``restart``, ``rearm``, ``maintenance run``, ``resize``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from sparkd.config import Settings
from sparkd.core.choices import KV_CACHE_DTYPES
from sparkd.face.auth import CLIENT_HEADER
from sparkd.face.cli.base import (
    _settings,
    api_base,
    main,
)
from sparkd.face.presenters import rearm_text
from sparkd.loop.status import ResizeResult


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
    url = f"{api_base(settings)}{path}"
    _check_listener(settings, url)
    try:
        r = httpx.request(
            method,
            url,
            json=json_body,
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {token}", CLIENT_HEADER: "cli"},
        )
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        # something accepted the connection and closed it without an answer: a daemon at its connection cap aborts
        # new ones at once (``loop.httpserver``), and said "no daemon answers" while it ran and guarded (helper-33)
        click.echo(
            f"sparkd: the daemon at {url} closed the connection without an answer ({e}): it may be at its "
            'connection cap (api.max_connections; its log says "API connection refused", and `refused` in '
            "/api/status counts them). The guard does not depend on the API; retry once the clients holding "
            "connections are gone",
            err=True,
        )
        sys.exit(3)
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


def _check_listener(settings: Settings, url: str) -> None:
    """Exit 3 unless the sparkd that holds the state directory listens on the API's port: the token went to whatever
    held the port (a daemon that could not bind it guards without its API), and ``sparkd stop`` printed nothing and
    exited 0 against a program that answered 200, or waited ~31 min against one that never answered (helper-42).
    Where the daemon's sockets cannot be read (another user's process), nothing is checked."""
    import psutil

    from sparkd.loop.statelock import daemon_pid

    pid = daemon_pid(Path(settings.state_dir))
    if pid is None:
        click.echo(
            f"sparkd: no sparkd runs with state directory {settings.state_dir} (nothing sent to {url})", err=True
        )
        sys.exit(3)
    try:
        ports = {c.laddr.port for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN}
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        return
    if settings.api.port not in ports:
        click.echo(
            f"sparkd: sparkd (pid {pid}) does not serve its API on port {settings.api.port}: something else holds the "
            "port, or the API is off (--no-api); its token was not sent. The guard runs without the API and tries "
            "again every api.retry_s: `sparkd status` says why (API: not served)",
            err=True,
        )
        sys.exit(3)


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
    if out.get("handed_over"):  # a relaunch or resize under way stops the model (it printed nothing: helper-54)
        click.echo(out.get("message") or "handed over to the action under way")
    elif out.get("stopped_by"):  # the Docker engine did not answer: stopped by its processes
        click.echo(out.get("message") or f"stopped by its {out['stopped_by']}")
    elif stop:
        click.echo(
            f"stopped: {stop.get('outcome')} (exit {stop.get('exit_code')}) in "
            f"{stop.get('durations_s', {}).get('total', 0):.1f} s; archive {stop.get('archive')}"
        )
    if out.get("launch_id"):
        click.echo(f"launched: launch {out['launch_id']} (follow with `sparkd status`)")
    if out.get("warning"):
        click.echo(f"warning: {out['warning']}")


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


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def rearm(ctx: click.Context, as_json: bool) -> None:
    """Re-arm the circuit breaker (recorded with who and when); relaunches after an emergency stop."""
    out = _api(_settings(ctx), "POST", "/api/breaker/rearm")
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
        return
    click.echo(rearm_text(out))


@main.group("maintenance")
def maintenance_group() -> None:
    """Planned drain-and-relaunch."""


@maintenance_group.command("run")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def maintenance_run(ctx: click.Context, as_json: bool) -> None:
    """Drain (vllm:num_requests_running = 0, at most supervision.drain_limit_s), stop, start the same plan,
    smoke test; release the maintenance intent on pass, alert and hold on fail (exit 1)."""
    settings = _settings(ctx)
    c, u = settings.container, settings.supervision
    out = _api(
        settings,
        "POST",
        "/api/maintenance/run",
        timeout_s=u.drain_limit_s + c.stop_timeout_s + c.startup_timeout_s + u.probe_timeout_s + 60,
    )
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        d = out["drain"]
        click.echo(f"drain: {'drained' if d['drained'] else 'limit reached'} after {d['waited_s']:.1f} s")
        click.echo(f"relaunched: {out['relaunched']} (launch {out.get('launch_id')})")
        for name, check in out["smoke"]["checks"].items():
            click.echo(smoke_line(name, check))
        held = out.get("held_by") or "the maintenance intent"
        click.echo("released: maintenance intent cleared" if out["released"] else f"HOLD: {held}")
    sys.exit(0 if out["released"] else 1)


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
        click.echo(f"  {k:<22} {_figure(k, change.old)} -> {_figure(k, change.new)}")
    if r.diff and not ({"gmu", "budget_gib", "docker_memory_gib"} & set(r.diff)):
        # squeezed by the cap, a new KV target moves the wish but not what is launched: said (note 11)
        click.echo("  (GMU, budget and --memory are unchanged: the container would launch as it runs now)")
    if not dry_run:
        click.echo("applied" if r.applied else f"NOT applied: {r.error} (rolled back: {r.rolled_back})")


def _figure(key: str, value: Any) -> str:
    """A plan figure for people: sizes (``*_gib``) to two decimals with the unit, other floats to 4 digits."""
    if isinstance(value, float):
        return f"{value:.2f} GiB" if key.endswith("_gib") else f"{value:.4g}"
    return str(value)


def smoke_line(name: str, check: dict[str, Any]) -> str:
    """One smoke-test check for people: ok or FAILED, the decode rate beside its floor (``tok_s``,
    ``min_tok_s``: it printed "decode: ok" without the figure, note 11), and the error."""
    figure = ""
    if check.get("tok_s") is not None:
        figure = f"{check['tok_s']:.1f} tok/s (at least {check.get('min_tok_s', 0):g})"
    said = " ".join(x for x in (figure, check.get("error") or "") if x)
    return f"  {name}: {'ok' if check.get('ok') else 'FAILED'} {said}".rstrip()
