"""The ``sparkd`` group and what its commands share: settings, the store, times and sizes for people."""

from __future__ import annotations

import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from sparkd import __version__
from sparkd.config import DEFAULT_CONFIG_PATH, BudgetSettings, Settings, load_settings
from sparkd.errors import SparkdError, StoreError
from sparkd.loop.status import Status
from sparkd.store.store import FALLBACK_S, READ_ERRORS, WRITE_EVERY_S, Store
from sparkd.units import parse_duration_s

CLOCK_SLACK_S = 2.0  # `sparkd status`: a record dated further ahead than this is from before a clock step back
# `sparkd status`: the daemon runs when its newest record (a sample, the snapshot) is younger than this (plus two
# sampling intervals): one quiet write's gathering (``store.WRITE_EVERY_S``; ``FALLBACK_S`` more when no sample comes)
# and a margin for the write itself
STALE_S = WRITE_EVERY_S + FALLBACK_S + 3.5


def _config_path(ctx: click.Context) -> Path | None:
    """The configuration file the command reads: ``--config``, else ``/etc/sparkd/sparkd.toml`` when it exists (as
    ``config.load_settings``), absolute; None: the embedded defaults."""
    given = ctx.ensure_object(dict).get("config")
    path = Path(given) if given else (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None)
    return path.resolve() if path else None


def _settings(ctx: click.Context, *, starting: bool = False, reading: bool = False) -> Settings:
    """The settings of ``--config`` (or the default file) with the command's overrides; exit 2 with the error when
    they do not load. ``starting`` (``sparkd run``): the refusal is also counted in the state directory
    (``store.refused``), for the next start to say how long nothing was guarded. ``reading`` (``status``,
    ``events``, ``samples``): a file that does not load is said, and the state directory it names (else the
    default) is read with default settings: `sparkd status` was refused exactly when the operator needed it, to see
    that the running sparkd's next start would be refused (helper-50)."""
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        try:
            obj["settings"] = load_settings(obj.get("config"), overrides=obj.get("overrides"))
        except SparkdError as e:
            click.echo(f"sparkd: {e.message}", err=True)
            if reading and (fallback := _reading_fallback(ctx)) is not None:
                obj["settings"] = fallback
                return fallback
            if starting:
                from sparkd.config import _default_state_dir
                from sparkd.loop.statelock import daemon_pid
                from sparkd.store import refused

                where = refused.state_dir_hint(_config_path(ctx), obj.get("overrides"), _default_state_dir())
                if daemon_pid(where) is None:  # a sparkd guards it meanwhile: this refusal left nothing unguarded
                    refused.record(where, e.message, time.time())
            ctx.exit(2)
    settings: Settings = obj["settings"]
    return settings


def _reading_fallback(ctx: click.Context) -> Settings | None:
    """Default settings on the state directory a configuration that does not load names (``store.refused``'s
    hint), said on stderr; None when even those do not load (a broken SPARKD_* variable)."""
    from sparkd.config import Settings, _default_state_dir
    from sparkd.store import refused

    obj = ctx.ensure_object(dict)
    where = refused.state_dir_hint(_config_path(ctx), obj.get("overrides"), _default_state_dir())
    try:
        settings = Settings(state_dir=str(where))
    except Exception:
        return None
    click.echo(
        f"sparkd: reading {where} with the default settings (the file above must be fixed: the next start of sparkd "
        "would be refused)",
        err=True,
    )
    return settings


def _store(settings: Settings, *, migrate: bool = False) -> Store:
    """The daemon's database for reading (no migration: the daemon owns the schema)."""
    if not migrate and not settings.db_file.exists():
        raise StoreError(
            f"no database at {settings.db_file} yet: start the daemon (sparkd run), or pass the "
            "--config / SPARKD_STATE_DIR it runs with"
        )
    return Store.open(settings.db_file, migrate=migrate)


def unreadable(settings: Settings, err: BaseException) -> StoreError:
    """The error of a reading command whose database cannot be read (disk full, corrupt, locked, a read-only
    directory), saying whether a sparkd runs with this state directory: `sparkd status` said only "cannot read the
    database" while the daemon guarded from memory, and `sparkd events` printed a traceback (helper-55)."""
    from sparkd.loop.statelock import daemon_pid

    why = (str(getattr(err, "orig", None) or getattr(err, "message", None) or err).splitlines() or ["?"])[0][:200]
    pid = daemon_pid(Path(settings.state_dir))
    if pid is not None:
        return StoreError(
            f"cannot read the database {settings.db_file}: {why}. sparkd runs (pid {pid}) and guards from memory, "
            f"recording nothing meanwhile: its live status is {api_base(settings)}/api/status (and the dashboard); "
            "see `sparkd doctor`"
        )
    return StoreError(
        f"cannot read the database {settings.db_file}: {why}. No sparkd runs with this state directory "
        f"({settings.state_dir}): see `sparkd doctor`"
    )


def _budget_in_effect(settings: Settings) -> tuple[BudgetSettings, dict[str, Any] | None]:
    """The budget settings the daemon launches with: the configuration's, or a resize's revision made on top of
    them (``Store.revision_in_effect``), with that revision (None: the configuration's; also when there is no
    database or it cannot be read). A resize does not rewrite the configuration file: without this, ``config show``
    and ``plan`` printed the file's values while the daemon ran on the resize's (note 11)."""
    if not settings.db_file.exists():
        return settings.budget, None
    try:
        rev = _store(settings).revision_in_effect(settings.budget.model_dump())
    except StoreError:
        return settings.budget, None
    except READ_ERRORS:
        return settings.budget, None
    if rev is None or rev["data"] == settings.budget.model_dump():
        return settings.budget, None
    return BudgetSettings(**rev["data"]), rev


def revision_note(settings: Settings, rev: dict[str, Any]) -> str:
    """One line: which revision's budget is in effect, by whom and when, and what differs from the file."""
    diff = [
        f"{k} {v!r} -> {rev['data'][k]!r}" for k, v in settings.budget.model_dump().items() if rev["data"].get(k) != v
    ]
    return (
        f"budget: revision {rev['id']} ({rev['reason']}, by {rev['who']} at {_ts(rev['ts'])} UTC) is in effect, "
        f"not the configuration file's: {', '.join(diff)}; it holds until the file's [budget] changes"
    )


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


def api_base(settings: Settings) -> str:
    """The running daemon's API as this host reaches it: ``http://HOST:PORT`` with ``api.host`` (a wildcard is
    reached on 127.0.0.1; an IPv6 address in brackets). ``status --cluster`` asked 127.0.0.1 whatever ``api.host``
    said, and read "is `sparkd run` running?" of a daemon on another address (helper-53)."""
    host = settings.api.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.api.port}"


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


def _age(s: float | None) -> str:
    return "never" if s is None else f"{s:.0f} s ago"


def _span(s: float) -> str:
    """A duration for people: ``42 s``, ``17 min``, ``5.2 h``, ``3.1 d``."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.1f} d"


def _since(text: str) -> float:
    try:
        return parse_duration_s(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from None


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"
