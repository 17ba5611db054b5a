"""The daemon's database keeper and retention: start without a usable database, reopen with back-off,
move a corrupt file aside, notice a deleted one; the retention pass. The guard never waits on any of it.

Functions over the running ``Daemon`` (its methods delegate here), so ``daemon.py`` keeps the
start-up, the main loop and the shutdown in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sparkd import __version__
from sparkd.config import effective_config
from sparkd.errors import SparkdError, one_line
from sparkd.logsetup import reopen_if_gone
from sparkd.loop.status import ConfigFileStatus
from sparkd.store.keeper import is_corrupt, is_full
from sparkd.store.store import FAILING_REPORT_S
from sparkd.store.supervision_state import write_atomic
from sparkd.units import parse_size

log = logging.getLogger("sparkd.loop.daemon")

if TYPE_CHECKING:
    from sparkd.loop.daemon import Daemon
    from sparkd.sense.gpu import GpuSampler
    from sparkd.store.store import Writer

#: ``<state_dir>/run_end.json``: a clean exit's end when the database could not take it at shutdown
RUN_END_FILE = "run_end.json"
DB_FIRST_WAIT_S = 1.0  # start-up waits this long for the database before the guard starts without it
DB_IDLE_CHECK_S = 60.0  # with the database ok the keeper sleeps until the writer calls (Writer.on_trouble)


async def begin_run(daemon: Daemon) -> bool:
    """Record this run in a just-opened store; False (store dropped, retried later) when the
    database refuses the first write (a write lock held by another process, a full disk)."""
    assert daemon.store is not None and daemon.writer is not None
    try:
        daemon.run_id = await asyncio.to_thread(
            daemon.store.start_run,
            pid=os.getpid(),
            version=__version__,
            hostname=socket.gethostname(),
            config=effective_config(daemon.settings),
        )
    except Exception as e:
        daemon.store = daemon.writer.store = None
        daemon.db.lost(one_line(e), daemon.mono(), at_once=False)
        return False
    if not daemon._unclean_checked:  # the first run row of this process: the one before is another process's
        daemon._unclean_checked = True
        with contextlib.suppress(Exception):  # a report about the past never holds up recording
            await report_unclean_end(daemon, daemon.run_id)
    return True


async def report_unclean_end(daemon: Daemon, run_id: int) -> None:
    """The run before ``run_id`` never recorded its end (``kill -9``, a power cut, a frozen host): a
    critical ``unclean_exit`` event with the time nobody guarded, from its last sample to this start;
    that run's end is then set to its last sample (exit reason ``unclean``), so it is said once."""
    store = daemon.store
    assert store is not None
    prev = await asyncio.to_thread(store.unclean_run, run_id)
    note_path = Path(daemon.settings.state_dir) / RUN_END_FILE
    note = _read_run_end_note(note_path)
    ours = note is not None and prev is not None and note.get("id") == prev["id"] and note.get("pid") == prev["pid"]
    if not ours:
        with contextlib.suppress(OSError):
            note_path.unlink(missing_ok=True)  # another run's (a database restored from a backup): not this one's
    if prev is None:
        return
    if note is not None and ours:
        # an exit whose database was locked or unusable at shutdown: not an unclean one (note 11)
        row = {"id": prev["id"], "stopped_at": float(note["stopped_at"]), "exit_reason": str(note["exit_reason"])}
        await asyncio.to_thread(store.write_batch, [("run_end", {**row, "samples": note.get("samples")})])
        note_path.unlink(missing_ok=True)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row["stopped_at"]))
        crashed = row["exit_reason"].startswith("crash")  # its critical daemon_crashed went with the database
        daemon.event(
            "run_end_recovered",
            f"the previous sparkd (pid {prev['pid']}) "
            + ("ended" if crashed else "stopped cleanly")
            + f" ({row['exit_reason']}) at {when} UTC while its database was unavailable: its end is recorded now, "
            f"from {note_path}",
            severity="critical" if crashed else "info",
            details={"run_id": prev["id"], "pid": prev["pid"], **row},
        )
        return
    last = prev["last_sample_ts"]
    end = last if last is not None else prev["started_at"]
    gap_s = max(0.0, time.time() - end)
    daemon.event(
        "unclean_exit",
        f"the previous sparkd (pid {prev['pid']}) did not stop cleanly (kill -9, a crash before its "
        f"shutdown, a power cut or a frozen host): nothing was guarded for {gap_s:.0f} s, from its last "
        f"sample at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(end))} UTC to this start",
        severity="critical",
        details={"run_id": prev["id"], "pid": prev["pid"], "last_sample_ts": last, "unguarded_s": round(gap_s, 1)},
    )
    end_row = {"id": prev["id"], "stopped_at": end, "exit_reason": "unclean"}
    await asyncio.to_thread(store.write_batch, [("run_end", end_row)])


def _read_run_end_note(path: Path) -> dict[str, Any] | None:
    """``run_end.json`` as written by ``note_run_end``, or None (absent, unreadable, another shape)."""
    try:
        d = json.loads(path.read_text())
        float(d["stopped_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return d if isinstance(d, dict) and "exit_reason" in d else None


def note_run_end(daemon: Daemon, end: dict[str, Any]) -> None:
    """A shutdown whose ``run_end`` row the database did not take (locked, down, lost; its run row written
    earlier): the row (``id``, ``stopped_at`` epoch s, ``exit_reason``, ``samples``) plus the pid, written
    atomically to ``<state_dir>/run_end.json``. The next start records it from there (``run_end_recovered``)
    instead of a critical ``unclean_exit`` that said nothing was guarded (note 11); a ``crash:`` reason stays
    critical there. Never raises: the state dir may be what failed (full: the note fails too), and then the next
    start's ``unclean_exit`` is the best that can be said."""
    path = Path(daemon.settings.state_dir) / RUN_END_FILE
    try:
        write_atomic(path, json.dumps({**end, "pid": os.getpid()}).encode())
    except OSError as e:
        log.error("the run's end was not written to the database nor to %s: %s", path, e)


def db_down_event(daemon: Daemon) -> None:
    nxt = max(0.0, daemon.db.next_attempt_mono - daemon.mono())
    daemon.event(
        "database_unavailable",
        f"database {daemon.db.path} unusable: {daemon.db.error}; guarding from memory (samples, rules and "
        f"stops go on, records wait in a bounded queue); retrying in {nxt:.0f} s with back-off",
        severity="critical",
        details=daemon.db.status(),
    )


async def db_loop(daemon: Daemon) -> None:
    """Watch the database without ever holding up the guard: a corrupt file (from the writer),
    a deleted or replaced file (inode), records refused for good; reopen with back-off."""
    try:
        daemon.store = await asyncio.to_thread(daemon.db.attempt, daemon.mono())
        if daemon.store is not None and daemon.writer is not None:
            daemon.writer.attach(daemon.store)
        if daemon.store is None or not await daemon._begin_run():
            daemon._db_down_event()
        if daemon.db.moved_aside:
            daemon.event(
                "database_corrupt",
                f"database {daemon.db.path} was corrupt: kept as {', '.join(daemon.db.moved_aside)}; "
                "a new database was created and recording goes on",
                severity="critical",
                details=daemon.db.status(),
            )
    finally:
        daemon._db_opened.set()
    while True:
        try:
            await daemon._db_step()
        except Exception as e:  # never let the keeper die: it is what brings recording back
            log.error("database keeper: %s", one_line(e))
        await keep_files(daemon)
        # no polling: the writer wakes the keeper (a corrupt file, a deleted or replaced file, a
        # refused record); while the database is down, the next attempt of the back-off does
        w = daemon.writer
        if w is not None and (w.fatal or w.lost or w.refusals):
            continue
        if daemon.db.state == "ok":
            delay = DB_IDLE_CHECK_S
        else:
            delay = min(max(daemon.db.next_attempt_mono - daemon.mono(), 0.05), DB_IDLE_CHECK_S)
        await daemon._db_alarm.sleep(delay)


async def keep_files(daemon: Daemon) -> None:
    """Write again the state files deleted while sparkd runs (``Daemon.state_keepers``: its log file, the
    API token, the supervision state), at each wake of the database keeper: within one write of the writer
    (``WRITE_EVERY_S``) after a deletion, which finds the database gone or a watched directory changed
    (``Writer.dirs_changed``) and wakes it; else within ``DB_IDLE_CHECK_S``.
    What was written is said in one ``state_files_restored`` warning; a file that cannot be written is
    logged once per distinct reason (the keeper tries again at its next wake)."""
    restored: list[str] = []
    for keep in daemon.state_keepers:
        try:
            what = await keep()
        except Exception as e:
            why = one_line(e)
            if why not in daemon._keep_errors_said:
                daemon._keep_errors_said.add(why)
                log.error("cannot write a deleted state file again: %s (tried again later)", why)
            continue
        if what is not None:
            restored.append(what)
    if restored:
        daemon.event(
            "state_files_restored",
            # "deleted" when a full disk had kept it from being written at all (helper-45)
            f"missing while sparkd ran (deleted, or never written: a full disk?), written again from memory: "
            f"{'; '.join(restored)}",
            severity="warning",
            details={"files": restored},
        )


async def keep_log_file() -> str | None:
    """``Daemon.state_keepers``: sparkd's log file opened again when it was deleted (``logsetup.reopen_if_gone``)."""
    path = await asyncio.to_thread(reopen_if_gone)
    return None if path is None else f"{path} (sparkd's log; the lines of the deleted file are lost)"


async def db_step(daemon: Daemon) -> None:
    w, now = daemon.writer, daemon.mono()
    if w is None:
        return
    while w.refusals:
        kind, refusal = w.refusals.pop(0)
        daemon.event(
            "record_refused",
            f"the database refused a {kind} record for good ({refusal}); dropped, later records go on",
            severity="warning",
            details={"kind": kind, "error": refusal},
        )
    if w.dropped > daemon._drops_said:  # the queue was full: records the rules saw are not recorded
        daemon.event(
            "records_dropped",
            f"the database writer's queue ({w.queue.maxsize}) is full: {w.dropped - daemon._drops_said} records "
            f"dropped after the rules saw them ({w.dropped} since start; database: "
            f"{w.last_error or daemon.db.error or 'slow'}); the guard goes on from memory",
            severity="critical",
            details={"dropped": w.dropped, "queue_max": w.queue.maxsize, "error": w.last_error},
        )
        daemon._drops_said = w.dropped
    if daemon.db.state == "ok":
        say_hung_write(daemon, w)
        failing_s = w.failing_for()
        why: str | None = w.fatal or w.lost  # the writer checks the file's inode after each write
        if why is None and failing_s >= FAILING_REPORT_S:  # locked elsewhere: errors that pass
            why = f"writes failing for {failing_s:.0f} s: {w.last_error}"
        elif why is None and failing_s > 0 and is_full(w.last_error):  # said at once: it does not pass in seconds
            why = f"writes failing: {w.last_error}"
        if why is None:
            return
        lost = w.lost is not None
        at_once = lost or w.fatal is not None  # recreate a deleted file, move a corrupt one aside; else back off
        safe_until = w.safe_until
        w.fatal, daemon.store = None, None
        w.attach(None)
        daemon.db.lost(why, now, at_once=at_once)
        if lost:
            # what went into the unlinked file since the last write found in place is written again, from memory
            for row in [r for r in daemon.live_samples if r.ts > safe_until]:
                w.submit("sample", row)
            # events as ``event_replayed``: the old connection's last checkpoint may have carried some of them
            # into the file after all (seen as every trip twice); those are not written again
            for ev in [e for e in reversed(daemon.recent_events) if e["ts"] > safe_until]:
                w.submit("event_replayed", dict(ev))
        daemon._db_down_event()
        return
    if now < daemon.db.next_attempt_mono:
        return
    was_error, moved = daemon.db.error, len(daemon.db.moved_aside)
    store = await asyncio.to_thread(daemon.db.attempt, now)
    if store is None:
        if daemon.db.error != was_error:  # said once per distinct reason, not once per attempt
            daemon._db_down_event()
        return
    daemon.store = store
    w.attach(store)
    if not await daemon._begin_run():
        daemon._db_down_event()
        return
    aside = daemon.db.moved_aside[moved:]
    daemon.event(
        "database_corrupt" if aside else "database_recovered",
        f"database {daemon.db.path} usable again; recording resumes"
        + (f" (corrupt file kept as {', '.join(aside)})" if aside else ""),
        severity="warning",
        details=daemon.db.status(),
    )


def say_hung_write(daemon: Daemon, w: Writer) -> None:
    """A write in the writer ``w``'s thread that has not returned for ``FAILING_REPORT_S`` (``Writer.write_hung_s``):
    said once, critical (``database_write_hung``: nothing is recorded meanwhile; the guard goes on from memory), and
    its return once no write runs (``database_write_returned``). ``Status.database.write_hung_s`` and
    ``sparkd_db_up`` say it meanwhile."""
    hung_s = w.write_hung_s()
    if hung_s is not None and not daemon._write_hung_said:
        daemon._write_hung_said = True
        daemon.event(
            "database_write_hung",
            f"a write to the database {daemon.db.path} has not returned for {hung_s:.0f} s (a hung disk or mount, an "
            "fsync stuck under memory pressure?): nothing is recorded meanwhile, records wait in the queue "
            f"({w.queue.maxsize} max); the guard goes on from memory",
            severity="critical",
            details={"hung_s": round(hung_s, 1), "path": str(daemon.db.path)},
        )
    elif daemon._write_hung_said and w.hung_for() == 0.0:
        daemon._write_hung_said = False
        failed = w.last_error if w.failing_for() > 0 else None
        daemon.event(
            "database_write_returned",
            "the database write that hung returned"
            + (f", failing ({failed}): records wait in the queue" if failed else "; recording goes on"),
            severity="warning" if failed else "info",
        )


async def retention_once(daemon: Daemon, now: float | None = None) -> dict[str, Any]:
    """Cap the archives (oldest first, never the newest) and remove temp files an unfinished write left, then
    prune and aggregate the store. The archives first, whatever the store's state: a full disk, the common reason
    the database is down, left the cap unenforced while every stop added a bundle (helper-53)."""
    from sparkd.act.archive import prune_archives, remove_stale_temps

    r = daemon.settings.retention
    gone = await asyncio.to_thread(
        prune_archives,
        daemon.settings.archives_path,
        max_count=r.archives_max_count,
        max_total_bytes=parse_size(r.archives_max_bytes),
    )
    if gone:
        daemon.event(
            "archives_pruned",
            f"removed {len(gone)} old archives (routine stops first, then incidents): {', '.join(gone[:5])}",
            details={"removed": gone},
        )
    temps = await asyncio.to_thread(remove_stale_temps, daemon.settings.archives_path)
    if temps:
        log.warning("removed %d temp file(s) an unfinished archive write left: %s", len(temps), ", ".join(temps[:5]))
    if daemon.store is None:
        return {"archives": len(gone), "archive_temps": len(temps)}
    removed = await asyncio.to_thread(
        daemon.store.prune,
        now=now or time.time(),
        raw_keep_s=r.raw_samples_s,
        minutes_keep_s=r.minute_aggregates_s,
        events_keep_s=r.events_s,
    )
    await asyncio.to_thread(daemon.store.vacuum)
    return {**removed, "archives": len(gone), "archive_temps": len(temps)}


#: How often the running daemon looks at its configuration file (a ``stat``; the file is read only when it changed).
CONFIG_CHECK_S = 30.0


def settings_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of the settings that differ between two ``model_dump(mode="json")`` of ``Settings``
    (``container.guard``, ``rules``: a list is one setting), in ``new``'s order, then those ``new`` lacks."""
    out: list[str] = []
    for k in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += settings_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


async def config_watch_loop(daemon: Daemon, path: Path) -> None:
    """The configuration file against what the daemon runs with (``daemon.config_file``, ``Status.config_file``;
    a ``stat`` every ``CONFIG_CHECK_S``, the file read only when it changed). sparkd never reloads:

    * edited into an error: said at once (``config_file_invalid``, a warning; once per distinct error), since the
      next start — a restart, an upgrade, a reboot — will be refused and leave the host unguarded under systemd's
      restart loop (helper-45); ``config_file_valid`` when it loads again;
    * edited validly: ``config_changed_not_applied`` (a warning naming the settings, once per distinct set): an
      operator who set ``dry_run = false`` to arm the guard saw it in ``sparkd config show`` while every trip stayed
      "would stop", with no word (helper-47); ``config_file_as_started`` when it matches again.

    What "runs" is ``daemon.config_baseline``, the file as ``sparkd run`` loaded it (without its command-line
    overrides such as ``--dry-run``, which are not edits); without it, the file as the watch first reads it.
    An edit made while the daemon started is therefore seen: the first look compares it with the baseline."""
    from sparkd.config import load_settings

    def look() -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def dump() -> dict[str, Any]:
        return load_settings(path).model_dump(mode="json")

    seen: tuple[int, int] | None = (-1, -1)  # the first look compares: an edit made during the start is one
    started = daemon.config_baseline
    if started is None:  # not handed in (a daemon made in-process): the file as it is now
        try:
            started = await asyncio.to_thread(dump)
        except Exception:  # edited into an error meanwhile: nothing to compare a later edit with but what runs
            started = daemon.settings.model_dump(mode="json")
    cfs = daemon.config_file = ConfigFileStatus(path=str(path))
    said: str | None = None
    said_changed: list[str] = []
    while not daemon.should_exit.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(daemon.should_exit.wait(), CONFIG_CHECK_S)
            return
        now = await asyncio.to_thread(look)
        if now == seen:
            continue
        seen = now
        changed: list[str] = []
        try:
            changed = settings_diff(started, await asyncio.to_thread(dump))
            problem = None
        except SparkdError as e:
            problem = e.message
        except Exception as e:  # never end the watch
            problem = one_line(e)
        state: Literal["as_started", "changed", "invalid", "missing"] = (
            "missing" if now is None else "invalid" if problem is not None else "changed" if changed else "as_started"
        )
        if state != cfs.state or changed != cfs.changed:
            cfs = daemon.config_file = ConfigFileStatus(
                path=str(path),
                state=state,
                changed=changed,
                error=problem,
                since=time.time(),
            )
        if problem is not None and problem != said:
            daemon.event(
                "config_file_invalid",
                f"the configuration file {path} no longer loads: {problem}. sparkd runs on with the configuration it "
                "started with; its next start (a restart, a reboot) will be refused and guard nothing until it is "
                "fixed",
                severity="warning",
                details={"path": str(path), "error": problem},
            )
        elif problem is None and said is not None:
            as_runs = "" if changed else ", as sparkd runs it"  # "restart to apply" here read against "matches"
            daemon.event(
                "config_file_valid", f"the configuration file {path} loads again{as_runs}", details={"path": str(path)}
            )
        if problem is None and changed and changed != said_changed:
            daemon.event(
                "config_changed_not_applied",
                f"the configuration file {path} changed: {', '.join(changed)}. Not applied: sparkd runs with the "
                "configuration it started with (it never reloads); restart sparkd to apply it (under systemd: "
                "systemctl restart sparkd)",
                severity="warning",
                details={"path": str(path), "changed": changed},
            )
        elif problem is None and not changed and said_changed and said is None:
            daemon.event(
                "config_file_as_started",
                f"the configuration file {path} matches what sparkd runs with again",
                details={"path": str(path)},
            )
        said = problem
        if problem is None:
            said_changed = changed


async def retention_loop(daemon: Daemon) -> None:
    # not during start-up (the riskiest phase of a launch is then, and the first minute of a daemon)
    await asyncio.sleep(min(60.0, daemon.settings.retention.interval_s))
    while True:
        try:
            await daemon.retention_once()
        except Exception as e:
            log.warning("retention failed: %s", e)
            if is_corrupt(e) and daemon.writer is not None and daemon.db.state == "ok":
                daemon.writer.fatal = one_line(e)  # the keeper moves a corrupt file aside, loudly
        await asyncio.sleep(daemon.settings.retention.interval_s)


async def gpu_loop(daemon: Daemon) -> None:
    """NVML readings from a helper process (``sparkd.sense.gpu_helper``: the driver's libraries, a call that
    blocks in the driver and a crash in it stay out of the guard), asked from a worker thread: every
    ``gpu_interval_s`` while someone reads the status (``daemon.gpu_wanted``, set by ``Daemon.want_gpu``: the
    dashboard, ``/api/status``, a peer Spark) or the guard samples fast (set on the switch), every
    ``gpu_quiet_interval_s`` otherwise. A ``final`` unavailable answer (no driver, no device) before any device
    has answered ends the loop and the helper with it; a helper that failed (killed for its silence, crashed)
    is asked again, and after a first answer so is a driver that went away (reloaded). The readings are context
    (the dashboard, the postmortem), never a stop trigger.

    Ended for want of a driver (``/proc/driver/nvidia`` absent: sparkd started before the ``nvidia`` module at
    boot, or a driver being reinstalled), the loop looks for that directory every ``gpu_quiet_interval_s`` (one
    ``stat``, no helper) and starts again when it appears: the readings ended for good until sparkd's restart."""
    from sparkd.sense import gpu_helper
    from sparkd.sense.gpu import GpuSampler

    s = daemon.settings
    while True:
        helper = gpu_helper.GpuHelper()
        sampler = GpuSampler(s.gpu_interval_s, reader=helper.read)
        try:
            no_driver = await _gpu_readings(daemon, sampler)
        finally:
            await asyncio.to_thread(helper.close)
        if not no_driver:
            return  # a driver without a device, or no NVML library: nothing will change that while sparkd runs
        while not gpu_helper.NVIDIA_DRIVER_PROC.exists():
            await asyncio.sleep(s.gpu_quiet_interval_s)
        log.info("the NVIDIA driver is loaded now (%s): reading the GPU again", gpu_helper.NVIDIA_DRIVER_PROC)


async def _gpu_readings(daemon: Daemon, sampler: GpuSampler) -> bool:
    """Read until a ``final`` unavailable answer before any device answered; returns whether it said no driver."""
    ever = False  # a device has answered once: a driver that goes away later is asked again
    while True:
        try:
            readings = await asyncio.to_thread(sampler.sample)
        except Exception as e:
            log.warning("GPU readings failed: %s", e)
            readings = []
        daemon.gpu = [r.to_json() for r in readings]
        ts = time.time()
        for r in readings:
            if r.available and daemon.writer:
                daemon.writer.submit(
                    "gpu",
                    {
                        "ts": ts,
                        "gpu_index": r.index,
                        "name": r.name,
                        "utilization_pct": r.utilization_pct,
                        "temperature_c": r.temperature_c,
                        "power_w": r.power_w,
                        "memory_total_bytes": r.memory_total_bytes,
                        "memory_used_bytes": r.memory_used_bytes,
                        "memory_supported": r.memory_supported,
                    },
                )
        ever = ever or any(r.available for r in readings)
        if readings and not ever and all(r.final for r in readings):
            # no NVML here (no driver, no device): asked until a final answer, which ends the helper too
            return all(r.no_driver for r in readings)
        daemon.gpu_read_at = daemon.mono()
        await _gpu_wait(daemon)


async def _gpu_wait(daemon: Daemon) -> None:
    """Until the next GPU reading is due: ``gpu_quiet_interval_s`` (``gpu_interval_s`` while the guard samples
    fast), or sooner when a reader asks (``gpu_wanted``), never sooner than ``gpu_interval_s`` after the last."""
    s = daemon.settings
    daemon.gpu_wanted.clear()
    with contextlib.suppress(TimeoutError):
        wait_s = s.gpu_interval_s if daemon.mode == "fast" else s.gpu_quiet_interval_s
        await asyncio.wait_for(daemon.gpu_wanted.wait(), wait_s)
    since = daemon.mono() - (daemon.gpu_read_at or 0.0)
    if since < s.gpu_interval_s:
        await asyncio.sleep(s.gpu_interval_s - since)
