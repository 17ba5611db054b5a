"""The stop procedure — one implementation used by the rules, the API and the CLI.

1. event with the reason; 2. postmortem archive (tar.gz, atomic); 3. ``docker
stop`` with a 30 s grace (CONTEXT.md: a 10 s grace still ended in exit 137);
4. kill if the stop call fails or the container still runs — and at once if
MemAvailable falls below the hard floor during the grace; 5. confirm with
inspect (exit code, OOMKilled, step durations); 6. /dev/shm cleanup by
the container's own evidence (what its processes were seen using — while it ran
and right before the stop — or vLLM's own names created in its lifetime); 7.
event ``stopped`` with the durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sparkd.act import archive, shm
from sparkd.config import effective_config
from sparkd.errors import NotFound, Refused, one_line
from sparkd.units import fmt_gib

if TYPE_CHECKING:
    from sparkd.act.containerspec import ContainerState, StopResult


class Stopper(Protocol):
    """What the stop procedure asks of the container's keeper: ``act.docker.ContainerManager`` (the Docker
    engine), or ``act.procstop.ProcessStopper`` (the container's processes, when the engine does not answer).
    Each call blocks (run in a worker thread)."""

    def stop(self, id_or_name: str, timeout_s: float = 30.0) -> StopResult: ...

    def kill(self, id_or_name: str) -> object: ...

    def state(self, id_or_name: str) -> ContainerState: ...


class Supervisor(Protocol):
    """What the postmortem reads of its caller (``sparkd.loop.supervisor.Supervisor``).

    act never imports loop: the caller is handed in and only these members are used.
    """

    daemon: Any  # event(), writer, guard, store (the running daemon)
    settings: Any  # sparkd.config.Settings
    manager: Any  # sparkd.act.docker.ContainerManager
    name: str
    mode: str  # "managed" | "guard"
    image: str | None
    container_id: str | None
    container_started_at: float | None
    launch_id: str | None
    launch_started_at: float | None
    plan_json: dict[str, Any] | None


log = logging.getLogger("sparkd.stop")

KERNEL_KINDS = ("nvrm_no_memory", "nvrm_other", "oom_invoked", "oom_kill", "oom_killed")


@dataclass
class StopReport:
    reason: str
    source: str
    archive: str | None = None
    outcome: str | None = None
    exit_code: int | None = None
    oom_killed: bool | None = None
    hard_floor_kill: bool = False
    durations_s: dict[str, float] = field(default_factory=dict)
    shm_removed: list[str] = field(default_factory=list)
    shm_kept: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    killed: bool = False
    stopped_at: float | None = None  # Docker's FinishedAt after the stop (UTC epoch seconds)
    # Docker's state read after the stop says the container no longer runs. False: the stop, the kill or that
    # read failed (refused, or the engine hung: ``engine_hung``), and the model may still run
    confirmed: bool = False
    engine_hung: str | None = None  # why the engine's answers were not waited for any longer (None: it answered)
    refused: bool = False  # the engine refused the stop (not owned or guarded): never escalated to the processes

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(eq=False)
class ArchiveFate:
    """What became of one stop's postmortem archive, kept up to date after the stop: ``name`` once written (late
    too: ``archive_written_late``), else ``error``, why not (one line: a write that failed and is tried again, or
    was given up on). Both None while it is being written. The supervisor keeps the last stop's
    (``ContainerStatus.last_stop``): the stop event and ``archive_failed`` alone were soon pushed down the events."""

    name: str | None = None
    error: str | None = None
    #: called after each change (written, failed): the supervisor saves it (``supervision.json``'s ``last_stop``)
    on_change: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def written(self, name: str) -> None:
        self.name, self.error = name, None
        self._changed()

    def failed(self, why: str) -> None:
        self.name, self.error = None, why
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


@dataclass(frozen=True)
class ExitSeen:
    """An exit nobody of sparkd's asked for, as its postmortem tells it (``write_postmortem``'s ``exited``): Docker's
    ``exit_code`` and ``oom_killed`` (None: Docker gave none), the kernel log's OOM kill in this container
    (``kernel_oom``, "pid 4242 (python3)"; None: none seen), and ``auto_removed``: Docker removed the container at
    its exit (``docker run --rm``) before sparkd read it, and its log and ``docker inspect`` with it."""

    exit_code: int | None = None
    oom_killed: bool | None = None
    kernel_oom: str | None = None
    auto_removed: bool = False


#: why an archive of a container ``docker run --rm`` removed at its exit has no container.log and no inspect.json
REMOVED_WITH_IT = "Docker removed the container at its exit (docker run --rm), and this with it"


def exit_code_text(code: int | None) -> str:
    """``137`` → ``"137 (SIGKILL)"``: an exit code above 128 is 128 + the signal that ended the process (Docker's
    and the shell's rule); others as they are; None → ``"not known"``."""
    if code is None:
        return "not known"
    try:
        return f"{code} ({signal.Signals(code - 128).name})" if code > 128 else str(code)
    except ValueError:  # no such signal: a plain exit status
        return str(code)


def _exit_lines(exited: ExitSeen) -> list[str]:
    """The summary's lines on an exit: its code and Docker's OOMKilled, the kernel's OOM kill, a log gone with it."""
    gone = " (Docker removed the container before sparkd read it: docker run --rm)" if exited.auto_removed else ""
    unknown = f"not known{gone or ' (Docker gave none)'}"
    oom = unknown if exited.oom_killed is None else str(exited.oom_killed).lower()
    lines = [
        f"exit code:    {unknown if exited.exit_code is None else exit_code_text(exited.exit_code)}",
        f"OOMKilled:    {oom}",
    ]
    if exited.kernel_oom:
        lines.append(f"kernel OOM:   the kernel log shows an OOM kill of {exited.kernel_oom} in this container")
    if exited.auto_removed:
        lines.append(
            "container log: MISSING: Docker removed the container at its exit (docker run --rm), and its log with "
            "it; the samples, events and kernel lines here are what is left"
        )
    return lines


def _launch_text(sup: Supervisor) -> str:
    """The run's launch id, or why there is none ("None" in guard mode read as a value lost; helper-39)."""
    if sup.launch_id:
        return str(sup.launch_id)
    if sup.mode != "managed":
        return "none (guard mode: not launched by sparkd)"
    return "none (not launched by sparkd, or its launch record was lost)"


def _summary(
    sup: Supervisor, rep: StopReport, cid: str, inspect: dict[str, Any], exited: ExitSeen | None = None
) -> str:
    d = sup.daemon
    last = d.guard.last if d and d.guard else None
    lines = [
        "sparkd postmortem",
        "=================",
        f"time (UTC):   {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())}",
        f"reason:       {rep.reason}",
        f"requested by: {rep.source}",
    ]
    if inspect:
        lines += [
            f"container:    {inspect.get('Name', '').lstrip('/')} {cid[:12]}",
            f"image:        {inspect.get('Config', {}).get('Image')}",
            f"launch id:    {_launch_text(sup)}",
            f"started at:   {inspect.get('State', {}).get('StartedAt')}",
        ]
    else:  # no inspect (the engine did not answer): what sparkd last saw of the run
        started = sup.container_started_at
        lines += [
            f"container:    {sup.name} {cid[:12]} (as sparkd last saw it: no docker inspect)",
            f"image:        {sup.image or 'not known'}",
            f"launch id:    {_launch_text(sup)}",
            "started at:   " + (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)) if started else "not known"),
        ]
    if exited is not None:
        lines += _exit_lines(exited)
    if last is not None:
        # the default rules judge usable = MemAvailable − CmaFree (CONTEXT.md "CMA"): on a CMA host
        # MemAvailable alone would argue against the stop
        cma = f"   CmaFree: {fmt_gib(last.cma_free)}   usable: {fmt_gib(last.mem_available_minus_cma)}"
        # never a measured-looking 0 for lines that were not read
        kern = getattr(d, "kern_source_name", None) if d else None
        nvrm = "n/a (kernel log off)" if kern in (None, "off") else str(last.nvrm_recent)
        lines += [
            f"MemAvailable: {fmt_gib(last.mem_available)}   MemFree: {fmt_gib(last.mem_free)}"
            + (cma if last.cma_free else ""),
            f"page cache:   {fmt_gib(last.cached)}   anon: {fmt_gib(last.anon_pages)}   slab: {fmt_gib(last.slab)}",
            f"driver (est): {fmt_gib(last.driver_bytes)}   NVRM errors in window: {nvrm}",
        ]
    watch = getattr(d, "consumers", None) if d else None
    line = watch.summary_line() if watch is not None else None
    if line:
        lines.append(f"consumers:    {line}")
    if sup.plan_json:
        p = sup.plan_json
        lines.append(
            f"plan:         GMU {p.get('gmu')}  budget {p.get('budget_gib'):.2f} GiB  "
            f"--memory {p.get('docker_memory_gib'):.2f} GiB"
        )
    lines += [
        "",
        "files: container.log (since launch), sparkd.log, samples.csv (window before the trip, bytes),",
        "       kernel.log (NVRM/OOM lines since launch), inspect.json, config.json, plan.json, events.json,",
        "       consumers.json (who held the memory: the last process scans, the trip's fall shares)",
    ]
    return "\n".join(lines) + "\n"


def _redact_inspect(inspect: dict[str, Any]) -> dict[str, Any]:
    """``docker inspect`` without environment values (names kept): tokens live there."""
    from sparkd.config import REDACTED

    out = dict(inspect)
    cfg = dict(out.get("Config") or {})
    cfg["Env"] = [f"{e.split('=', 1)[0]}={REDACTED}" for e in cfg.get("Env") or []]
    out["Config"] = cfg
    return out


#: the archive before a stop waits this long for the database to take sparkd's last records (``Writer.written_until``)
DB_WAIT_S = 2.0
#: the container's log in the archive: its last lines since the launch (``docker logs --tail``), at most the last
#: ``LOG_TAIL_BYTES`` of them. The whole log since the launch (weeks) was read into sparkd's memory before the stop:
#: 300 MB of log took 24 s and 1 GB of sparkd's memory, in an emergency, at OOMScoreAdjust -1000.
LOG_TAIL_LINES = 20000
LOG_TAIL_BYTES = 16 * 2**20


def _from_memory(
    d: Any,
    missing: dict[str, str],
    rows: list[dict[str, Any]] | None,
    kern: list[dict[str, Any]] | None,
    events: list[dict[str, Any]] | None,
    samples_since: float,
    since: float,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """What the database returned (oldest first for samples, newest first for events), completed with the newer
    samples (``live_samples``) and events (``recent_events``) sparkd holds in memory."""
    rows = list(rows or [])
    newest_row = rows[-1]["ts"] if rows else float("-inf")
    rows += [x.to_row() for x in d.live_samples if x.ts > newest_row and x.ts >= samples_since]

    def newer(got: list[dict[str, Any]] | None, keep: Any) -> list[dict[str, Any]]:
        got = list(got or [])
        top = got[0]["ts"] if got else float("-inf")
        return [e for e in d.recent_events if e["ts"] > top and e["ts"] >= since and keep(e)] + got

    for name in ("samples.csv", "kernel.log", "events.json"):
        missing.pop(name, None)
    return rows, newer(kern, lambda e: e.get("kind") in KERNEL_KINDS), newer(events, lambda e: True)


async def _gather(
    missing: dict[str, str], part: str, what: str, fn: Any, *args: Any, wait_s: float | None = None, **kw: Any
) -> Any:
    """``fn(*args, **kw)`` in a thread; a failure is recorded under ``part`` (``what`` failed: …) → None. ``wait_s``:
    the call is waited on that long at most (an engine that hangs in it), then recorded as missing; it goes on in
    its thread, unheard."""
    try:
        if wait_s is None:
            return await asyncio.to_thread(fn, *args, **kw)
        done, result = await _within(wait_s, fn, *args, **kw)
        if not done:
            missing[part] = f"{what} did not answer within {wait_s:g} s (the stop went on)"
            log.warning("postmortem: %s missing (%s did not answer within %g s)", part, what, wait_s)
            return None
        return result
    except Exception as e:
        missing[part] = f"{what} failed: {e}"
        log.warning("postmortem: %s missing (%s failed: %s)", part, what, e)
        return None


async def write_postmortem(
    sup: Supervisor,
    rep: StopReport,
    cid: str,
    *,
    engine_error: str | None = None,
    fate: ArchiveFate | None = None,
    exited: ExitSeen | None = None,
) -> str | None:
    """Step 2. Returns the archive name, or None (the failure is recorded; the stop goes on).

    A partial postmortem beats none: each part is gathered on its own, and a
    part whose call fails (``docker logs`` or ``inspect`` while dockerd shuts
    down, a database read) becomes ``NAME.missing`` with the reason; the
    summary lists what is missing and ``rep.errors`` says so. Only a failure to
    write the archive file itself leaves no archive.

    ``engine_error``: what the Docker engine did instead of serving the stop ("the Docker engine does not answer
    (...)", "the Docker engine refuses (...)"): the stop is made by the container's processes.
    ``container.log`` and ``inspect.json`` are not asked of it (each call would wait out the API timeout,
    30 s, before the stop): they are missing with that reason, and the rest is written as usual.

    ``fate``: told what became of the archive (written, or why not), now and after its later tries.

    ``exited``: the archive tells an exit nobody asked for: the summary says its exit code and OOMKilled. A
    container Docker removed at its exit (``auto_removed``, ``docker run --rm``) has no log nor inspect to ask
    for: both are missing, said so (``REMOVED_WITH_IT``), and the rest is written as usual.
    """
    d = sup.daemon
    assert d is not None
    s = sup.settings
    now = time.time()
    missing: dict[str, str] = {}
    notes: list[str] = []
    # the records up to now in the database first (the stop's own "stopping" event makes the writer write at once);
    # a database locked, slow or gone is not waited on longer than DB_WAIT_S, and what it has not taken comes
    # from sparkd's memory below. A flush held the stop ~15 s behind a locked database, and dropped the records.
    newest_event = d.recent_events[0]["ts"] if d.recent_events else None  # newest first
    newest_sample = d.live_samples[-1].ts if d.live_samples else None  # oldest first
    newest = max((t for t in (newest_event, newest_sample) if t is not None), default=None)
    written = d.writer is None or newest is None or await d.writer.written_until(newest, DB_WAIT_S)
    since = sup.launch_started_at or (now - s.container.archive_window_s)
    # why the container's log and inspect are not asked of the engine: it did not answer, or has no such container
    unasked = f"{engine_error}: stopped by its processes" if engine_error else None
    if exited is not None and exited.auto_removed:
        unasked = REMOVED_WITH_IT
    if unasked is None:
        inspect = await _gather(
            missing, "inspect.json", "docker inspect", sup.manager.inspect, cid, wait_s=ENGINE_MARGIN_S
        )
        logs = await _gather(
            missing,
            "container.log",
            "docker logs",
            sup.manager.logs,
            cid,
            since,
            tail=LOG_TAIL_LINES,
            max_bytes=LOG_TAIL_BYTES,
            wait_s=ENGINE_MARGIN_S,
        )
    else:
        inspect = logs = None
        for name in ("inspect.json", "container.log"):
            missing[name] = unasked
    store = d.store
    rows = kern = events = None
    if store is None:
        for name in ("samples.csv", "kernel.log", "events.json"):
            missing[name] = "no database open"
    else:
        rows = await _gather(
            missing, "samples.csv", "reading samples", store.samples, since=now - s.container.archive_window_s
        )
        kern = await _gather(
            missing, "kernel.log", "reading kernel lines", store.events, since=since, kinds=KERNEL_KINDS, limit=10000
        )
        events = await _gather(missing, "events.json", "reading events", store.events, since=since, limit=500)
    if not written:
        rows, kern, events = _from_memory(d, missing, rows, kern, events, now - s.container.archive_window_s, since)
        notes.append(
            f"the database had not taken sparkd's last records within {DB_WAIT_S:g} s "
            f"({(d.writer.last_error if d.writer else None) or 'no database open'}): the newest samples, events "
            "and kernel lines come from sparkd's memory"
        )

    def part(name: str, value: Any, make: Any) -> archive.Part:
        return archive.Missing(missing[name]) if value is None else make(value)

    parts: dict[str, archive.Part] = {
        "container.log": part("container.log", logs, lambda v: v),
        "sparkd.log": s.logs_path / "sparkd.log",
        "samples.csv": part("samples.csv", rows, archive.samples_to_csv),
        "kernel.log": part(
            "kernel.log",
            kern,
            lambda v: "\n".join((e["details"] or {}).get("line", e["message"]) for e in reversed(v)) + "\n",
        ),
        "inspect.json": part("inspect.json", inspect, lambda v: json.dumps(_redact_inspect(v), indent=2, default=str)),
        "config.json": json.dumps(effective_config(s), indent=2),
        "plan.json": json.dumps(sup.plan_json, indent=2),
        "events.json": part("events.json", events, lambda v: json.dumps(list(reversed(v)), indent=2, default=str)),
    }
    watch = getattr(d, "consumers", None)
    if watch is not None:  # who holds the memory: the last scan, the trip's shares, the kept history
        try:
            pm = watch.postmortem()
            why = None if pm is not None else "no process scan finished before the stop"
        except Exception as e:
            pm, why = None, f"reading the process scans failed: {e}"
        if why is None:
            parts["consumers.json"] = json.dumps(pm, indent=2)
        else:
            parts["consumers.json"] = archive.Missing(why)
            missing["consumers.json"] = why
    summary = _summary(sup, rep, cid, inspect or {}, exited)
    summary += "".join(f"\nNOTE: {n}\n" for n in notes)
    if missing:
        summary += "\nMISSING (a partial postmortem beats none):\n" + "".join(
            f"  {name}: {why}\n" for name, why in missing.items()
        )
        rep.errors.append("archive partial: " + "; ".join(f"{n} missing ({why})" for n, why in missing.items()))
    name_hint = str((inspect or {}).get("Name") or sup.name or "vllm").lstrip("/")
    hint = f"{name_hint}-{rep.source}"
    try:
        info = await asyncio.to_thread(archive.write_archive, s.archives_path, hint, parts, summary)
    except Exception as e:
        rep.errors.append(f"archive failed: {e}")
        log.error("postmortem archive failed: %s", e)
        # lost for good and said only in the stop event's details (a full disk: ENOSPC, helper-45): said, held in
        # memory and tried again
        d.event(
            "archive_failed",
            f"the postmortem archive of the stop of {sup.name} is NOT written in {s.archives_path} ({one_line(e)}); "
            f"sparkd holds it in memory and tries again every {ARCHIVE_RETRY_S:g} s for "
            f"{ARCHIVE_RETRY_FOR_S / 60:g} min",
            severity="critical",
            details={"error": one_line(e), "archives_dir": str(s.archives_path)},
        )
        job = _LateArchive(d, s.archives_path, hint, parts, summary, sup.name, now, fate=fate or ArchiveFate())
        job.fate.failed(
            f"{one_line(e)} (in {s.archives_path}; held in memory, tried again every {ARCHIVE_RETRY_S:g} s for "
            f"{ARCHIVE_RETRY_FOR_S / 60:g} min)"
        )
        job.task = asyncio.ensure_future(_archive_later(job))
        _ARCHIVES_LATER.add(job)
        job.task.add_done_callback(lambda _t: _ARCHIVES_LATER.discard(job))
        return None
    if fate is not None:
        fate.written(info.name)
    return info.name


#: A postmortem archive that could not be written (a full disk): tried again every ``ARCHIVE_RETRY_S`` for
#: ``ARCHIVE_RETRY_FOR_S``, its parts held in memory meanwhile (each part is bounded by ``archive``'s
#: ``DEFAULT_MAX_PART_BYTES``), and once more when the daemon exits (``archives_last_try``).
ARCHIVE_RETRY_S = 30.0
ARCHIVE_RETRY_FOR_S = 3600.0
LAST_TRY_S = 5.0  # the exit's last try of a held archive


@dataclass(eq=False)
class _LateArchive:
    """One postmortem archive held in memory until it is written: where, what, and the stop it tells."""

    d: Any
    directory: Any
    hint: str
    parts: dict[str, Any]
    summary: str
    name: str
    stopped_at: float
    last: str = ""
    task: asyncio.Future[None] | None = None
    fate: ArchiveFate = field(default_factory=ArchiveFate)  # the stop's word on its archive, kept up to date

    async def attempt(self, within_s: float | None = None) -> bool:
        """One write (``within_s`` at most: the thread goes on, unheard); True once written (``archive_written_late``
        said). Named by the stop's time."""
        try:
            write = asyncio.to_thread(
                archive.write_archive, self.directory, self.hint, self.parts, self.summary, now=self.stopped_at
            )
            info = await asyncio.wait_for(write, within_s)
        except TimeoutError:
            self.last = f"the write did not end within {within_s:g} s (its storage hung?)"
            return False
        except Exception as e:
            self.last = one_line(e)
            return False
        self.fate.written(info.name)
        self.d.event(
            "archive_written_late", f"the postmortem archive of the stop of {self.name}: {info.name} (written late)"
        )
        return True

    def lost(self, why: str) -> None:
        self.fate.failed(f"lost: not written in {self.directory} {why} ({self.last})")
        self.d.event(
            "archive_failed",
            f"the postmortem archive of the stop of {self.name} is lost: not written in {self.directory} {why} "
            f"({self.last})",
            severity="critical",
            details={"error": self.last, "archives_dir": str(self.directory), "gave_up": True},
        )


_ARCHIVES_LATER: set[_LateArchive] = set()  # held: a task only the event loop references may be collected
# archives a stop did not wait for (``archive_delayed``), still being written: (task, emit, container name)
_ARCHIVES_DELAYED: set[tuple[asyncio.Future[str | None], Emit, str]] = set()


async def _archive_later(job: _LateArchive) -> None:
    """``write_postmortem``'s archive tried again until written (``archive_written_late``) or given up on (a second
    critical ``archive_failed``)."""
    deadline = time.monotonic() + ARCHIVE_RETRY_FOR_S
    while time.monotonic() < deadline:
        await asyncio.sleep(ARCHIVE_RETRY_S)
        if await job.attempt():
            return
    job.lost(f"within {ARCHIVE_RETRY_FOR_S / 60:g} min")


async def archives_last_try(d: Any) -> int:
    """At daemon ``d``'s exit: each archive it still holds is tried once more (its retries are cancelled), and one still
    not written is said lost (critical ``archive_failed``) rather than dropped with the process. Returns how many
    were lost. Never raises."""
    lost = 0
    # archives a stop did not wait for (``archive_delayed``) and still being written: LAST_TRY_S more, then said lost
    # (they were dropped with the process, unsaid: note 21). Every one in this process: their events go by their emit
    delayed = list(_ARCHIVES_DELAYED)
    if delayed:
        _done, pending = await asyncio.wait({t for t, _, _ in delayed}, timeout=LAST_TRY_S)
        for task, emit, name in delayed:
            if task in pending:
                emit(
                    "archive_failed",
                    f"the postmortem archive of the stop of {name} is lost: not finished before sparkd exited "
                    f"(its directory's storage slow or hung?)",
                    severity="critical",
                    details={"gave_up": True},
                )
                lost += 1
    for job in [j for j in _ARCHIVES_LATER if j.d is d]:
        if job.task is not None:
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        _ARCHIVES_LATER.discard(job)
        if not await job.attempt(LAST_TRY_S):  # a hung mount must not hold the exit (systemd kills it at 90 s)
            job.lost("before sparkd exited")
            lost += 1
    return lost


async def witness_before_stop(
    witness: shm.ShmWitness | None,
    docker: Stopper,
    cid: str,
    *,
    shm_dir: Any,
    proc_root: Any,
    rep: StopReport,
) -> shm.ShmWitness:
    """The container's /dev/shm evidence: what the supervisor saw while it ran (``witness`` when it is
    this container's), plus one scan of its processes now, before they stop. Never raises: without
    the scan the cleanup keeps every entry that only the witness could tie to the container."""
    w = witness
    if not isinstance(w, shm.ShmWitness) or w.container_id != cid:
        w = shm.ShmWitness(cid, shm_dir=shm_dir, proc_root=proc_root)
    try:
        st = await asyncio.to_thread(docker.state, cid)
        done, _ = await apart(WITNESS_WAIT_S, w.observe, st.pid)
        if not done:  # a /proc/PID/maps read waits (a process stuck in the driver): the SIGTERM does not
            rep.errors.append(
                f"/dev/shm witness before the stop: the scan of the container's processes did not end within "
                f"{WITNESS_WAIT_S:g} s (a /proc/PID/maps read blocked); the stop goes on without it"
            )
    except Exception as e:
        rep.errors.append(f"/dev/shm witness before the stop failed: {e}")
    return w


@dataclass(frozen=True)
class StopTarget:
    """The container to stop: its id and name, Docker's ``StartedAt`` of this run (UTC epoch seconds;
    the /dev/shm age test), and sparkd's launch id (None for a guarded container)."""

    container_id: str
    name: str
    started_at: float | None
    launch_id: str | None = None


#: ``cleanup_shm(container_started_at, container_stopped_at)`` (UTC epoch seconds)
CleanupShm = Callable[[float | None, float], shm.CleanupResult]


class Emit(Protocol):
    """Records one event (``loop.events`` through the supervisor, which adds the launch id)."""

    def __call__(
        self, kind: str, message: str, *, severity: str = "info", details: dict[str, Any] | None = None
    ) -> None: ...


async def _stop_and_confirm(
    target: StopTarget,
    docker: Stopper,
    rep: StopReport,
    grace_s: float,
    hard_floor_bytes: int,
    read_usable: Callable[[], int | None],
    emit: Emit,
    signalled: Callable[[], None] | None = None,
) -> None:
    """Steps 3–5: ``docker stop`` with the grace, killed at once below the hard floor, kill
    fallbacks, then the exit code and OOMKilled read back (``rep.confirmed``: it no longer runs).

    An engine that answers its ping but not the stop (containerd hung under dockerd: the stop, the
    kill and the inspect each waited out the API timeout, 245 s from trip to a stop by the processes)
    is given the grace plus ``ENGINE_MARGIN_S`` for the stop and ``ENGINE_MARGIN_S`` for a kill, then
    ``rep.engine_hung`` says so and no further call is made: the caller stops the processes."""
    cid = target.container_id
    deadline = time.monotonic() + grace_s + ENGINE_MARGIN_S
    stop_task = asyncio.create_task(asyncio.to_thread(docker.stop, cid, grace_s))
    stop_task.add_done_callback(unheard)  # a stop given up on still ends, unheard
    if signalled is not None:
        signalled()  # the task's first step (the thread's start) is ahead of anything the caller lets in now
    while not stop_task.done():
        done, _ = await asyncio.wait({stop_task}, timeout=0.25)
        if done:
            break
        if time.monotonic() > deadline:
            rep.engine_hung = f"docker stop did not return within {grace_s:g} s of grace + {ENGINE_MARGIN_S:g} s"
            rep.errors.append(rep.engine_hung)
            return
        avail = read_usable()
        if avail is not None and avail < hard_floor_bytes and not rep.hard_floor_kill:
            rep.hard_floor_kill = True
            emit(
                "hard_floor_kill",
                f"usable memory {fmt_gib(avail)} (MemAvailable − CmaFree) < hard floor {fmt_gib(hard_floor_bytes)} "
                f"during the grace period: killing {target.name} now",
                severity="critical",
            )
            try:  # a kill that fails here leaves the stop under way (it kills after the grace), never the daemon
                if not (await _within(ENGINE_MARGIN_S, docker.kill, cid))[0]:
                    rep.engine_hung = f"docker kill did not return within {ENGINE_MARGIN_S:g} s (hard floor)"
                    rep.errors.append(rep.engine_hung)
                    return
            except Exception as e:
                rep.errors.append(f"hard-floor kill failed: {e}")
    try:
        result = stop_task.result()
        rep.outcome = "killed (hard floor)" if rep.hard_floor_kill else result.outcome
        if result.fallback_kill:
            rep.outcome += " via kill fallback"
    except Exception as e:
        rep.errors.append(f"docker stop failed: {e}")
        rep.refused = isinstance(e, Refused)
        try:
            if not (await _within(ENGINE_MARGIN_S, docker.kill, cid))[0]:
                rep.engine_hung = f"docker kill did not return within {ENGINE_MARGIN_S:g} s"
                rep.errors.append(rep.engine_hung)
                return
            rep.outcome = "killed (stop failed)"
        except Exception as e2:
            rep.errors.append(f"kill failed: {e2}")
    try:
        # a kill returns when the signal is sent, not when a 100 GiB process has exited: its exit is waited for
        st = await _exited(docker, cid, ENGINE_MARGIN_S if "kill" in (rep.outcome or "") else 0.0)
        if st.running:  # still running after stop: kill (step 4)
            await asyncio.to_thread(docker.kill, cid)
            st = await _exited(docker, cid, ENGINE_MARGIN_S)
            rep.outcome = "killed (still running after stop)"
        rep.exit_code, rep.oom_killed, rep.stopped_at = st.exit_code, st.oom_killed, st.finished_at
        rep.confirmed = not st.running
    except NotFound as e:  # removed meanwhile (docker run --rm, docker rm -f): it runs no more
        rep.confirmed = True
        rep.outcome = rep.outcome or "removed"
        rep.errors.append(f"inspect: {e}")
    except Exception as e:
        rep.errors.append(f"inspect failed: {e}")


#: seconds an engine that answered its ping is given beyond a stop's grace (and for a kill) before it counts as hung
ENGINE_MARGIN_S = 10.0

#: the least SIGTERM time the processes get when a stop through Docker used up its grace first (s): a choice, a
#: chance for vLLM to exit on its own before SIGKILL, not a measured figure
FALLBACK_MIN_GRACE_S = 5.0


def fallback_grace_s(grace_s: float, spent_s: float) -> float:
    """The SIGTERM grace (s) of a stop made by the container's processes after ``spent_s`` seconds of a stop that
    went through Docker first (the engine hung in it, or did not answer its ping): what is left of ``grace_s``
    (``container.stop_timeout_s``), at least ``FALLBACK_MIN_GRACE_S`` (or ``grace_s`` when that is shorter).

    A stop counts its grace from when it began: an engine that hung in ``docker stop`` for the grace plus
    ``ENGINE_MARGIN_S`` and then a full second grace took the model to SIGKILL only after ~70 s at the default 30 s
    (note 10). Now at most grace + ``ENGINE_MARGIN_S`` + ``FALLBACK_MIN_GRACE_S``; the hard floor still kills at
    once. Raises ValueError for a negative grace or time spent."""
    if grace_s < 0 or spent_s < 0:
        raise ValueError(f"grace_s = {grace_s!r}, spent_s = {spent_s!r}: both must be >= 0 (seconds)")
    return max(min(grace_s, FALLBACK_MIN_GRACE_S), grace_s - spent_s)


async def _exited(docker: Stopper, cid: str, wait_s: float) -> Any:
    """Docker's state of ``cid``, read again every 0.2 s for up to ``wait_s`` while it still runs. Raises what
    ``docker.state`` raises (``NotFound``: removed)."""
    deadline = time.monotonic() + wait_s
    st = await asyncio.to_thread(docker.state, cid)
    while st.running and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        st = await asyncio.to_thread(docker.state, cid)
    return st


async def _within(wait_s: float, fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[bool, Any]:
    """``fn(*args, **kw)`` in a worker thread, waited on for ``wait_s``: (True, its result), or (False, None) when it
    did not return by then (it goes on in its thread, unheard). Raises what ``fn`` raised."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kw))
    task.add_done_callback(unheard)
    done, _ = await asyncio.wait({task}, timeout=wait_s)
    return (True, task.result()) if done else (False, None)


#: How long a stop waits for a scan of the container's processes (the /dev/shm witness before the SIGTERM), and for
#: the /dev/shm cleanup after the stop (s). Both read ``/proc/PID/maps``, which waits on that process's memory-map
#: lock: a process stuck in the driver, as one may be when a rule trips, held the read, and so the stop, for ever
#: (helper-43). Past it the stop goes on; the scan is left to its own thread.
WITNESS_WAIT_S = 2.0
SHM_CLEANUP_WAIT_S = 10.0


async def apart(wait_s: float | None, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    """``fn(*args)`` in a daemon thread of its own, waited on for ``wait_s`` (None: until it returns): (True, its
    result), or (False, None) when it had not returned by then (it goes on, unheard). Raises what ``fn`` raised.

    For reads of ``/proc/PID/maps`` (the /dev/shm witness and cleanup): a read that never returns would pin a worker
    of the event loop's shared pool (six on a 2-CPU host) for ever, and a few of them starve every Docker call."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting side
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop ended meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=f"sparkd-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    fut.add_done_callback(unheard)
    done, _ = await asyncio.wait({fut}, timeout=wait_s)
    return (True, fut.result()) if done else (False, None)


def unheard(fut: asyncio.Future[Any]) -> None:
    """Done callback of a call given up on (a hung engine): its late error is nobody's to hear, and asyncio does not
    log "exception was never retrieved" for it."""
    if not fut.cancelled():
        fut.exception()


async def _cleanup_shm(target: StopTarget, rep: StopReport, cleanup_shm: CleanupShm, emit: Emit) -> None:
    """Step 6: /dev/shm entries of this run that no live process holds."""
    try:
        done, res = await apart(SHM_CLEANUP_WAIT_S, cleanup_shm, target.started_at, rep.stopped_at or time.time())
        if not done:  # one process on the host whose /proc/PID/maps read blocks held the stop's end for ever
            why = (
                f"the /dev/shm cleanup did not end within {SHM_CLEANUP_WAIT_S:g} s (a /proc/PID/maps read blocked: "
                "a process stuck in the driver?); it goes on in the background, and removes only what its re-check "
                "still finds dead"
            )
            rep.errors.append(why)
            emit("shm_cleanup", why, severity="warning", details={"timed_out": True})
            return
        rep.shm_removed = [n for n, _b in res.removed]
        rep.shm_kept = [f"{k.name}: {k.reason}" for k in res.kept]
        if res.removed or res.kept:
            emit(
                "shm_cleanup",
                shm.format_result(res),
                details={"removed": rep.shm_removed, "kept": rep.shm_kept[:50]},
            )
    except Exception as e:
        rep.errors.append(f"/dev/shm cleanup failed: {e}")


#: the longest a stop waits for its archive before the SIGTERM (s): the container's log read (``ENGINE_MARGIN_S`` at
#: most), the database's newest records (``DB_WAIT_S``) and the writing; past it the stop goes on, the archive is
#: finished in the background. An archive directory on storage that hung (``fsfreeze``) held the stop until the thaw
#: (note 11). Below the hard floor the stop does not wait for it at all.
ARCHIVE_WAIT_S = 10.0
#: how ``StopReport.errors`` says the stop went on without its archive (``archive_delayed``), the reason after it
ARCHIVE_NOT_WAITED = "archive not waited for: "


def _archive_said(rep: StopReport) -> str:
    """The stop event's word on its archive: its name; "NOT written" when the write failed (``archive_failed``: it
    read "none", helper-45), "not written yet" when the stop did not wait for it (``archive_delayed``)."""
    if rep.archive:
        return rep.archive
    if any(e.startswith("archive failed") for e in rep.errors):
        return "NOT written (archive_failed: tried again)"
    if any(e.startswith(ARCHIVE_NOT_WAITED) for e in rep.errors):
        return "not written yet (archive_delayed)"
    return "none"


async def _archive_first(
    target: StopTarget,
    rep: StopReport,
    postmortem: Callable[[StopReport], Awaitable[str | None]],
    hard_floor_bytes: int,
    read_usable: Callable[[], int | None],
    emit: Emit,
) -> str | None:
    """The archive before the stop, waited for ``ARCHIVE_WAIT_S`` at most and not at all once usable memory
    (MemAvailable − CmaFree) is below the hard floor (read every 0.25 s); then a critical ``archive_delayed`` event,
    the stop goes on, and the archive is finished in the background (``archive_written_late`` names it). Returns
    its name, or None when not done."""
    task = asyncio.ensure_future(postmortem(rep))
    deadline = time.monotonic() + ARCHIVE_WAIT_S
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        avail = read_usable()
        if avail is not None and avail < hard_floor_bytes:
            why = (
                f"usable memory {fmt_gib(avail)} (MemAvailable − CmaFree) is below the hard floor "
                f"{fmt_gib(hard_floor_bytes)}"
            )
            break
        if time.monotonic() > deadline:
            why = f"the archive is not written within {ARCHIVE_WAIT_S:g} s (its directory's storage slow or hung?)"
            break
    emit(
        "archive_delayed",
        f"{target.name}: {why}: stopping now; the postmortem archive is finished in the background",
        severity="critical",
    )
    rep.errors.append(ARCHIVE_NOT_WAITED + why)

    def _late(t: asyncio.Future[str | None]) -> None:
        if t.cancelled() or t.exception() is not None:
            return
        name = t.result()
        if name:
            emit("archive_written_late", f"the postmortem archive of the stop of {target.name}: {name}")

    task.add_done_callback(_late)
    entry = (task, emit, target.name)
    _ARCHIVES_DELAYED.add(entry)
    task.add_done_callback(lambda _t: _ARCHIVES_DELAYED.discard(entry))
    return None


async def run_stop(
    target: StopTarget,
    docker: Stopper,
    *,
    reason: str,
    source: str,
    grace_s: float,
    hard_floor_bytes: int,
    read_usable: Callable[[], int | None],
    emit: Emit,
    postmortem: Callable[[StopReport], Awaitable[str | None]] | None,
    before_stop: Callable[[StopReport], Awaitable[None]] | None,
    cleanup_shm: CleanupShm | None,
    archive_after: bool = False,
    signalled: Callable[[], None] | None = None,
) -> StopReport:
    """Steps 1–7 for ``target``; everything it needs is handed in (act never imports loop).

    ``grace_s``: seconds between SIGTERM and SIGKILL (``container.stop_timeout_s``);
    ``hard_floor_bytes``: below this usable memory (``read_usable()``: MemAvailable − CmaFree, the stop lines'
    measure, ``core.sample.usable_bytes``; polled every 0.25 s during the grace) the container is killed at once;
    ``postmortem(report)`` writes the archive first and returns its name (None: no archive), or last with
    ``archive_after`` (a stop made by the container's processes while the engine hangs: its archive has nothing
    from the engine, and the archive's I/O under memory pressure must not delay the SIGTERM);
    ``before_stop(report)`` runs right before ``docker stop`` (the last /dev/shm witness scan of the running
    processes);
    ``cleanup_shm(started_at, stopped_at)`` removes the run's dead /dev/shm entries (None: skipped);
    ``signalled()`` is called once the stop is handed to its worker thread (the SIGTERM goes out next), also when
    a step before it failed (the caller's API reads again: ``loop.httpserver.ReadHold``).
    The caller holds the action lock and moves the lifecycle state. Errors of a step are collected
    in ``StopReport.errors``; nothing is raised for them.
    """
    cid = target.container_id
    rep = StopReport(reason, source)
    t0 = time.monotonic()
    emit(
        "stopping",
        f"stopping {target.name}: {reason}",
        severity="warning",
        details={"source": source, "container_id": cid},
    )
    if postmortem is not None and not archive_after:
        rep.archive = await _archive_first(target, rep, postmortem, hard_floor_bytes, read_usable, emit)
        rep.durations_s["archive"] = time.monotonic() - t0
    if before_stop is not None:
        await before_stop(rep)
    t1 = time.monotonic()
    await _stop_and_confirm(target, docker, rep, grace_s, hard_floor_bytes, read_usable, emit, signalled)
    rep.durations_s["stop"] = time.monotonic() - t1
    t2 = time.monotonic()
    if cleanup_shm is not None:
        await _cleanup_shm(target, rep, cleanup_shm, emit)
    rep.durations_s["shm_cleanup"] = time.monotonic() - t2
    if postmortem is not None and archive_after:
        t3 = time.monotonic()
        rep.archive = await postmortem(rep)
        rep.durations_s["archive"] = time.monotonic() - t3
    rep.durations_s["total"] = time.monotonic() - t0
    killed = rep.exit_code == 137 or rep.hard_floor_kill or "kill" in (rep.outcome or "")
    rep.killed = killed
    # without the engine's inspect (it did not answer; or the container stopped by its processes) the exit is unknown
    how = f"exit {rep.exit_code}, OOMKilled={rep.oom_killed}" if rep.exit_code is not None else "exit code not known"
    msg = (
        f"{target.name} {rep.outcome} ({how}) after "
        f"{rep.durations_s['stop']:.1f} s of {grace_s:g} s grace; total "
        f"{rep.durations_s['total']:.1f} s; archive {_archive_said(rep)}"
    )
    if killed and not rep.hard_floor_kill and rep.durations_s["stop"] >= grace_s - 1:
        msg += f"; killed: no exit within {grace_s:g} s of SIGTERM"
    if not rep.confirmed:  # never "stopped" on the word of calls that failed: the model may still run
        emit(
            "stop_unconfirmed",
            f"{target.name}: the stop is NOT confirmed, the model may still run ({'; '.join(rep.errors)[:600]}); "
            f"total {rep.durations_s['total']:.1f} s; archive {_archive_said(rep)}",
            severity="critical",
            details=rep.to_json(),
        )
        return rep
    emit(
        "killed" if killed else "stopped",
        msg,
        severity="critical" if killed else "warning",
        details=rep.to_json(),
    )
    return rep
