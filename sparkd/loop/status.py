"""The status contract: one typed ``Status`` the daemon returns and every reader consumes.

``Daemon.status_json()`` builds a ``Status``; ``GET /api/status`` declares it as its
``response_model`` (so ``/openapi.json`` documents every field); the dashboard's
presenters, the Prometheus exporter, ``sparkd status`` (from the snapshot the daemon
stores) and the test fakes read it typed. Closed choices come from one place each:
container states are ``sparkd.core.lifecycle.ContainerState``, rule kinds/actions,
KV cache dtypes, severities and modes are the ``Literal`` aliases of
``sparkd.core.choices``.

Every model forbids unknown keys, so a producer that drifts (a new key, a renamed
one, a state outside ``ContainerState``) fails with ``pydantic.ValidationError`` at
once, and a typed fake that drifts is a mypy error (pydantic models are
``dataclass_transform``s: mypy checks their keyword arguments).

Units: sizes are bytes (``*_bytes`` or the meminfo column names of ``SampleRow``),
times are UTC epoch seconds (``ts``, ``*_at``, ``*_t``) or seconds (``*_s``);
the budget plan keeps the formula's GiB floats (``*_gib``, CONTEXT.md "memory budget").

``DaemonView`` is what the face reads of the running daemon: the HTTP side is typed
against this Protocol, not the concrete ``Daemon`` (which satisfies it: ``sparkd run``
passes ``create_app`` as the daemon's ``app_factory``, and mypy checks that).

The resize result (``ResizeResult``, with its one diff shape ``PlanChange``) lives
here too: the supervisor returns it, ``POST /api/resize`` declares it, the dashboard
and ``sparkd resize`` read it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from sparkd.core.choices import ContainerMode, RuleAction, RuleKind, SamplingMode, Severity
from sparkd.core.lifecycle import DOWN_STATES, ContainerState
from sparkd.core.supervision import of_this_run

if TYPE_CHECKING:
    import asyncio

    from sparkd.config import Settings
    from sparkd.loop.guard import Guard
    from sparkd.loop.reads import Reads
    from sparkd.store.store import Store


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- the budget plan
class BudgetInputsFigures(_Model):
    """``sparkd.core.budget.BudgetInputs.to_json()``: the formula's inputs (bytes read, GiB knobs)."""

    mem_total_bytes: int
    max_model_len: int
    kv_bytes_per_token: int
    weight_bytes: int | None
    ple_bytes: int
    weights_gib: float | None
    overhead_gib: float
    mtp_enabled: bool
    mtp_gib: float
    mtp_off_credit_gib: float
    kv_target_gib: float
    host_reserve_gib: float
    kv_cache_dtype: str  # a KvCacheDtype from config; core also takes custom kv_mult_table keys
    kv_mult_table: dict[str, float]
    max_num_seqs: int
    max_num_batched_tokens: int
    gmu_override: float | None
    docker_headroom_gib: float
    model: str | None
    extra_vllm_args: list[str]
    kv_window_groups: list[list[int]] = []  # (window_tokens, bytes_per_token) of sliding-window layers
    state_bytes_per_seq: int = 0  # linear-attention/SSM state per sequence (fixed part × max_num_seqs)
    model_max_len: int | None = None  # the checkpoint's max_position_embeddings
    sources: dict[str, str] = {}  # input → flag | config file | resize | checkpoint config.json | measured | default
    explain: dict[str, str] = {}  # input → how it was derived


class PlanFigures(_Model):
    """``sparkd.core.budget.Plan.to_json()``: every figure of the budget formula, GiB floats unrounded
    (CONTEXT.md "The memory budget"), plus what the launch passes (``gmu``, ``docker_memory_bytes``)."""

    mem_total_gib: float
    checkpoint_gib: float | None
    ple_gib: float
    mtp_off_credit_applied_gib: float
    weights_gib: float
    overhead_gib: float
    mtp_gib: float
    fixed_gib: float
    kv_mult: float
    kv_need_gib: float
    kv_target_gib: float
    wish_gib: float
    cap_gib: float
    squeezed: bool
    gmu: float
    gmu_source: Literal["formula", "override"]
    budget_gib: float
    kv_exp_gib: float
    max_len_concurrency: float
    docker_memory_gib: float
    docker_memory_swap_gib: float
    docker_memory_bytes: int
    state_gib: float = 0.0  # linear-attention state × max_num_seqs, part of fixed
    inputs: BudgetInputsFigures
    provenance: dict[str, dict[str, str]] = {}  # input → {"source", "how"?}
    vllm_args: list[str]
    warnings: list[str]


# --------------------------------------------------------------------------- running unattended
class IntentStatus(_Model):
    """The stop intent (``core.supervision.StopIntent``): why the model is down; ``since`` epoch s."""

    intent: Literal["operator", "maintenance", "emergency", "exited", "failed_launch", "peer_emergency"]
    since: float
    who: str
    reason: str
    expired_alerted: bool = False


class BreakerStatus(_Model):
    """The circuit breaker: ``count`` emergencies inside ``window_s``; open at ``threshold``."""

    open: bool
    open_since: float | None = None
    count: int
    threshold: int
    window_s: float
    rearmed_by: str | None = None
    rearmed_at: float | None = None


class SupervisionStatus(_Model):
    """``loop.unattended.Unattended.status_json()``: intent, breaker, back-off counts, the scheduled
    relaunch (``{"at", "intent", "delay_s"}``), the last relaunch decision (``{"ts", "action", "delay_s",
    "intent", "reason"}``), the completion probe (``{"failures", "last"}``) and the last heartbeat."""

    intent: IntentStatus | None = None
    breaker: BreakerStatus
    backoff: dict[str, int]
    pending_relaunch: dict[str, Any] | None = None
    last_decision: dict[str, Any] | None = None
    probe: dict[str, Any]
    heartbeat_sent_at: float | None = None


# --------------------------------------------------------------------------- the container side
class UnguardedContainer(_Model):
    """A running container sparkd will not stop, so a stop rule cannot protect the host from it: one by the
    managed container's name that lacks sparkd's label (``docker run`` by hand after sparkd's own was removed),
    or (``labelled``) one with sparkd's labels running beside the run sparkd watches (a trip stops the watched
    one only). ``since``: epoch s when sparkd first saw it."""

    id: str
    name: str
    image: str | None = None
    since: float
    labelled: bool = False


class LastStopStatus(_Model):
    """The last stop this sparkd made (``RunBook._stop``: a rule's, an operator's, a restart's…) and what it left for
    a postmortem and for sparkd's next start; each failure was said only as a critical event (``archive_failed``,
    ``supervision_state_not_saved``), soon pushed down the events by others.

    ``archive``: its postmortem archive's file name once written (late too: ``archive_written_late``); until then
    ``archive_error`` says why not, one line: the write failed and is tried again, was given up on (lost), or the
    stop did not wait for it (``archive_delayed``); both null while the stop writes it. ``intent_saved``: the stop
    intent (and breaker) sparkd holds is on disk (``supervision.json``), so the model stays stopped across a restart
    of sparkd; false while it is not (``intent_error``: why; true again once a later save succeeds); null when no
    stop intent holds (a restart's or a resize's stop)."""

    at: float  # epoch s: when the stop began
    source: str  # who asked: "rule NAME", "api (…)", "peer:NAME", "daemon"…
    archive: str | None = None
    archive_error: str | None = None
    intent_saved: bool | None = None
    intent_error: str | None = None


class ContainerStatus(_Model):
    """The container side (``Actions.status_json()``): the supervisor's view, or monitor-only.

    ``state`` is one ``ContainerState`` (``none`` in monitor-only mode and before a launch;
    ``unknown`` while the Docker engine does not answer — ``engine`` then says ``down``).
    ``uptime_s`` is set only while running. ``busy`` is true while a control action
    (``action``: starting/stopping/restarting/resizing) holds the supervisor.
    """

    mode: ContainerMode
    state: ContainerState = ContainerState.NONE
    reason: str | None = None  # monitor-only: why there is no container side
    # monitor-only with a container configured (container.guard or container.image): its name, never stopped
    ignored: str | None = None
    name: str | None = None
    engine: Literal["unknown", "up", "down"] | None = None
    engine_error: str | None = None
    state_since: float | None = None
    state_reason: str | None = None
    health: str | None = None  # "ok" when ready, else the last /health error
    action: str | None = None
    container_id: str | None = None
    image: str | None = None
    launch_id: str | None = None
    started_at: float | None = None
    uptime_s: float | None = None
    ready_at: float | None = None
    # from the launch's start (container create) to /health ready, s: the ``ready`` event's figure
    time_to_ready_s: float | None = None
    trough_bytes: int | None = None  # lowest MemAvailable seen during start-up
    revision: int | None = None
    plan: PlanFigures | None = None
    gmu: float | None = None
    memory_bytes: int | None = None  # docker --memory (= --memory-swap)
    stay_stopped: bool = False  # down, and stays down until an operator starts it (``Supervisor._stays_stopped``)
    restarts_in_window: int = 0  # sparkd's auto-restarts and Docker's restarts seen, in container.restart_window_s
    restart_count: int = 0  # Docker's RestartCount as last inspected (its restart policy's restarts)
    restart_policy: str | None = None  # Docker's HostConfig.RestartPolicy.Name
    docker_restarts_seen: int = 0  # Docker restarts sparkd has counted since it began watching this container
    busy: bool = False
    stops_total: int = 0
    kills_total: int = 0
    last_stop: LastStopStatus | None = None  # the last stop sparkd made since it started: its archive, its intent saved
    supervision: SupervisionStatus | None = None  # managed or guard mode; None in monitor-only
    unguarded: UnguardedContainer | None = None  # managed mode: a same-name container sparkd will not stop
    # guard mode: since when no container by ``name`` exists (``docker ps -a`` lists none) and none is watched:
    # nothing is guarded (a typo in container.guard, compose's <project>-<service>-1 naming). None: found, or not asked
    guard_missing_since: float | None = None
    # with guard_missing_since: running containers that may be the model meant, "NAME (IMAGE)", best first
    # (``core.supervision.guard_candidates``: a name holding the guarded one, a close name, a vLLM image)
    guard_candidates: list[str] = []
    # the supervisor's first steps (the budget revision, how the last launch ended) failed, and are tried again: why.
    # Managed mode launches nothing at start meanwhile
    start_error: str | None = None
    # the supervisor's steps fail in a row (an engine that answers its ping and refuses `docker inspect`): why. The
    # state shown may be stale: exits, OOM kills and /health are not observed meanwhile
    watch_error: str | None = None

    def down_because(self) -> IntentStatus | None:
        """The stop intent that says why this run is down, or None: the model is down (stopped, exited, failed, or
        none) and the intent is not older than the run last seen (``started_at``). Guard mode never clears an
        intent, so a guarded model started by hand after its emergency stop showed that stop's intent while it ran,
        and again once it was stopped by hand (helper-36, helper-37). `sparkd status` and the dashboard read this."""
        intent = self.supervision.intent if self.supervision is not None else None
        if intent is None or not self._down():
            return None
        return intent if of_this_run(intent.since, self.started_at) else None

    def stop_of_this_run(self) -> LastStopStatus | None:
        """``last_stop`` when it says what ended this run: the model is down (stopped, exited, failed, or none) and
        the stop began after the run last seen started (not an earlier run's, the model started again since). The
        container card and `sparkd status` read it."""
        stop = self.last_stop
        if stop is None or not self._down():
            return None
        return stop if of_this_run(stop.at, self.started_at) else None

    def _down(self) -> bool:
        """The model is stopped, exited, failed, or there is none (not running, restarting or not known)."""
        return self.state in DOWN_STATES or self.state is ContainerState.NONE


# --------------------------------------------------------------------------- the guard
class SampleRow(_Model):
    """``sparkd.core.sample.Sample.to_row()``: one sample, sizes in bytes, PSI in percent.

    The fields are ``sparkd.core.sample.ROW_FIELDS`` (a test compares them).
    """

    ts: float
    mem_total: int | None = None
    mem_free: int | None = None
    mem_available: int | None = None
    buffers: int | None = None
    cached: int | None = None
    swap_total: int | None = None
    swap_free: int | None = None
    shmem: int | None = None
    anon_pages: int | None = None
    slab: int | None = None
    sreclaimable: int | None = None
    sunreclaim: int | None = None
    page_tables: int | None = None
    kernel_stack: int | None = None
    cma_total: int | None = None
    cma_free: int | None = None
    psi_some_avg10: float | None = None
    psi_some_avg60: float | None = None
    psi_some_total_us: int | None = None
    psi_full_avg10: float | None = None
    psi_full_avg60: float | None = None
    psi_full_total_us: int | None = None
    shm_bytes: int | None = None
    shm_entries: int | None = None
    driver_bytes: int | None = None
    nvrm_recent: int = 0
    low_watermark_bytes: int | None = None
    mem_available_minus_cma: int | None = None


class Threshold(_Model):
    """One compiled ``when`` condition: ``field op value`` (bytes when ``is_size``)."""

    field: str
    name: str
    op: Literal["<", "<=", ">", ">="]
    value: float
    is_size: bool


class NearestStopStatus(_Model):
    """``sparkd.core.headroom.NearestStop``: the nearest stop line now (the dashboard's headline).

    Sizes in bytes; ``headroom_bytes`` = ``value_bytes`` − ``threshold_bytes`` (negative: below it).
    ``fall_rate_bytes_per_s`` and ``time_to_floor_s`` are null when MemAvailable is not falling.
    """

    rule: str
    kind: RuleKind
    field: str
    label: str
    value_bytes: int
    threshold_bytes: int
    headroom_bytes: int
    counter: int
    samples: int
    fall_rate_bytes_per_s: float | None
    time_to_floor_s: float | None
    level: Literal["ok", "warn", "critical"]
    reason: str


class RuleStatus(_Model):
    """A rule as compiled (``Rule.to_json()``) with its counters (``RuleState.to_json()``)."""

    name: str
    kind: RuleKind
    action: RuleAction
    samples: int
    for_s: float | None
    when: list[str]
    evidence: list[str]
    thresholds: list[Threshold]
    floor_bytes: int | None
    duration_based: bool = False  # for_s set: trips after for_s seconds and at least ``samples`` samples
    within_s: float | None = None  # predictive: a fixed horizon, or None = the time a stop takes
    window_s: float | None = None  # predictive: the shortest fit window
    in_last_s: float | None = None  # for_s held in total within the last in_last_s seconds (None: consecutive)
    demoted: str | None = None  # why the loop guard demoted it to warn
    counter: int = 0
    held_s: float | None = None  # seconds the condition has held (first counted sample to the last); None at 0
    near_misses: int = 0
    trips: int = 0  # since sparkd started
    idle_trips: int = 0  # of those, trips with the model down as sparkd saw it: nothing to stop
    holds: bool = False  # its conditions (evidence, projection) held on the last sample, whatever its counter
    last_reason: str | None = None
    blind: str | None = None  # why the rule cannot evaluate (an input it needs was not read), else None


class KernelLogStatus(_Model):
    source: str  # kmsg | journal | dmesg | off
    nvrm_lines: int  # NV_ERR_NO_MEMORY lines seen since sparkd started
    lines_read: int = 0  # kernel-log lines read since sparkd started
    lost: int = 0  # records the ring buffer overwrote before sparkd read them (/dev/kmsg sequence gap)
    nvrm_bursts: int = 0  # nvrm_burst events (one per window at most)


class BlindStatus(_Model):
    """Inputs a rule needs that cannot be read (``{input: why; needed by …}``) and the rules
    that therefore cannot evaluate (``{rule: why}``) — never shown as a quiet 0/N."""

    sensors: dict[str, str] = {}
    rules: dict[str, str] = {}


class WriterStatus(_Model):
    queued: int
    written: int
    dropped: int
    refused: int = 0  # records the database refused for good (dropped with a record_refused event)
    last_error: str | None = None  # the last write error, one line; None while writes succeed


class DatabaseStatus(_Model):
    """``sparkd.store.keeper.DbKeeper.status()``: is the database recording, and if not, why."""

    state: Literal["opening", "ok", "unavailable"]
    path: str
    error: str | None
    since: float  # epoch s: when this state began
    attempts: int
    moved_aside: list[str]  # corrupt files kept as <name>.corrupt-<UTC time>
    # a write that has not returned for 15 s or more (a hung disk or mount): seconds; "ok" records nothing meanwhile
    write_hung_s: float | None = None


class HttpStatus(_Model):
    """The API's resource caps at work (``sparkd.loop.httpserver``)."""

    connection_cap: int  # open connections allowed (api.max_connections, below the descriptor limit)
    refused: int  # connections closed at once: over the cap
    head_timeouts: int  # connections closed for not sending a request head within api.header_timeout_s


class LeakStatus(_Model):
    """``sparkd.core.leak.LeakTracker.status()``: driver memory against its post-warm-up baseline."""

    state: str
    launch_id: str | None
    baseline_bytes: int | None
    baseline_late: bool
    current_bytes: int | None
    peak_bytes: int | None
    growth_bytes: int | None
    threshold_bytes: int
    window_s: tuple[float, float]
    elapsed_s: float | None
    alerts: int
    last_alert_t: float | None


class LoopRuleStatus(_Model):
    trips: int
    quick_streak: int
    cannot_protect: bool
    reason: str | None


class WatermarkStatus(_Model):
    """Kernel watermarks against the rules' floors (``sparkd.core.floors``)."""

    vm: dict[str, int | None]  # min_free_kbytes, watermark_scale_factor as read from /proc/sys/vm
    low_watermark_bytes: int | None
    healthy_mem_available_bytes: int | None
    healthy_t: float | None
    launch_t: float | None
    launches: int
    rules: dict[str, LoopRuleStatus]
    warnings: list[str]  # severity "warning": a rule that may loop, cannot protect this host, or fires late
    # severity "info": a warn rule's line this healthy host is already below, a floor under the kernel's watermark on
    # a MemAvailable figure (net of it already); `warnings` held these too, and `sparkd status` printed them as
    # "WATERMARK WARNING" while `sparkd doctor` said the rules were clear (helper-50). Absent in 0.1's snapshots.
    notes: list[str] = []


class NotifyStatus(_Model):
    """``sparkd.act.notify.NotifyStats.to_json()``: event notification counters since start."""

    submitted: int
    filtered: int
    suppressed: int
    dropped: int
    sent: int
    failed: int
    collapsed: int = 0  # identical alerts collapsed (one per supervision.alert_collapse_s)


class GpuStatus(_Model):
    """``sparkd.sense.gpu.GpuReading.to_json()`` (NVML; ``memory_supported`` false on GB10)."""

    index: int | None
    name: str | None = None
    driver_version: str | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_supported: bool | None = None
    available: bool = True
    reason: str | None = None
    notes: list[str] = []
    no_driver: bool = False  # /proc/driver/nvidia is absent: the driver-memory estimate is no driver memory here


class EventRow(_Model):
    ts: float
    kind: str
    severity: Severity
    message: str
    details: dict[str, Any] | None = None
    launch_id: str | None = None


class ConsumerProcess(_Model):
    """One of the top processes of a scan (``sparkd.core.consumers.ProcessMem``)."""

    pid: int
    name: str
    group: Literal["container", "host", "system"]
    rss_bytes: int
    uss_bytes: int | None


class ConsumerName(_Model):
    """Processes of one command name in one group."""

    name: str
    group: Literal["container", "host", "system"]
    count: int
    rss_bytes: int


class ConsumersStatus(_Model):
    """Who holds the memory (``sparkd.loop.consumers.ConsumerWatch.status()``): the last process scan.

    ``totals_bytes``: RSS per group (container, host, system); ``text``: the one-line summary;
    ``cotenant_limit_bytes``/``cotenant_excess_bytes``: the co-tenant warning's limit and how far
    host co-tenants are over it; ``last_trip``: the last trip's "who grew" sentence.
    """

    at: float
    text: str
    totals_bytes: dict[str, int]
    top: list[ConsumerProcess]
    by_name: list[ConsumerName]
    scanned: int
    cpu_s: float
    scans: int
    cotenant_limit_bytes: int
    cotenant_excess_bytes: int
    last_trip: str | None


class ReliefStatus(_Model):
    """Relief before stopping (``sparkd.loop.relief.ReliefRunner.status()``): ``disabled_reason`` set once a
    drop failed or hung (off for the rest of the run); ``reliefs``: drops done."""

    enabled: bool
    disabled_reason: str | None
    reliefs: int
    running: bool


class ConfigFileStatus(_Model):
    """The configuration file against what the daemon runs with (``loop.daemon_db.config_watch_loop``, a ``stat``
    every 30 s): sparkd never reloads, so an edit applies at the next start, and a file that no longer loads makes
    that start a refusal (nothing guarded). ``state``: ``as_started`` (loads, same settings), ``changed`` (loads;
    ``changed`` names the settings that differ, dotted), ``invalid`` (``error`` says why), ``missing``;
    ``since``: epoch s of the change seen."""

    path: str
    state: Literal["as_started", "changed", "invalid", "missing"] = "as_started"
    changed: list[str] = []
    error: str | None = None
    since: float | None = None


class Status(_Model):
    """``GET /api/status`` and ``Daemon.status_json()``: everything the daemon knows now.

    ``plan`` is the budget plan the container runs with (the container's ``plan``), or null.
    ``events`` are the 20 newest, newest first.
    """

    ts: float
    running: bool
    version: str
    pid: int
    started_at: float
    samples_taken: int
    interval_s: float
    mode: SamplingMode
    mode_reason: str | None
    dry_run: bool
    sample: SampleRow | None
    rules: list[RuleStatus]
    nearest_stop: NearestStopStatus | None = None
    kernel_log: KernelLogStatus
    blind: BlindStatus = BlindStatus()
    usable_bytes: int | None = None  # MemAvailable - CmaFree (MemAvailable without CMA): what the rules judge
    container: ContainerStatus
    writer: WriterStatus
    database: DatabaseStatus | None = None  # None only from fakes that predate it
    http: HttpStatus | None = None
    # why the API is not served (``api_unavailable``: its port held, a cluster.listen address not up), tried again
    # every api.retry_s; None when it is served or off. `sparkd status` says it (the dashboard cannot)
    api_error: str | None = None
    config_file: ConfigFileStatus | None = None  # None: no file (defaults and environment) or not watched
    tick_s_p50: float | None
    leak: LeakStatus
    watermark: WatermarkStatus
    notify: NotifyStatus | None
    gpu: list[GpuStatus]
    events: list[EventRow]
    plan: PlanFigures | None
    consumers: ConsumersStatus | None = None
    relief: ReliefStatus | None = None


# --------------------------------------------------------------------------- resize
Scalar = float | int | str | bool | None


class PlanChange(_Model):
    """One changed figure, keyed by its name in a diff: ``{"gmu": {"old": 0.786, "new": 0.77}}``
    (the one diff shape: plan diffs, revision diffs, the API, the dashboard and the CLI)."""

    old: Scalar
    new: Scalar


def diff_figures(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, PlanChange]:
    """The top-level scalar figures of ``new`` that differ from ``old``, in ``new``'s order.

    Nested values (``inputs``, ``vllm_args``, ``warnings``) are left out: the inputs that
    changed show in their own figures. Used for the plan diff and the revision diff alike.
    """
    old = old or {}
    return {
        k: PlanChange(old=old.get(k), new=v)
        for k, v in new.items()
        if not isinstance(v, dict | list | tuple) and old.get(k) != v
    }


class ResizeResult(_Model):
    """``POST /api/resize`` / ``Supervisor.resize``: the new plan beside the current one.

    ``applied`` is false on a dry run and when the new revision failed to launch; then
    ``rolled_back`` says whether the previous revision was restored (``rollback_ok``).
    """

    plan: PlanFigures
    previous: PlanFigures | None
    diff: dict[str, PlanChange]
    applied: bool
    dry_run: bool
    revision: int | None = None
    launch_id: str | None = None
    message: str | None = None
    rolled_back: bool = False
    error: str | None = None
    rollback_ok: bool | None = None
    rollback_error: str | None = None


# --------------------------------------------------------------------------- what the face reads
class DaemonView(Protocol):
    """The running daemon as the face sees it (``sparkd.loop.daemon.Daemon`` satisfies it).

    Read on the event loop only: ``status_json()`` and the counters are loop-owned state.
    ``actions`` is duck-typed by the face (``request``/``resize`` exist unless monitor-only).
    """

    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> Store | None: ...
    @property
    def reads(self) -> Reads: ...  # the database, or the live in-memory view when it cannot answer
    @property
    def actions(self) -> object: ...
    @property
    def guard(self) -> Guard | None: ...
    @property
    def samples_taken(self) -> int: ...
    @property
    def recent_events(self) -> Sequence[Mapping[str, Any]]: ...
    @property
    def ready(self) -> bool: ...
    @property
    def should_exit(self) -> asyncio.Event: ...
    @property
    def tick_durations(self) -> Iterable[float]: ...
    @property
    def cluster(self) -> Any: ...  # sparkd.loop.cluster.Cluster when [cluster] has peers, else None
    @property
    def state_keepers(self) -> list[Callable[[], Awaitable[str | None]]]: ...  # files written again when deleted

    def status_json(self) -> Status: ...
    def want_gpu(self) -> None: ...  # a reader is looking: GPU readings at gpu_interval_s (daemon_db.gpu_loop)
    def event(
        self,
        kind: str,
        message: str,
        *,
        severity: str = "info",
        details: dict[str, Any] | None = None,
        launch_id: str | None = None,
    ) -> dict[str, Any]: ...
