"""Host set-up and checks: ``config show``, ``db upgrade``, ``doctor``, ``install``, ``uninstall``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from sparkd.config import Settings, effective_config
from sparkd.errors import SparkdError
from sparkd.face.cli.base import (
    _budget_in_effect,
    _settings,
    _store,
    main,
    revision_note,
)


@main.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def config_show(ctx: click.Context, as_json: bool) -> None:
    """Print the effective configuration (file + SPARKD_* env + defaults; the budget of a resize in effect): what
    the next start of sparkd runs with. A running sparkd runs with what it loaded at its own start (it never
    reloads): said in a comment, with how to see whether the two differ."""
    from pathlib import Path

    from sparkd.loop.statelock import daemon_pid

    settings = _settings(ctx)
    data = effective_config(settings)
    budget, rev = _budget_in_effect(settings)
    note = None
    if rev is not None:
        data["budget"] = budget.model_dump(mode="json")
        note = revision_note(settings, rev)
    if (pid := daemon_pid(Path(settings.state_dir))) is not None:  # it printed an edit as "in effect" (helper-47)
        running = (
            f"the sparkd running now (pid {pid}) runs with the configuration it loaded at its start; an edit applies "
            "at its next start (`sparkd status` says CONFIG: when the file differs)"
        )
        note = f"{note}; {running}" if note else running
    if as_json:
        if note:
            click.echo(f"sparkd: {note}", err=True)  # stdout stays the configuration
        click.echo(json.dumps(data, indent=2))
        return
    from sparkd.tomlout import dumps

    if note:
        click.echo(f"# {note}")
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
        rows = _store(settings).events(kinds=["trip"], limit=LAST_TRIPS_READ) if settings.db_file.exists() else []
    except SparkdError:
        return None
    # the last trip that asked for a stop (critical): the trips after it with the model down ("nothing to stop",
    # warnings, one per cooldown) hid it (helper-44); none of those among the newest: the newest trip
    acted = [r for r in rows if r.get("severity") == "critical"] or rows
    return LastTrip(acted[0]["ts"], acted[0]["message"]) if acted else None


#: ``sparkd doctor``'s "Last trip": how many of the newest trips are read for the last one that asked for a stop.
LAST_TRIPS_READ = 200


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
            archives_dir=settings.archives_path,
            rules=settings.rules,
            kernlog_source=settings.kernlog_source,
            interval_s=settings.interval_s,
            # guard mode (sparkd.loop.daemon.make_actions): the container it names must exist
            guard_name=None if settings.monitor_only or settings.container.image else settings.container.guard,
            container_status=lambda name: doc.docker_container_status(name, settings.container.docker_url),
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
