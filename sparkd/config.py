"""Typed settings: one ``Settings`` object, validated once in ``main()`` and passed down.

Sources, highest precedence first: ``SPARKD_*`` environment variables (nested
with ``__``, e.g. ``SPARKD_API__PORT=9000``), the TOML file given with
``--config`` (default ``/etc/sparkd/sparkd.toml`` when it exists), then the
embedded defaults below. Nothing is built at import time.

Stop-rule defaults: CONTEXT.md "The watchdog" (seed rules) and the operators'
change log ("What the operators learned later") — see ``DEFAULT_RULES``.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from sparkd.core.choices import KvCacheDtype, RuleAction, RuleKind
from sparkd.core.conditions import parse_condition
from sparkd.errors import ConfigError
from sparkd.hostport import parse_host
from sparkd.units import parse_duration_s, parse_size

DEFAULT_CONFIG_PATH = Path("/etc/sparkd/sparkd.toml")


class RuleConfig(BaseModel):
    """One stop rule. ``when``: all must hold; ``evidence``: any must hold (empty = none needed).

    ``kind = "predictive"`` adds the usable-memory slope projection (``floor``,
    ``within_s``, ``window_s``) on top of ``when``; ``within_s`` unset = the time a stop
    takes (``container.stop_timeout_s``, or measured stops). ``for_s`` makes the rule
    duration-based: it trips after ``for_s`` seconds *and* at least ``samples`` samples
    (default 3); without it, after ``samples`` consecutive samples (default 5). ``in_last_s``
    (W, a duration rule only) counts ``for_s`` in total within the last W seconds, consecutive or
    not: a signal that flaps across the line at the sampling rate resets a consecutive counter at
    every good sample and is never stopped (helper-33: 0.5 ↔ 6.5 GiB for 30 samples).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,47}$")
    when: list[str] = Field(min_length=1)
    evidence: list[str] = Field(default_factory=list)
    samples: int | None = Field(default=None, ge=1, le=3600)
    for_s: float | None = Field(default=None, gt=0, le=3600)
    action: RuleAction = "stop"
    kind: RuleKind = "threshold"
    floor: str | None = None
    within_s: float | None = Field(default=None, gt=0, le=600)
    window_s: float = Field(default=3.0, gt=0, le=600)
    in_last_s: float | None = Field(default=None, gt=0, le=600)

    @field_validator("when", "evidence")
    @classmethod
    def _conds(cls, v: list[str]) -> list[str]:
        for c in v:
            parse_condition(c)
        return v

    @field_validator("floor")
    @classmethod
    def _floor(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size(v)
        return v

    @field_validator("for_s", mode="before")
    @classmethod
    def _for(cls, v: Any) -> Any:
        return None if v is None else parse_duration_s(v)

    @model_validator(mode="after")
    def _predictive(self) -> RuleConfig:
        if self.kind == "predictive" and self.floor is None:
            raise ValueError("a predictive rule needs 'floor' (e.g. floor = \"4GiB\")")
        if self.in_last_s is not None:
            if self.for_s is None or self.kind == "predictive":
                raise ValueError(
                    "in_last_s (for_s held in total within the last in_last_s seconds) needs for_s, and kind must "
                    'be "threshold"'
                )
            if self.for_s > self.in_last_s:
                raise ValueError(f"for_s ({self.for_s:g}) must be at most in_last_s ({self.in_last_s:g})")
        return self


# Seed rules, CONTEXT.md "The watchdog": "5 consecutive samples" at the seed's 1 s sampling,
# i.e. low water seen from the first sample to the fifth, 4 s apart. Written as a duration
# (for_s = 4 s, at least 3 samples) so that fast sampling (0.25 s) does not turn them into 1 s
# rules, which brought back the single-excursion false stops (issue 12, kind 7).
SEED_RULES: list[dict[str, Any]] = [
    {"name": "low_available", "when": ["MemAvailable < 6GiB"], "for_s": 4.0, "samples": 3},
    {
        "name": "low_available_and_free",
        "when": ["MemAvailable < 10GiB", "MemFree < 2GiB"],
        "for_s": 4.0,
        "samples": 3,
    },
]

# Defaults: the seed's rule 1; rule 2 gated on evidence (a MemFree sample counts only with
# usable < 10 GiB and NV_ERR_NO_MEMORY in the window or usable < 3 GiB) because ungated it
# stopped healthy servers during weight loading (MemFree 0.9 GiB at 32 GiB available) and a
# vision request (MemFree 1.2–1.5 GiB for 5 s at ~7 GiB available, no driver errors); the
# predictive rule closes the start-up gap (MemAvailable 29 → 6 GiB in ~6 s) and the slow fall
# (0.5 GiB/s to a hang at ~7 GiB): its horizon is the time a stop takes.
# All judge *usable* memory, MemAvailable − CmaFree: free CMA counts in MemAvailable but the
# driver's allocations cannot use it (a host died at MemAvailable 10.45 GiB with 8.81 GiB of it
# free CMA; field-2/homelab-kill7-cma.csv). Without CMA, usable = MemAvailable.
DEFAULT_RULES: list[dict[str, Any]] = [
    {"name": "low_available", "when": ["usable < 6GiB"], "for_s": 4.0, "samples": 3},
    {
        "name": "low_free_with_evidence",
        "when": ["MemFree < 2GiB", "usable < 10GiB"],
        "evidence": ["nvrm_recent > 0", "usable < 3GiB"],
        "for_s": 4.0,
        "samples": 3,
    },
    {
        "name": "collapse_projected",
        "kind": "predictive",
        "when": ["usable < 16GiB"],
        "floor": "4GiB",
        "window_s": 2.0,
        "for_s": 0.5,
        "samples": 2,
    },
    # usable memory below 3 GiB for 3 s in total within the last 10 s, consecutive or not. The rules above reset at
    # each good sample: usable flapping 0.5 ↔ 6.5 GiB at the sampling rate was never stopped (helper-33). 3 GiB is
    # the operators' own line for danger without other evidence (their MemFree rule counts below it with no driver
    # error) and container.hard_floor's default; 3 s in total keeps a short excursion from tripping it at any
    # sampling rate (one-sample rules stopped healthy servers), and a 1-in-3 duty cycle of dips still trips.
    {"name": "repeated_dips", "when": ["usable < 3GiB"], "for_s": 3.0, "in_last_s": 10.0, "samples": 3},
]


class ApiSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=8741, ge=0, le=65535)
    allow_remote: bool = False
    allowed_hosts: list[str] = Field(default_factory=lambda: ["127.0.0.1", "localhost", "[::1]"])
    # Resource caps of the HTTP side (issue 13): the guard keeps its descriptors and memory whatever
    # clients do. Control requests are a few hundred bytes; a browser's headers a few KiB.
    max_connections: int = Field(default=256, ge=1, le=65536)
    header_timeout_s: float = Field(default=10.0, gt=0, le=300)
    max_body_bytes: int = Field(default=65536, ge=1024, le=16 * 2**20)
    max_header_bytes: int = Field(default=16384, ge=4096, le=2**20)
    # An API that cannot be served at start (its port held, a cluster.listen address not up yet, the token file
    # not writable): the guard runs without it and tries again this often (s), never exits over it (helper-40).
    retry_s: float = Field(default=30.0, gt=0, le=3600)

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        bad = [h for h in v if parse_host(h) is None and parse_host(f"[{h}]") is None]
        if bad:
            raise ValueError(f'not a host[:port]: {", ".join(map(repr, bad))} (e.g. "127.0.0.1", "spark.lan:8741")')
        return v

    @model_validator(mode="after")
    def _loopback(self) -> ApiSettings:
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.allow_remote:
            raise ValueError(f"api.host = {self.host!r} is not loopback; set api.allow_remote = true to bind it")
        return self


class ContainerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    image: str | None = None
    name: str = "sparkd-vllm"
    guard: str | None = None  # a user-launched container to guard (not launched by sparkd)
    model_dir: str | None = None
    model_mount: str = "/models/model"
    served_model: str | None = None
    port: int = Field(default=8000, ge=1, le=65535)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    docker_url: str | None = None
    selector: dict[str, str] = Field(default_factory=dict)
    gpu: Literal["auto", "on", "off"] = "auto"
    memory: str | None = None  # used when no budget is configured
    init: bool = True  # docker run --init
    oom_score_adj: int = Field(default=500, ge=1, le=1000)  # docker run --oom-score-adj (positive: goes first)
    stop_timeout_s: float = Field(default=30.0, ge=1, le=600)
    shutdown_timeout_s: float = Field(default=25.0, ge=0, le=600)
    hard_floor: str = "3GiB"
    startup_timeout_s: float = Field(default=1800.0, ge=5, le=7200)
    health_interval_s: float = Field(default=2.0, ge=0.2, le=60)
    auto_restart: bool = False
    restart_cap: int = Field(default=2, ge=0, le=100)
    restart_window_s: float = Field(default=7200.0, ge=60)
    restart_cooldown_s: float = Field(default=30.0, ge=0)
    restart_backoff_cap_s: float = Field(default=900.0, ge=0)
    stable_uptime_s: float = Field(default=600.0, ge=0)
    max_failed_launches: int = Field(default=3, ge=1, le=100)
    stop_on_exit: bool = False  # stop the model when sparkd itself stops (default: keep serving)
    autostart: bool = True  # launch at sparkd start unless the last launch was stopped
    archive_window_s: float = Field(default=600.0, ge=10, le=86400)
    drain_timeout_s: float = Field(default=600.0, ge=0, le=7200)

    @field_validator("oom_score_adj", mode="before")
    @classmethod
    def _no_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"{v!r} is not an integer 1..1000")
        return v

    @field_validator("memory", "hard_floor")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None and parse_size(v) <= 0:
            raise ValueError(f'{v!r} must be a positive size (e.g. "100GiB")')
        return v


class BudgetSettings(BaseModel):
    """Inputs of the memory budget (CONTEXT.md "The memory budget"); GiB at this edge."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    weights_gib: float | None = Field(default=None, ge=0)
    ple_gib: float = Field(default=0.0, ge=0)
    overhead_gib: float = Field(default=5.60, ge=0)
    mtp: bool = False
    mtp_gib: float = Field(default=1.49, ge=0)
    mtp_off_credit_gib: float = Field(default=0.0, ge=0)
    kv_target_gib: float = Field(default=20.0, ge=0)
    host_reserve_gib: float = Field(default=28.0, ge=0)
    max_model_len: int = Field(default=262144, ge=1)
    kv_bytes_per_token: int | None = Field(default=None, ge=1)
    kv_cache_dtype: KvCacheDtype = "fp8"
    kv_fp8_mult: float | None = Field(default=None, gt=0, le=1)
    max_num_seqs: int = Field(default=4, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    gmu_override: float | None = Field(default=None, gt=0, le=1)
    docker_headroom_gib: float = Field(default=5.0, ge=0)
    preflight_margin_gib: float = Field(default=2.0, ge=0)
    apply_learned_reserve: bool = False  # raise host_reserve_gib to what past launches of this configuration needed


Severity = Literal["info", "warning", "error", "critical"]


class NotifySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kinds: list[str] = Field(
        default_factory=lambda: [
            "trip",
            "breaker_open",
            "breaker_alert",
            "launch_hold",
            "probe_congestion",
            "maintenance_expired",
            "smoke_failed",
            "heartbeat",
            "stopped",
            "killed",
            "stop_unconfirmed",  # it replaced a false "stopped": never quieter than what it replaced
            "stop_without_docker",
            "guarded_container_changed",
            "guard_target_missing",  # guard mode: no container by container.guard's name, nothing guarded
            "guard_target_found",
            "restart_policy_undoes_stop",  # guard mode, `--restart always`: a dockerd restart undoes sparkd's stop
            "config_file_invalid",  # the next start (a restart, a reboot) will be refused: nothing guarded then
            "config_changed_not_applied",  # an edit (dry_run = false to arm the guard) waits for a restart
            "archive_delayed",  # the state dir's storage slow or hung: the stop did not wait for its archive
            "supervision_state_slow",
            "supervision_state_not_saved",
            "nvrm_burst",
            "oom_kill",
            "leak_trend",
            "watermark",
            "rule_never_fires",
            "docker_down",
            "docker_up",
            "watch_recovered",  # after watch_failing (critical: sent by its severity)
        ]
    )
    #: sent whatever their kind: a critical event says the host may be unguarded (unguarded_container, guard_gap,
    #: sensor_blind, unclean_exit, database_unavailable, peer_unreachable, ...), and most were in no default kind
    severities: list[Severity] = Field(default_factory=lambda: list[Severity](["critical"]))
    command: list[str] = Field(default_factory=list)
    webhook_url: str | None = None
    timeout_s: float = Field(default=5.0, gt=0, le=120)
    retries: int = Field(default=2, ge=0, le=10)
    min_interval_s: float = Field(default=30.0, ge=0)


class SupervisionSettings(BaseModel):
    """Running unattended (issue 15; CONTEXT.md "What the operators learned later")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    breaker_threshold: int = Field(default=3, ge=1, le=100)
    breaker_window_s: float = Field(default=7200.0, gt=0)
    breaker_alert_every_s: float = Field(default=1800.0, gt=0)
    breaker_reset_on_boot: bool = False
    probe: bool = True
    probe_interval_s: float = Field(default=60.0, gt=0)
    probe_failures: int = Field(default=5, ge=1, le=100)
    probe_timeout_s: float = Field(default=30.0, gt=0, le=600)
    probe_max_tokens: int = Field(default=16, ge=1, le=4096)
    probe_adopt_grace_s: float = Field(default=300.0, ge=0)
    api_key: str | None = None
    maintenance_max_s: float = Field(default=7200.0, gt=0)
    maintenance_schedule: str | None = None
    maintenance_on_leak: bool = False
    drain_limit_s: float = Field(default=600.0, ge=0, le=7200)
    smoke_min_tok_s: float = Field(default=0.0, ge=0)
    heartbeat: bool = True
    heartbeat_interval_s: float = Field(default=86400.0, gt=0)
    alert_collapse_s: float = Field(default=900.0, ge=0)

    @field_validator("maintenance_schedule")
    @classmethod
    def _schedule(cls, v: str | None) -> str | None:
        if v is not None:
            from sparkd.core.supervision import parse_schedule

            parse_schedule(v)
        return v


class RetentionSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    raw_samples_s: float = Field(default=48 * 3600, ge=600)
    minute_aggregates_s: float = Field(default=30 * 86400, ge=3600)
    events_s: float = Field(default=365 * 86400, ge=86400)
    archives_max_count: int = Field(default=50, ge=1)
    archives_max_bytes: str = "5GiB"
    interval_s: float = Field(default=300.0, ge=1)

    @field_validator("raw_samples_s", "minute_aggregates_s", "events_s", "interval_s", mode="before")
    @classmethod
    def _dur(cls, v: Any) -> Any:
        return parse_duration_s(v)

    @field_validator("archives_max_bytes")
    @classmethod
    def _bytes(cls, v: str) -> str:
        parse_size(v)  # refuses negative and decimal (GB) sizes
        return v


class PeerSettings(BaseModel):
    """Another sparkd of the same cluster (the other Spark of a linked pair)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    url: str  # base URL on the link network, e.g. "http://192.168.100.2:8741"
    token_file: str  # the pair's shared secret: sent to the peer, and required of calls from it

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        u = urlsplit(v)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f'not a base URL: {v!r} (e.g. "http://192.168.100.2:8741")')
        return v.rstrip("/")


class ClusterSettings(BaseModel):
    """Two (or more) Sparks serving one model: each node a full guard, stops coordinated."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    node: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    role: Literal["head", "worker"] = "head"
    peers: list[PeerSettings] = Field(default_factory=list)
    listen: list[str] = Field(default_factory=list)  # extra API addresses (the link network) for peer calls
    peer_timeout_s: float = Field(default=3.0, gt=0, le=60)
    tls_ca_file: str | None = None  # verify https peers against this CA (default: the system's)
    worker_start_delay_s: float = Field(default=15.0, ge=0, le=600)

    @model_validator(mode="after")
    def _check(self) -> ClusterSettings:
        if self.peers and not self.node:
            raise ValueError("cluster.node: a name for this node is required when cluster.peers is set")
        names = [p.name for p in self.peers]
        if self.node in names:
            raise ValueError(f"cluster.peers: {self.node!r} is this node's own name")
        if len(set(names)) != len(names):
            raise ValueError("cluster.peers: peer names must be unique")
        return self


class ConsumersSettings(BaseModel):
    """Who holds the memory: the periodic process scan (``sparkd.sense.consumers``) and co-tenant warnings."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    interval_s: float = Field(default=10.0, ge=1, le=3600)  # while sampling fast (something moves)
    quiet_interval_s: float = Field(default=60.0, ge=1, le=3600)  # while sampling normally (issue 18: idle cost)
    quiet_change_gib: float = Field(default=0.5, ge=0)  # ... and only once MemAvailable moved this much
    store_every_s: float = Field(default=600.0, ge=1, le=86400)  # a scan row at least this often when stored
    store_change_gib: float = Field(default=1.0, ge=0)  # ... and whenever a group total moved this much
    top_n: int = Field(default=10, ge=1, le=100)
    uss_top: int = Field(default=0, ge=0, le=100)  # USS walks each process's page tables: off unless asked
    cotenant_limit: str | None = None  # a size ("12GiB"); unset: what the plan leaves the host minus the margin
    cotenant_margin_gib: float = Field(default=8.0, ge=0)
    cotenant_repeat_s: float = Field(default=600.0, ge=10)
    history: int = Field(default=30, ge=2, le=720)  # scans kept in memory for the "before the fall" scan

    @field_validator("cotenant_limit")
    @classmethod
    def _limit(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size(v)
        return v


class ReliefSettings(BaseModel):
    """Relief before stopping: drop clean page cache once while a MemFree rule counts (CONTEXT.md "Relief")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    min_reclaimable: str = "1GiB"
    min_interval_s: float = Field(default=60.0, ge=1)
    timeout_s: float = Field(default=10.0, gt=0, le=120)

    @field_validator("min_reclaimable")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)
        return v


def _default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/sparkd"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "sparkd")


class Settings(BaseSettings):
    """The effective configuration. Sizes are strings like ``"6GiB"`` at this edge."""

    model_config = SettingsConfigDict(
        env_prefix="SPARKD_", env_nested_delimiter="__", extra="forbid", validate_default=True, allow_inf_nan=False
    )

    state_dir: str = Field(default_factory=_default_state_dir)
    db_path: str | None = None  # default <state_dir>/sparkd.db
    log_dir: str | None = None  # default /var/log/sparkd as root, else <state_dir>/logs
    archive_dir: str | None = None  # default <state_dir>/archives
    proc_root: str = "/proc"
    shm_dir: str = "/dev/shm"

    interval_s: float = Field(default=1.0, ge=0.1, le=60)
    fast_interval_s: float = Field(default=0.25, ge=0.1, le=60)
    fast_margin: str = "4GiB"  # fast sampling when MemAvailable is within this of a floor
    fast_fall_rate: str = "512MiB"  # ... or falling faster than this per second
    fast_hold_s: float = Field(default=10.0, ge=0, le=3600)
    rules: list[RuleConfig] = Field(default_factory=lambda: [RuleConfig(**r) for r in DEFAULT_RULES])
    cooldown_s: float = Field(default=60.0, ge=0, le=86400)
    dry_run: bool = False
    monitor_only: bool = False  # sample and record only, explicitly (allows a rule set without a stop rule)
    recheck: bool = True

    kernlog_source: Literal["auto", "kmsg", "journal", "dmesg", "off"] = "auto"
    nvrm_window_s: float = Field(default=10.0, ge=1, le=600)
    nvrm_action: Literal["diagnostic", "stop"] = "diagnostic"
    nvrm_burst: int = Field(default=20, ge=1)

    leak_threshold: str = "4GiB"
    leak_warmup_start_s: float = Field(default=900.0, ge=0)
    leak_warmup_end_s: float = Field(default=1500.0, ge=0)
    leak_repeat_s: float = Field(default=86400.0, ge=60)

    shm_ignore_unreadable_pids: list[int] = Field(default_factory=list)
    queue_max: int = Field(default=10000, ge=10)
    gpu_interval_s: float = Field(default=5.0, ge=0.5)
    gpu_quiet_interval_s: float = Field(default=30.0, ge=0.5)

    api: ApiSettings = Field(default_factory=ApiSettings)
    container: ContainerSettings = Field(default_factory=ContainerSettings)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    notify: NotifySettings = Field(default_factory=NotifySettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    supervision: SupervisionSettings = Field(default_factory=SupervisionSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    consumers: ConsumersSettings = Field(default_factory=ConsumersSettings)
    relief: ReliefSettings = Field(default_factory=ReliefSettings)

    @field_validator("fast_margin", "fast_fall_rate", "leak_threshold")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)  # refuses negative and decimal (GB) sizes
        return v

    @model_validator(mode="after")
    def _check(self) -> Settings:
        names = [r.name for r in self.rules]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"rule names must be unique; duplicated: {', '.join(sorted(dup))}")
        if self.fast_interval_s > self.interval_s:
            raise ValueError("fast_interval_s must be <= interval_s")
        if self.gpu_quiet_interval_s < self.gpu_interval_s:
            raise ValueError(
                f"gpu_quiet_interval_s = {self.gpu_quiet_interval_s:g} must be >= gpu_interval_s = "
                f"{self.gpu_interval_s:g} (the quiet cadence is the slower one)"
            )
        if not any(r.action == "stop" for r in self.rules) and not self.dry_run and not self.monitor_only:
            if self.container.image is None and self.container.guard is None:  # "the container" read as one there was
                raise ValueError(
                    f'rules = {[r.name for r in self.rules]}: no stop rule (action = "stop") and no container '
                    "(container.image or container.guard): to watch this host without guarding a model, say so with "
                    "monitor_only = true; to guard one, add a stop rule and the container"
                )
            raise ValueError(
                f'rules = {[r.name for r in self.rules]}: no stop rule (action = "stop"), so nothing would ever '
                "stop the container; add one, or say so explicitly with dry_run = true or monitor_only = true"
            )
        if self.budget.enabled and self.container.memory is not None:
            raise ValueError(
                "container.memory and budget.enabled = true both set Docker --memory; the budget derives it "
                "(budget + docker_headroom_gib): remove container.memory or disable the budget"
            )
        return self

    # --- derived paths -------------------------------------------------
    @property
    def db_file(self) -> Path:
        return Path(self.db_path) if self.db_path else Path(self.state_dir) / "sparkd.db"

    @property
    def logs_path(self) -> Path:
        if self.log_dir:
            return Path(self.log_dir)
        # /var/log/sparkd only for the system daemon (root, the default state dir): a daemon with a
        # state dir of its own keeps its log beside it, so two daemons never share a log (or archive
        # each other's lines in a postmortem)
        if os.geteuid() == 0 and Path(self.state_dir) == Path("/var/lib/sparkd"):
            return Path("/var/log/sparkd")
        return Path(self.state_dir) / "logs"

    @property
    def archives_path(self) -> Path:
        return Path(self.archive_dir) if self.archive_dir else Path(self.state_dir) / "archives"

    @property
    def token_file(self) -> Path:
        return Path(self.state_dir) / "token"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # env beats the file: init kwargs carry the TOML data (see load_settings).
        return (env_settings, init_settings)


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        value = e.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {key} = {shown}: {msg}" if key else f"  {msg}")  # a check across keys names them itself
    return "\n".join(lines)


def load_settings(path: str | Path | None = None, *, overrides: dict[str, Any] | None = None) -> Settings:
    """Build and validate the settings.

    Args:
        path: TOML file; ``None`` uses ``/etc/sparkd/sparkd.toml`` when it exists,
            else the embedded defaults. An explicitly given path must exist.
        overrides: values applied over the file (tests, CLI flags); env still wins.

    Raises:
        ConfigError: unreadable file, bad TOML, or a value out of range — the message
            names the key, the value and what is allowed.
    """
    data: dict[str, Any] = {}
    source = "embedded defaults"
    if path is None and DEFAULT_CONFIG_PATH.exists():
        path = DEFAULT_CONFIG_PATH
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read: {e}") from None
    if overrides:
        data = {**data, **overrides}
    try:
        return Settings(**data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
    except SettingsError as e:  # an environment value that is not JSON where JSON is needed
        field = str(e).partition('field "')[2].partition('"')[0] or "?"
        env = f"SPARKD_{field.upper()}"
        shown = os.environ.get(env, "")
        raise ConfigError(
            f"{env} = {shown[:80]!r}: not valid JSON; {field} takes a JSON value from the environment "
            f'(e.g. {env}=\'[{{"name": "low_available", "when": ["MemAvailable < 6GiB"]}}]\')'
        ) from None


REDACTED = "<redacted>"


def effective_config(settings: Settings, *, redact: bool = True) -> dict[str, Any]:
    """The effective configuration as JSON-ready data, derived paths filled in.

    ``redact``: container environment values (tokens such as HF_TOKEN live there) and the
    webhook URL's query are replaced by ``<redacted>``; names stay visible.
    """
    d = settings.model_dump(mode="json")
    if redact:
        d["container"]["env"] = {k: REDACTED for k in d["container"]["env"]}
        if d["supervision"].get("api_key"):
            d["supervision"]["api_key"] = REDACTED
        url = d["notify"].get("webhook_url")
        if url and "?" in url:
            d["notify"]["webhook_url"] = url.split("?", 1)[0] + "?" + REDACTED
    d["db_path"] = str(settings.db_file)
    d["log_dir"] = str(settings.logs_path)
    d["archive_dir"] = str(settings.archives_path)
    return d


# One line of documentation per setting (tests check that none is missing).
FIELD_DOCS: dict[str, str] = {
    "state_dir": "SQLite store, API token and postmortem archives (/var/lib/sparkd as root).",
    "db_path": "SQLite file; default <state_dir>/sparkd.db.",
    "log_dir": (
        "sparkd's own rotated log; default /var/log/sparkd for the system daemon (root, state_dir "
        "/var/lib/sparkd), else <state_dir>/logs."
    ),
    "archive_dir": "Postmortem bundles (tar.gz); default <state_dir>/archives.",
    "proc_root": "Where /proc is read from (tests point it at fixture trees).",
    "shm_dir": "The host's POSIX shared memory directory (--ipc host puts the container's here).",
    "monitor_only": "Sample, evaluate and record only; never act on a container. Needed (or dry_run) for a rule "
    "set without a stop rule.",
    "interval_s": "Seconds between samples in normal mode (CONTEXT.md: about once a second). 0.1..60.",
    "fast_interval_s": "Seconds between samples in fast mode: start-up, a rule counting, near a floor. >= 0.1.",
    "fast_margin": "Sample fast while MemAvailable is within this of a rule's floor.",
    "fast_fall_rate": "Sample fast while MemAvailable falls faster than this per second.",
    "fast_hold_s": "Stay in fast mode this long after the last reason for it.",
    "rules": "Stop rules: name, when (all), evidence (any), samples or for_s, action stop|warn, kind.",
    "cooldown_s": "After a rule trips, further trips of that rule within this time are recorded, not acted on.",
    "dry_run": "Record what would have happened; never stop or kill anything.",
    "recheck": "Re-read memory just before acting; skip the stop if the condition no longer holds.",
    "kernlog_source": "Kernel log reader: auto (kmsg, then journal, then dmesg), kmsg, journal, dmesg, off.",
    "nvrm_window_s": "Window for counting NV_ERR_NO_MEMORY lines (nvrm_recent = this window + the previous).",
    "nvrm_action": "diagnostic (default: driver errors are evidence and events) or stop.",
    "nvrm_burst": "Driver-error lines within one window that raise an nvrm_burst event.",
    "leak_threshold": "Driver-memory growth over the post-warm-up baseline that raises leak_trend.",
    "leak_warmup_start_s": "Start of the baseline window after a launch (operators: 15 min).",
    "leak_warmup_end_s": "End of the baseline window after a launch (operators: 25 min).",
    "leak_repeat_s": "At most one leak_trend event per this many seconds (a day).",
    "shm_ignore_unreadable_pids": "PIDs whose /proc sparkd cannot read but that are known not to use "
    "/dev/shm (e.g. a sandbox's init). Any other unreadable PID blocks /dev/shm cleanup: no proof, no removal.",
    "queue_max": "Database writer queue length; beyond it records are dropped after the rules saw them.",
    "gpu_interval_s": "Seconds between NVML readings (utilization, temperature, power) while someone reads the "
    "status (the dashboard, /api/status, a peer Spark) or the guard samples fast.",
    "gpu_quiet_interval_s": "Seconds between NVML readings otherwise, >= gpu_interval_s (readings are context, "
    "never a stop trigger; /metrics shows the last one; each costs ~0.8 ms of CPU on an H200 host: bench/ab.py).",
    "api.enabled": "Serve the REST API and dashboard.",
    "api.host": "Listen address; anything but loopback needs api.allow_remote = true.",
    "api.port": "Listen port of the API and dashboard.",
    "api.allow_remote": "Allow binding beyond loopback (the API can stop containers: protect it).",
    "api.allowed_hosts": "Host header values accepted (DNS-rebinding protection).",
    "api.max_connections": "Open HTTP connections at most (also kept below the descriptor limit minus a reserve "
    "for the guard and the stop path); more are closed at once.",
    "api.header_timeout_s": "A connection that has not sent a complete request head within this time is closed "
    "(slow or idle clients: slowloris).",
    "api.max_body_bytes": "Largest request body; a larger one is refused (413) before it is read.",
    "api.max_header_bytes": "Largest request head (request line + headers); a larger one is refused (400).",
    "api.retry_s": "An API that cannot be served at start (its port held by another program, a cluster.listen "
    "address not up yet, a token file not writable): the guard runs without it, says so (api_unavailable) and "
    "tries again this often (s).",
    "container.image": "Image to launch (vLLM OpenAI server). Unset: monitor-only unless container.guard.",
    "container.name": "Name of the container sparkd launches.",
    "container.guard": "A container you launch yourself, guarded (stopped on a trip) but not launched.",
    "container.model_dir": "Host directory with the checkpoint, mounted read-only.",
    "container.model_mount": "Where the checkpoint appears inside the container.",
    "container.served_model": "Model argument passed to vLLM; default the model mount.",
    "container.port": "vLLM's port (host network): /health and /metrics are polled there.",
    "container.args": "Extra vLLM arguments (exec form, no shell).",
    "container.env": "Environment variables for the container.",
    "container.docker_url": "Docker engine URL; default from DOCKER_HOST or the local socket.",
    "container.selector": "Extra labels every launch carries and adoption filters on (one sparkd per engine "
    "by default; set this to run several).",
    "container.gpu": "Request GPUs: auto (when the engine has an nvidia runtime), on, off.",
    "container.memory": 'Docker --memory when the budget is disabled (e.g. "100GiB").',
    "container.init": "docker run --init: Docker's init as PID 1 reaps zombies and forwards signals (field: a "
    "zombie PID 1 made stop and kill time out).",
    "container.oom_score_adj": "docker run --oom-score-adj, 1..1000: the kernel OOM killer takes the serving "
    "container before sshd or sparkd (field: a homelab lost sshd first). At 500 a process at 0 needs over half "
    "of memory to go first.",
    "container.stop_timeout_s": "Graceful stop window before Docker kills (CONTEXT.md: 30 s; 10 s ended in exit 137).",
    "container.shutdown_timeout_s": "vLLM --shutdown-timeout: drain time inside the stop window.",
    "container.hard_floor": "During a stop (the archive first, then the grace period), kill at once if usable memory "
    "(MemAvailable − CmaFree, the stop lines' measure) falls below this.",
    "container.startup_timeout_s": (
        "A launch of sparkd's (managed mode) that is not /health-ready within this is failed (and rolled back); "
        "a run that was ready, or a guarded container, is never stopped for its /health."
    ),
    "container.health_interval_s": "Seconds between /health polls.",
    "container.auto_restart": "Relaunch after a stop (default: stay stopped until an operator acts).",
    "container.restart_cap": "At most this many automatic restarts per restart_window_s.",
    "container.restart_window_s": "Window for restart_cap.",
    "container.restart_cooldown_s": "Back-off base: the first automatic relaunch waits this long, each further "
    "consecutive one twice as long (30 s doubling, CONTEXT.md); the first launch is never delayed.",
    "container.restart_backoff_cap_s": "Back-off ceiling (15 min).",
    "container.stable_uptime_s": "A container up this long resets the back-off count.",
    "container.max_failed_launches": "After this many consecutive launches that never reached ready: hold and alert.",
    "container.autostart": "Launch when sparkd starts — unless the last launch was stopped (by a rule, an operator "
    "or a crash): then stay stopped until `sparkd start`.",
    "container.stop_on_exit": "Stop the model when sparkd itself stops (default: keep serving, adopt later).",
    "container.archive_window_s": "Seconds of samples before a trip that go into the postmortem archive.",
    "container.drain_timeout_s": "Resize: wait this long for running/waiting requests to reach 0.",
    "budget.enabled": "Derive GMU and Docker --memory from the budget formula (CONTEXT.md).",
    "budget.weights_gib": "GPU-resident weights after PLE; default: checkpoint size minus ple_gib.",
    "budget.ple_gib": "mmap'ed embedding tables (PLE) that stay in page cache, not GPU memory.",
    "budget.overhead_gib": "CUDA graphs, activations, workspaces (notes: 5.60).",
    "budget.mtp": "Multi-token prediction (speculative decoding) enabled.",
    "budget.mtp_gib": "Memory for MTP (notes: 1.49 GiB for 3 speculative tokens).",
    "budget.mtp_off_credit_gib": "Weights not loaded when MTP is off.",
    "budget.kv_target_gib": "KV cache wanted (notes: 20).",
    "budget.host_reserve_gib": "Left to the host (notes: 26 had to become 28).",
    "budget.max_model_len": "vLLM --max-model-len.",
    "budget.kv_bytes_per_token": "16-bit KV bytes per token; default: from the checkpoint's config.json "
    "(MHA/GQA, MLA, sliding-window, hybrid linear attention), refused if not recognised (notes' model: 29482).",
    "budget.kv_cache_dtype": "vLLM --kv-cache-dtype: auto, bf16, fp16 (KV_MULT 1.0) or fp8, fp8_e4m3, fp8_e5m2.",
    "budget.kv_fp8_mult": "KV_MULT for an fp8 KV cache; default 0.5 (whole KV in fp8), 0.58 for the notes' "
    "29482 B/token model whose side caches stay BF16.",
    "budget.max_num_seqs": "vLLM --max-num-seqs.",
    "budget.max_num_batched_tokens": "vLLM --max-num-batched-tokens.",
    "budget.gmu_override": "Explicit --gpu-memory-utilization instead of the formula's.",
    "budget.docker_headroom_gib": "Docker --memory = budget + this (notes: 5).",
    "budget.preflight_margin_gib": "Preflight: MemAvailable must exceed GMU x MemTotal by this (or by the "
    "start-up overshoot learned from past launches of the same configuration); also the learned reserve's margin.",
    "budget.apply_learned_reserve": "Raise host_reserve_gib to the reserve learned from past launches of the same "
    "configuration (their start-up troughs); shown with its evidence in `sparkd plan`.",
    "notify.kinds": "Event kinds that are sent out.",
    "notify.severities": "Event severities sent out whatever their kind (default: critical; [] sends by kind only).",
    "notify.command": "argv run for each event (no shell); fields in SPARKD_EVENT_* variables.",
    "notify.webhook_url": "URL that receives a JSON POST for each event.",
    "notify.timeout_s": "Timeout of one command run or webhook POST.",
    "notify.retries": "Webhook retries after a failure.",
    "notify.min_interval_s": "Rate limit: at most one notification per kind per this many seconds.",
    "supervision.breaker_threshold": "Emergency stops (rule, hard floor, probe) inside breaker_window_s that open "
    "the circuit breaker: no automatic relaunch until `sparkd rearm`.",
    "supervision.breaker_window_s": "Window of the breaker count (2 h).",
    "supervision.breaker_alert_every_s": "While the breaker is open, repeat its alert this often (30 min).",
    "supervision.breaker_reset_on_boot": "Re-arm the breaker when sparkd starts less than 5 min after host boot.",
    "supervision.probe": "Deep probe: a completion must return tokens (/health 200 with empty completions happens).",
    "supervision.probe_interval_s": "Seconds between completion probes (60).",
    "supervision.probe_failures": "Consecutive failed probes before acting (5): congestion alert if /health is 200, "
    "else an emergency stop.",
    "supervision.probe_timeout_s": "Timeout of one probe completion.",
    "supervision.probe_max_tokens": "Tokens asked of the probe completion (16, temperature 0).",
    "supervision.probe_adopt_grace_s": "No probe this long after adopting a running container.",
    "supervision.api_key": "Bearer key for the probe; default VLLM_API_KEY from container.env or --api-key in "
    "container.args.",
    "supervision.maintenance_max_s": "A maintenance stop intent expires with an alert after this long (2 h).",
    "supervision.maintenance_schedule": 'Scheduled drain-and-relaunch, local time, e.g. "Sun 04:00" or '
    '"daily 04:00"; unset: off.',
    "supervision.maintenance_on_leak": "Run the drain-and-relaunch when a leak_trend event is raised (driver memory "
    "that grew past leak_threshold since launch).",
    "supervision.drain_limit_s": "Maintenance drain: wait at most this long for vllm:num_requests_running = 0.",
    "supervision.smoke_min_tok_s": "Smoke test after a maintenance relaunch: decode tok/s of the probe must "
    "reach this.",
    "supervision.heartbeat": "Send a heartbeat event (notify kind 'heartbeat') even when all is fine.",
    "supervision.heartbeat_interval_s": "Heartbeat period (a day).",
    "supervision.alert_collapse_s": "Identical notifications (kind and message) collapse to one per this long.",
    "retention.raw_samples_s": "Keep raw samples this long (48 h).",
    "retention.minute_aggregates_s": "Keep per-minute min/avg/max this long (30 days).",
    "retention.events_s": "Keep events and launch records this long (a year).",
    "retention.archives_max_count": (
        "Keep at most this many archives: the oldest routine ones (operator stops, restarts, resizes) are "
        "removed first, an incident's postmortem (a stop rule, a peer, a failed launch) only when none is left; "
        "never the newest."
    ),
    "retention.archives_max_bytes": "Keep archives within this total size.",
    "retention.interval_s": "Run retention this often.",
    "cluster.node": "This node's name in a cluster of Sparks (required with peers).",
    "cluster.role": "head (serves the model's API and rank 0; launches last) or worker (headless; launches first).",
    "cluster.peers": "Other sparkd nodes: name, url (base URL on the link network), token_file (the pair's secret).",
    "cluster.listen": "Extra addresses the API also listens on for peer calls (the link network); loopback stays.",
    "cluster.peer_timeout_s": "Timeout of one call to a peer; a local stop never waits for it.",
    "cluster.tls_ca_file": "CA certificate to verify https peers (default: the system's store).",
    "cluster.worker_start_delay_s": "Coordinated launch: how long the head waits after the worker runs.",
    "consumers.enabled": "Scan processes for who holds the memory (container, host co-tenants, system services).",
    "consumers.interval_s": "Seconds between process scans while sampling fast (start-up, a rule counting, near a "
    "floor); one at every trip too. In a worker thread.",
    "consumers.quiet_interval_s": "Seconds between process scans while sampling normally (a scan costs ~10-40 ms "
    "of CPU; bench/consumers.py). Set it to interval_s for a fixed cadence.",
    "consumers.quiet_change_gib": "While sampling normally, a scan comes only once MemAvailable moved this many GiB "
    "since the last scan (and at least every store_every_s): a quiet host keeps its last scan. 0: every "
    "quiet_interval_s.",
    "consumers.store_every_s": "Store a scan this often (600 s), and every trip's scan; the rest stay in memory.",
    "consumers.store_change_gib": "Store a scan as soon as a group total (container, host, system) moved this many "
    "GiB since the last stored one (0: every scan).",
    "consumers.top_n": "Processes and command names kept per scan.",
    "consumers.uss_top": "How many of the top processes also get USS (smaps_rollup; costs a page-table walk).",
    "consumers.cotenant_limit": "Warn when host co-tenants hold more RSS than this; unset: MemTotal minus the "
    "plan's budget (or budget.host_reserve_gib without a plan) minus cotenant_margin_gib.",
    "consumers.cotenant_margin_gib": "Left for the kernel, page cache and the stop lines when the limit is derived.",
    "consumers.cotenant_repeat_s": "A co-tenant warning repeats at most this often while it lasts.",
    "relief.enabled": "Drop clean page cache once (root) while a MemFree-based rule counts, before it stops; "
    "never for MemAvailable-only rules. Off by default, as in the field.",
    "relief.min_reclaimable": "Only when Active(file)+Inactive(file)-Mapped-Dirty-Writeback is at least this.",
    "relief.min_interval_s": "At most one relief per this many seconds.",
    "relief.timeout_s": "A drop that takes longer counts as hung: relief is off for the rest of the run.",
    "consumers.history": "Scans kept in memory; a trip's fall shares compare with the one of highest MemAvailable.",
}


def setting_keys(model: type[BaseModel] = Settings, prefix: str = "") -> list[str]:
    """Every leaf setting as a dotted key (``api.port``); ``rules`` counts as one."""
    keys = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += setting_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys
