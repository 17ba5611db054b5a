"""Never unguarded (issue 13): a real ``sparkd run`` under each fault keeps sampling and still stops.

Each test starts the daemon (API on, a real socket) over a /proc tree the test owns, puts one fault
in place (a full file system, a corrupt or locked or deleted SQLite file, a flood of idle
connections, ...), then makes MemAvailable fall below the stop rule's floor. It checks

* samples went on at the configured interval during the fault (max gap ≤ 2 × interval, read from
  the daemon's own sample timestamps), and
* the stop decided during the fault was carried out (monitor-only: the ``stop_not_executed`` event,
  which is what this daemon does with a stop — as tests/test_daemon.py observes stops).

Faults (issue 13's numbering): 1 — header corrupt at start, state dir full at start (a 2 MiB tmpfs),
write lock held by another process at start; 2 — corrupted while running, deleted while running, a
record refused for good (in-process daemon, real SQLite file); 3 — 1,100 idle/slowloris connections
under ``ulimit -n 1024``; 4 — oversized bodies and heads; 5 — login back-off, no token in the URL;
6 — two Host headers, a lone surrogate in JSON; 7 — disarming configuration refused; 8 — wall clock
jumping both ways (in-process: the host's clock is shared); 9 — file modes under umask 022. Also: a
/dev/kmsg flood counted read or lost line for line.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import need
from sparkdproc import db_query, free_port, rewrite_in_place, sparkd_run, wait_for

from sparkd.store.store import WRITE_EVERY_S

INTERVAL_S = 0.2
HEALTHY = "MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n"
LOW = "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 2097152 kB\n"


class Guarded:
    """One daemon under test: its state dir, its /proc, its API."""

    def __init__(self, state: Path, proc: Path, port: int, proc_handle: subprocess.Popen[str]) -> None:
        self.state, self.proc, self.port, self.p = state, proc, port, proc_handle
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0)
        self.up_at = time.time()

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        return r.json()

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.get("/api/status")
        return result

    def events(self, kind: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/events", kind=kind, limit=50)["events"]
        return result

    def sample_times(self, since: float, until: float) -> list[float]:
        """Each sample's time, to 10 ms (one sample per 10 ms bucket at a 0.2 s interval)."""
        body = self.get("/api/samples", since=since, until=until, step=0.01, fields="mem_available")
        return [ts for ts, n in zip(body["ts"], body["n"], strict=True) if n]

    def stop_during(self, t0: float) -> dict[str, Any]:
        """Make memory low, wait for the rule's stop, make it healthy again; returns the stop event."""
        (self.proc / "meminfo").write_text(LOW)
        try:
            got = wait_for(lambda: [e for e in self.events("stop_not_executed") if e["ts"] >= t0], 10.0, 0.1)
        finally:
            (self.proc / "meminfo").write_text(HEALTHY)
        assert got, "no stop decided and carried out during the fault"
        ev: dict[str, Any] = got[0]
        assert "would stop: low_available: MemAvailable 2.00 GiB < 6.00 GiB" in ev["message"]
        return ev

    def assert_sampling(self, since: float, until: float | None = None) -> float:
        """Samples between ``since`` (not before the API was up) and ``until`` (default now): the
        largest gap, asserted ≤ 2 × the interval."""
        until = time.time() if until is None else until
        since = max(since, self.up_at)
        ts = self.sample_times(since, until)
        assert len(ts) >= (until - since) / INTERVAL_S * 0.7, (len(ts), until - since)
        gap = max(b - a for a, b in itertools.pairwise([since, *ts]))
        assert gap <= 2 * INTERVAL_S + 0.02, f"samples stopped for {gap:.2f} s during the fault"
        return gap


@contextlib.contextmanager
def guarded(
    tmp_path: Path, state: Path | None = None, extra: str = "", api: str = "", nofile: int | None = None
) -> Iterator[Guarded]:
    state = state or tmp_path / "state"
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text(HEALTHY)
    port = free_port()
    cfg = (
        f'interval_s = {INTERVAL_S}\nfast_interval_s = {INTERVAL_S}\nkernlog_source = "off"\nproc_root = "{proc}"\n'
        f"{extra}[api]\nport = {port}\n{api}"
        '[[rules]]\nname = "low_available"\nwhen = ["MemAvailable < 6GiB"]\nsamples = 2\n'
    )
    with sparkd_run(tmp_path, config=cfg, args=(), state_dir=state, nofile=nofile) as p:
        yield _started(state, proc, port, p)


def _started(state: Path, proc: Path, port: int, p: subprocess.Popen[str]) -> Guarded:
    g = Guarded(state, proc, port, p)

    def up() -> bool:
        if p.poll() is not None:
            raise AssertionError(f"sparkd exited {p.returncode}: {p.stdout.read() if p.stdout else ''}")
        with contextlib.suppress(httpx.HTTPError):
            return g.http.get("/healthz").status_code == 200
        return False

    assert wait_for(up, 20.0, 0.1), "the daemon did not come up"
    g.up_at = time.time()
    return g


def cli(g: Guarded, *args: str) -> subprocess.CompletedProcess[str]:
    return cli_run(g.state.parent / "sparkd.toml", *args)


def cli_run(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``sparkd --config CFG ARGS…`` as an operator runs it (no SPARKD_ variables of the test's environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_")}
    return subprocess.run(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(cfg), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# ---------------------------------------------------------------------------------------------- fault 1
def test_it_guards_when_the_database_header_is_corrupt_at_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "sparkd.db"
    good = sqlite3.connect(db)
    good.execute("CREATE TABLE t (x)")
    good.commit()
    good.close()
    with open(db, "r+b") as f:  # 100 random bytes over the header
        f.write(os.urandom(100))
    t0 = time.time()
    with guarded(tmp_path, state) as g:
        # the new file is made by a migration in a child process (store.upgrade_in_child): it may
        # come a moment after READY=1, while the guard already runs
        assert wait_for(lambda: g.status()["database"]["state"] == "ok", 15.0, 0.2)
        st = g.status()
        # the corrupt file was kept aside, never deleted, and recording goes on in a new one
        aside = list(state.glob("sparkd.db.corrupt-*"))
        assert [p.name for p in aside if not p.name.endswith(("-wal", "-shm"))], list(state.iterdir())
        assert st["database"]["state"] == "ok" and st["database"]["moved_aside"]
        # the event was queued before the new file existed: the writer stores it at its next write
        assert wait_for(lambda: g.events("database_corrupt"), 10.0, 0.2)
        g.stop_during(t0)
        g.assert_sampling(t0)
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 5, 20.0)


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of ``size`` at ``where`` (root only): a file system this test can fill."""
    need(os.geteuid() == 0, "mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path) -> Path:
    """Fill the file system at ``fs`` to the last byte; returns the filler file (remove it to free)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        for block in (65536, 4096, 512):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * block)
    return filler


def test_it_guards_with_the_state_dir_full_at_start_and_records_once_space_returns(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "state") as state:
        (state / "token").write_text("t" * 43 + "\n")  # written by `sparkd install` before the disk filled
        os.chmod(state / "token", 0o600)
        filler = fill(state)
        t0 = time.time()
        with guarded(tmp_path, state) as g:
            st = g.status()
            assert st["database"]["state"] == "unavailable"
            assert "full" in (st["database"]["error"] or "") or "disk" in (st["database"]["error"] or ""), st[
                "database"
            ]
            assert g.events("database_unavailable")  # from memory: the database cannot answer
            ev = g.stop_during(t0)
            assert ev["id"] is None  # served from the live in-memory view
            g.assert_sampling(t0)
            # `sparkd status` says it in one line, without a traceback
            out = cli(g, "status")
            assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
            assert "sparkd.db" in out.stderr and "Traceback" not in out.stderr
            doc = cli(g, "doctor")
            assert doc.returncode == 1 and "FAIL" in doc.stdout and "State dir space" in doc.stdout, doc.stdout
            filler.unlink()
            t1 = time.time()
            assert wait_for(lambda: g.status()["database"]["state"] == "ok", 20.0, 0.2), g.status()["database"]
            # recording resumed: samples after the recovery reach the file, and the stop event is there too
            assert wait_for(
                lambda: db_query(state / "sparkd.db", "SELECT count(*) FROM samples WHERE ts > ?", (t1,))[0][0] > 2,
                10.0,
            )
            assert wait_for(
                lambda: db_query(state / "sparkd.db", "SELECT count(*) FROM events WHERE kind='stop_not_executed'")[0][
                    0
                ],
                5.0,
            )
            g.assert_sampling(t0)


def test_a_state_dir_that_fills_while_running_is_said_at_once_not_15_s_later(tmp_path: Path) -> None:
    """A full disk does not pass in seconds as a backup's lock does: the first write that fails with it makes
    the keeper declare the database unavailable (it waited FAILING_REPORT_S, 15 s, with the status "ok")."""
    from sparkd.store.store import FAILING_REPORT_S

    with small_tmpfs(tmp_path / "state", "16m") as state, guarded(tmp_path, state) as g:
        db = state / "sparkd.db"
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 3, 25.0)
        filler = fill(state)
        t0 = time.time()
        assert wait_for(lambda: g.status()["database"]["state"] == "unavailable", WRITE_EVERY_S + 3.0, 0.2)
        took = time.time() - t0
        assert took < min(WRITE_EVERY_S + 3.0, FAILING_REPORT_S), took  # the next write, not 15 s of failures
        ev = g.events("database_unavailable")[0]
        assert "full" in ev["message"], ev["message"]
        filler.unlink()
        assert wait_for(lambda: g.status()["database"]["state"] == "ok", 20.0, 0.2), g.status()["database"]


def test_it_guards_while_another_process_holds_the_write_lock_at_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with guarded(tmp_path, state):  # a first run creates and migrates the database
        pass
    db = state / "sparkd.db"
    holder = sqlite3.connect(db, timeout=0.1, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        t0 = time.time()
        with guarded(tmp_path, state) as g:
            assert wait_for(lambda: g.status()["database"]["state"] == "unavailable", 10.0, 0.2)
            assert "locked" in g.status()["database"]["error"]
            g.stop_during(t0)
            g.assert_sampling(t0)
            holder.execute("ROLLBACK")
            t1 = time.time()
            assert wait_for(lambda: g.status()["database"]["state"] == "ok", 20.0, 0.2), g.status()["database"]
            assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples WHERE ts > ?", (t1,))[0][0] > 2, 25.0)
            # what was sampled while locked waited in the queue and is recorded now
            assert db_query(db, "SELECT count(*) FROM samples WHERE ts BETWEEN ? AND ?", (t0 + 1, t1))[0][0] > 3
    finally:
        holder.close()


def test_a_clean_stop_with_the_database_locked_is_recorded_at_the_next_start_not_called_unclean(
    tmp_path: Path,
) -> None:
    """SIGTERM while another process holds the database's write lock: the run's end cannot be written, and the
    next start said critically that the previous sparkd "did not stop cleanly: nothing was guarded for N s"
    (note 11). The end goes to ``<state_dir>/run_end.json`` instead, and the next start records it from there."""
    state = tmp_path / "state"
    db = state / "sparkd.db"
    with guarded(tmp_path, state) as g:
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 3, 25.0)
        holder = sqlite3.connect(db, timeout=0.1, isolation_level=None)
        try:
            holder.execute("BEGIN EXCLUSIVE")
            t_term = time.time()
            g.p.terminate()
            out, _ = g.p.communicate(timeout=60)
            assert g.p.returncode == 0 and "Traceback" not in out, out[-2000:]
        finally:
            holder.execute("ROLLBACK")
            holder.close()
    first_run, first_stopped = db_query(db, "SELECT id, stopped_at FROM daemon_runs ORDER BY id")[0]
    assert first_stopped is None  # the database did not take it
    assert (state / "run_end.json").exists()
    with guarded(tmp_path, state) as g2:
        ev = wait_for(lambda: g2.events("run_end_recovered"), 20.0, 0.2)
        assert ev and f"pid {g.p.pid}" in ev[0]["message"] and "stopped cleanly (SIGTERM)" in ev[0]["message"], ev
        assert ev[0]["severity"] == "info"
        stopped_at, reason = db_query(db, "SELECT stopped_at, exit_reason FROM daemon_runs WHERE id = ?", (first_run,))[
            0
        ]
        assert reason == "SIGTERM" and t_term <= stopped_at <= time.time(), (stopped_at, reason)
        assert g2.events("unclean_exit") == []
        assert not (state / "run_end.json").exists()  # taken: said once


@pytest.mark.parametrize("fault", ["write lock", "disk full"])
def test_writes_failing_while_running_are_said_and_recording_resumes(tmp_path: Path, fault: str) -> None:
    """A write lock taken by another process, or the state directory filling up, while sparkd runs: after
    store.FAILING_REPORT_S of failed writes the database reads unavailable (a critical event, /api/status)
    and recording resumes once the fault passes, with what was sampled meanwhile (it read "ok" throughout,
    with one log line, while the queue filled)."""
    from sparkd.store.store import FAILING_REPORT_S

    with contextlib.ExitStack() as stack:
        state = (
            stack.enter_context(small_tmpfs(tmp_path / "state", "8m")) if fault == "disk full" else tmp_path / "state"
        )
        db = state / "sparkd.db"
        g = stack.enter_context(guarded(tmp_path, state))
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 3, 25.0)
        t0 = time.time()
        if fault == "write lock":
            holder = sqlite3.connect(db, timeout=0.1, isolation_level=None)
            stack.callback(holder.close)
            holder.execute("BEGIN EXCLUSIVE")
            release = lambda: holder.execute("ROLLBACK")  # noqa: E731
        else:
            release = fill(state).unlink
        down = wait_for(lambda: g.status()["database"]["state"] != "ok", FAILING_REPORT_S + 25.0, 0.5)
        assert down, g.status()["database"]
        st = g.status()["database"]
        assert "writes failing" in (st["error"] or ""), st
        ev = [e for e in g.events("database_unavailable") if "writes failing" in e["message"]]
        assert ev and ev[0]["severity"] == "critical", g.events("database_unavailable")
        g.assert_sampling(t0)  # the guard went on meanwhile
        release()
        t1 = time.time()
        assert wait_for(lambda: g.status()["database"]["state"] == "ok", 30.0, 0.5), g.status()["database"]
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples WHERE ts > ?", (t1,))[0][0] > 2, 25.0)
        # what was sampled while the writes failed waited in the queue and is recorded now
        assert db_query(db, "SELECT count(*) FROM samples WHERE ts BETWEEN ? AND ?", (t0 + 2, t1 - 2))[0][0] > 5
        assert wait_for(lambda: g.events("database_recovered"), 10.0, 0.5)


# ---------------------------------------------------------------------------------------------- fault 2
def test_it_keeps_guarding_when_the_database_is_corrupted_while_running(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with guarded(tmp_path, state) as g:
        db = state / "sparkd.db"
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 3, 25.0)
        t0 = time.time()
        with open(db, "r+b") as f:
            f.write(os.urandom(100))
        for side in ("-wal", "-shm"):
            p = state / f"sparkd.db{side}"
            if p.exists():
                with open(p, "r+b") as f:
                    f.write(os.urandom(100))
        # the read side answers (from memory or the new file), never 500
        for path in ("/", "/dashboard.json", "/ui/events", "/api/events", "/api/samples"):
            r = g.http.get(path)
            assert r.status_code == 200, (path, r.status_code, r.text[:200])
        g.stop_during(t0)
        g.assert_sampling(t0)
        assert wait_for(lambda: list(state.glob("sparkd.db.corrupt-*")), 15.0, 0.2), list(state.iterdir())
        assert wait_for(lambda: g.status()["database"]["state"] == "ok", 15.0, 0.2)
        assert wait_for(lambda: g.events("database_corrupt"), 5.0, 0.2)
        g.p.terminate()
        out, _ = g.p.communicate(timeout=20)
        assert g.p.returncode == 0 and "Traceback" not in out, out[-2000:]


def test_a_database_corrupt_inside_an_intact_header_is_moved_aside_without_a_storm(tmp_path: Path) -> None:
    """Pages inside the file garbled, the header intact: it still opens, so each reopen failed again at
    the next write (an unavailable/recovered pair every 0.5 s). The keeper checks the pages
    (quick_check) before it trusts a file that said "malformed", and moves it aside."""
    import sqlite3

    state = tmp_path / "state"
    with guarded(tmp_path, state) as g:
        db = state / "sparkd.db"
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 20, 20.0)
        con = sqlite3.connect(db)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the rows into the main file
        con.close()
        size = db.stat().st_size
        assert size > 3 * 4096
        t0 = time.time()
        with open(db, "r+b") as f:  # every page but the first (the header) garbled
            f.seek(4096)
            f.write(os.urandom(size - 4096))
        assert wait_for(lambda: list(state.glob("sparkd.db.corrupt-*")), 30.0, 0.2), list(state.iterdir())
        assert wait_for(lambda: g.status()["database"]["state"] == "ok", 15.0, 0.2)
        time.sleep(3.0)
        # said once or twice, not a storm of pairs
        assert len(g.events("database_unavailable")) <= 3, len(g.events("database_unavailable"))
        g.assert_sampling(t0)


def test_it_says_and_recreates_a_database_deleted_while_running(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with guarded(tmp_path, state) as g:
        db = state / "sparkd.db"
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 3, 25.0)
        t0 = time.time()
        for p in state.glob("sparkd.db*"):
            p.unlink()
        # found at the next write (WRITE_EVERY_S)
        assert wait_for(lambda: g.events("database_unavailable"), WRITE_EVERY_S + 5.0, 0.1)
        ev = g.events("database_unavailable")[0]
        # "deleted", or "deleted or replaced" when a reader's connection made a new empty file first
        assert "deleted" in ev["message"] and "while sparkd was running" in ev["message"], ev["message"]
        assert wait_for(lambda: db.exists() and g.status()["database"]["state"] == "ok", 10.0, 0.2)
        g.stop_during(t0)
        g.assert_sampling(t0)
        # the new file is the one written: the stop and the samples after it are in it
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM events WHERE kind='stop_not_executed'")[0][0], 5.0)
        assert cli(g, "status").returncode == 0


def test_it_says_and_recovers_when_the_write_ahead_log_is_deleted_while_running(tmp_path: Path) -> None:
    """``rm sparkd.db-wal sparkd.db-shm`` while sparkd runs: SQLite would append to the unlinked log
    (every write since the last checkpoint, lost at a kill -9) while the status read "ok". The writer's
    check after each write sees it; the database is reopened and samples reach the file at its path."""
    state = tmp_path / "state"
    with guarded(tmp_path, state) as g:
        db = state / "sparkd.db"
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 3, 25.0)
        for p in (state / "sparkd.db-wal", state / "sparkd.db-shm"):
            p.unlink()
        t1 = time.time()
        assert wait_for(lambda: g.events("database_unavailable"), 15.0, 0.1)  # found at the next write
        ev = g.events("database_unavailable")[0]
        assert "write-ahead log" in ev["message"] and "while sparkd was running" in ev["message"], ev["message"]
        assert wait_for(lambda: g.status()["database"]["state"] == "ok", 15.0, 0.2), g.status()["database"]
        # recording goes to the file at its path again (another process sees the new samples)
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples WHERE ts > ?", (t1 + 1,))[0][0] > 3, 25.0)
        assert Path(f"{db}-wal").exists()
        # the events written again from memory are not doubled where the old connection's last checkpoint
        # carried them into the file anyway (an adversarial helper saw each one twice)
        doubled = "SELECT kind, count(*) FROM events GROUP BY ts, kind, message HAVING count(*) > 1"
        assert db_query(db, doubled) == []


def test_events_written_again_after_the_write_ahead_log_was_deleted_are_not_doubled(tmp_path: Path) -> None:
    """Events since the last write found in place are written again from memory after the keeper reopened the
    database; the old connection's last checkpoint may have carried them into the file already. Each trip
    and stop read twice in the database (an adversarial helper's finding; 2 doubled kinds here before)."""
    state = tmp_path / "state"
    with guarded(tmp_path, state) as g:
        db = state / "sparkd.db"
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] > 3, 25.0)
        for _ in range(3):
            (g.proc / "meminfo").write_text(LOW)  # a trip and its stop_not_executed around the deletion
            time.sleep(0.3)
            with contextlib.suppress(FileNotFoundError):
                (state / "sparkd.db-wal").unlink()
            time.sleep(0.5)
            (g.proc / "meminfo").write_text(HEALTHY)
            assert wait_for(lambda: g.status()["database"]["state"] == "ok", 15.0, 0.2)
            time.sleep(2.0)
        assert db_query(db, "SELECT count(*) FROM events WHERE kind = 'trip'")[0][0] >= 1
        doubled = "SELECT kind, count(*) FROM events GROUP BY ts, kind, message HAVING count(*) > 1"
        assert db_query(db, doubled) == []


def db_gap(db: Path, since: float, until: float) -> tuple[int, float]:
    """Samples stored between ``since`` and ``until`` and the largest gap between them (s)."""
    ts = [r[0] for r in db_query(db, "SELECT ts FROM samples WHERE ts BETWEEN ? AND ? ORDER BY ts", (since, until))]
    return len(ts), max((b - a for a, b in itertools.pairwise([since, *ts, until])), default=until - since)


# ---------------------------------------------------------------------------------------------- fault 3
def test_a_stop_completes_while_1100_idle_connections_flood_the_api_under_ulimit_1024(tmp_path: Path) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need(hard >= 2048, "the test itself needs more than 2048 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    state = tmp_path / "state"
    with guarded(tmp_path, state, api="header_timeout_s = 4.0\n", nofile=1024) as g:
        db = state / "sparkd.db"
        st = g.status()
        assert 8 <= st["http"]["connection_cap"] <= 1024 - 128
        socks: list[Any] = []
        t0 = time.time()
        try:
            for i in range(1100):
                s = __import__("socket").create_connection(("127.0.0.1", g.port), timeout=5)
                if i % 5 == 0:
                    s.sendall(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # slowloris: never ends the head
                socks.append(s)
            opened_at = time.time()
            (g.proc / "meminfo").write_text(LOW)
            stop = wait_for(
                lambda: db_query(db, "SELECT ts FROM events WHERE kind='stop_not_executed' AND ts >= ?", (t0,)), 10.0
            )
            (g.proc / "meminfo").write_text(HEALTHY)
            assert stop, "no stop carried out while the API was flooded"
            # idle and slow heads are closed after header_timeout_s: every socket sees EOF or a reset
            time.sleep(max(0.0, opened_at + 4.0 + 1.0 - time.time()))
            closed = 0
            for s in socks:
                s.settimeout(0.01)
                try:
                    closed += s.recv(1) == b""
                except ConnectionResetError:
                    closed += 1
                except OSError:
                    pass
            assert closed >= 1000, closed
            t1 = time.time()
        finally:
            for s in socks:
                s.close()
        # the writer gathers samples for store.WRITE_EVERY_S: wait until those up to t1 are written
        assert wait_for(lambda: (db_query(db, "SELECT max(ts) FROM samples")[0][0] or 0) >= t1, WRITE_EVERY_S + 5.0)
        n, gap = db_gap(db, t0, t1)
        assert gap <= 2 * INTERVAL_S + 0.05, f"samples stopped for {gap:.2f} s during the flood"
        assert n >= (t1 - t0) / INTERVAL_S * 0.7
        st = wait_for(lambda: g.status(), 5.0)
        assert st["http"]["refused"] > 0 and st["http"]["head_timeouts"] > 0, st["http"]
        g.p.terminate()
        out, _ = g.p.communicate(timeout=20)
    lines = out.splitlines()
    assert "Too many open files" not in out
    assert len(lines) < 60, f"{len(lines)} log lines: {lines[:20]}"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def raw_request(port: int, head: bytes, body: bytes = b"", read_s: float = 5.0) -> bytes:
    """Send ``head`` (and ``body``) on a real socket; return what the server answered before closing."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        try:
            s.sendall(head)
            if body:
                s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused before reading the rest: what it said is below
        out = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and len(out) > 64:
                    break
        return out


# ---------------------------------------------------------------------------------------------- fault 4
def test_oversized_bodies_and_heads_are_refused_before_reading_while_the_guard_stops(tmp_path: Path) -> None:
    with guarded(tmp_path) as g:
        t0 = time.time()
        rss0 = rss_bytes(g.p.pid)
        host = f"127.0.0.1:{g.port}".encode()
        # 50 MB announced, no token: 413 at once, after the head only (we send 1 MB of it at most)
        for path in (b"/api/container/stop", b"/login", b"/api/status"):
            head = b"POST " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 52428800\r\n\r\n"
            out = raw_request(g.port, head, b"x" * 1_000_000)
            assert out.startswith(b"HTTP/1.1 413"), out[:200]
        # a chunked body has no length to check: it is cut at api.max_body_bytes
        chunk = b"x" * 65536
        body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(16)) + b"0\r\n\r\n"
        head = b"POST /login HTTP/1.1\r\nHost: " + host + b"\r\nTransfer-Encoding: chunked\r\n"
        head += b"Content-Type: application/x-www-form-urlencoded\r\n\r\n"
        out = raw_request(g.port, head, body)
        assert not out.startswith(b"HTTP/1.1 2") and not out.startswith(b"HTTP/1.1 3"), out[:200]
        # a 100 MB header: refused after api.max_header_bytes (16 KiB), not read to its end
        head = b"GET /api/status HTTP/1.1\r\nHost: " + host + b"\r\nX-Big: " + b"a" * (2 * 2**20)
        out = raw_request(g.port, head)
        assert out.startswith(b"HTTP/1.1 400") or out == b"", out[:200]
        g.stop_during(t0)
        g.assert_sampling(t0)
        assert rss_bytes(g.p.pid) - rss0 < 30 * 2**20, "the refused bodies were buffered"


# ---------------------------------------------------------------------------------------------- fault 5
def test_login_backs_off_and_logout_ends_the_session_while_the_guard_stops(tmp_path: Path) -> None:
    with guarded(tmp_path) as g:
        t0 = time.time()
        token = (g.state / "token").read_text().strip()
        codes = [g.http.post("/login", data={"token": f"guess{i}"}).status_code for i in range(30)]
        assert codes[:6] == [401] * 6 and set(codes[6:]) == {429}, codes
        assert g.http.get("/login", params={"token": token}).status_code == 400  # never in a URL
        other = httpx.Client(base_url=f"http://127.0.0.1:{g.port}", timeout=5.0)
        # the back-off is per client: the same address here, so the right token waits too
        assert other.post("/login", data={"token": token}).status_code == 429
        g.stop_during(t0)
        g.assert_sampling(t0)
        out = g.p.stdout
        assert out is not None


# ---------------------------------------------------------------------------------------------- fault 6
def test_two_host_headers_and_undecodable_json_are_refused_while_the_guard_stops(tmp_path: Path) -> None:
    with guarded(tmp_path) as g:
        t0 = time.time()
        head = f"GET /api/status HTTP/1.1\r\nHost: attacker.example\r\nHost: 127.0.0.1:{g.port}\r\n\r\n"
        out = raw_request(g.port, head.encode())
        # refused by the HTTP parser (h11) or, behind another parser, by sparkd's own check (tests/test_api.py)
        assert out.startswith(b"HTTP/1.1 400"), out[:300]
        token = (g.state / "token").read_text().strip()
        r = g.http.post(
            "/api/resize",
            content=b'{"kv_cache_dtype":"\\ud800"}',
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        assert r.status_code == 422, r.text
        assert r.json()["detail"]["field"] == "kv_cache_dtype"
        g.stop_during(t0)
        g.assert_sampling(t0)


# ---------------------------------------------------------------------------------------------- fault 8
NVRM_LINE = (
    "NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) "
    "returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1353"
)


class Lines:
    """The kernel log at its edge: lines handed in by the test (the real /dev/kmsg path has its own
    test in tests/test_daemon.py)."""

    name = "test"

    def __init__(self) -> None:
        self.pending: list[str] = []

    def poll(self) -> list[str]:
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        return None


def test_driver_error_evidence_windows_ignore_wall_clock_steps_both_ways(tmp_path: Path) -> None:
    from sparkd.config import load_settings
    from sparkd.loop.guard import Guard

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(HEALTHY)
    settings = load_settings(overrides={"state_dir": str(tmp_path), "proc_root": str(proc), "kernlog_source": "off"})
    clock = {"mono": 1000.0, "wall": 1_800_000_000.0}
    src = Lines()
    g = Guard(settings, src, mono=lambda: clock["mono"], wall=lambda: clock["wall"])
    window = settings.nvrm_window_s

    def step(mono_s: float, wall_s: float) -> int:
        clock["mono"] += mono_s
        clock["wall"] += wall_s
        return g.tick().sample.nvrm_recent

    src.pending.append(NVRM_LINE)
    assert step(0.0, 0.0) == 1
    # a 1 h step back while 2.5 windows pass: the error is old, whatever the wall clock says
    assert step(2.5 * window, -3600.0) == 0
    src.pending.append(NVRM_LINE)
    assert step(0.1, 0.0) == 1
    # a 1 h step forward one second later: the error is still recent
    assert step(1.0, 3600.0) == 1
    # stored windows are labelled in wall time (the time of the line), not in monotonic seconds
    starts = [start for start, _ in g.nvrm.closed_windows(clock["mono"] + 3 * window)]
    assert starts and all(abs(s - 1_800_000_000.0) < 3 * 3600 for s in starts), starts


def test_the_guard_samples_on_time_and_stops_while_the_wall_clock_jumps(tmp_path: Path) -> None:
    import asyncio

    from sparkd.config import load_settings
    from sparkd.loop.daemon import Daemon, MonitorOnly
    from sparkd.loop.guard import Guard

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(HEALTHY)
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "proc_root": str(proc),
            "kernlog_source": "off",
            "interval_s": INTERVAL_S,
            "fast_interval_s": INTERVAL_S,
            "api": {"enabled": False},
            "rules": [{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        }
    )
    offset = {"s": 0.0}

    class Recording(Guard):
        monos: list[float] = []  # noqa: RUF012

        def tick(self) -> Any:
            r = super().tick()
            self.monos.append(r.sample.mono)  # the real monotonic clock: what "on time" means
            return r

    guard = Recording(settings, None, wall=lambda: time.time() + offset["s"])

    async def go() -> list[dict[str, Any]]:
        d = Daemon(settings, actions=MonitorOnly(), guard=guard)
        await d.startup()
        task = asyncio.create_task(d.main_loop())
        for jump in (-3600.0, 3600.0, -7200.0):
            await asyncio.sleep(1.0)
            offset["s"] += jump
            if jump == 3600.0:
                (proc / "meminfo").write_text(LOW)
        await asyncio.sleep(1.0)
        (proc / "meminfo").write_text(HEALTHY)
        events = list(d.recent_events)
        d.request_exit()
        await task
        await d.shutdown("test")
        return events

    events = asyncio.run(go())
    stops = [e for e in events if e["kind"] == "stop_not_executed"]
    assert stops and "low_available" in stops[0]["message"]
    monos = guard.monos
    assert len(monos) >= 15, len(monos)
    gap = max(b - a for a, b in itertools.pairwise(monos))
    assert gap <= 2 * INTERVAL_S, f"a wall-clock step held the guard for {gap:.2f} s"


# ---------------------------------------------------------------------------------------- kernel-log flood
def test_a_kmsg_flood_is_counted_read_or_lost_line_for_line(tmp_path: Path) -> None:
    need(os.access("/dev/kmsg", os.W_OK), "/dev/kmsg is not writable (needs root)")
    from sparkd.sense.kernlog_readers import KmsgSource

    src = KmsgSource()
    try:
        tag = f"sparkd-test-flood-{os.getpid()}"
        n = 20000
        sent = 0
        while sent < n:  # each open file may write 10 lines per 5 s under printk_devkmsg=ratelimit
            with open("/dev/kmsg", "w") as f:
                for _ in range(10):
                    f.write(f"{tag} {sent}\n")
                    f.flush()
                    sent += 1
        lines: list[str] = []
        for _ in range(40):
            lines += src.poll()
        mine = sum(tag in line for line in lines)
        # far more than the ring holds were written: most were overwritten, and each one is counted
        assert src.lost_records > 0 and src.overruns > 0
        assert mine < n
        assert len(lines) + src.lost_records >= n  # other writers may add lines, never fewer
    finally:
        src.close()


# ------------------------------------------------------------------------------------ fault 2: a refused record
def test_a_record_the_database_refuses_for_good_is_dropped_and_later_writes_go_on(tmp_path: Path) -> None:
    import asyncio

    from sparkd.config import load_settings
    from sparkd.loop.daemon import Daemon, MonitorOnly

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(HEALTHY)
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "proc_root": str(proc),
            "kernlog_source": "off",
            "interval_s": INTERVAL_S,
            "fast_interval_s": INTERVAL_S,
            "api": {"enabled": False},
            "rules": [{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        }
    )
    db = tmp_path / "sparkd.db"

    async def go() -> float:
        d = Daemon(settings, actions=MonitorOnly())
        await d.startup()
        task = asyncio.create_task(d.main_loop())
        await asyncio.sleep(0.5)
        t0 = time.time()
        # SQLite cannot store a lone surrogate: the batch holding this event fails, for good
        d.event("poison", "a kernel line with \ud800 in it")
        await asyncio.sleep(0.6)
        (proc / "meminfo").write_text(LOW)
        await asyncio.sleep(1.0)
        (proc / "meminfo").write_text(HEALTHY)
        await asyncio.sleep(1.0)
        d.request_exit()
        await task
        await d.shutdown("test")
        return t0

    t0 = asyncio.run(go())
    t1 = time.time() - 0.2
    kinds = [r[0] for r in db_query(db, "SELECT kind FROM events WHERE ts >= ?", (t0,))]
    assert "poison" not in kinds and "record_refused" in kinds and "stop_not_executed" in kinds, kinds
    n, gap = db_gap(db, t0, t1)
    assert gap <= 2 * INTERVAL_S + 0.05 and n >= (t1 - t0) / INTERVAL_S * 0.7, (n, gap)


# ---------------------------------------------------------------------------------------------- fault 7
def test_config_that_would_disarm_the_guard_is_refused_and_the_explicit_one_guards(tmp_path: Path) -> None:
    refused = {
        "rules = []\n": "no stop rule",
        'leak_threshold = "-4GiB"\n': "leak_threshold",
        'leak_threshold = "4 GB"\n': "decimal GB is ambiguous",
        '[[rules]]\nname = "never"\nwhen = ["MemAvailable < -6GiB"]\n': "rules.0.when",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_")}
    for toml, says in refused.items():
        cfg = tmp_path / "bad.toml"
        cfg.write_text(f'state_dir = "{tmp_path / "bad"}"\n{toml}')
        r = subprocess.run(
            [sys.executable, "-m", "sparkd.face.cli", "--config", str(cfg), "run", "--no-api"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (toml, r.stderr)
        assert not (tmp_path / "bad" / "sparkd.db").exists()  # refused before anything ran
    # the same intent said exactly: it runs, samples on time and stops
    with guarded(tmp_path, extra='leak_threshold = "4GiB"\n') as g:
        t0 = time.time()
        g.stop_during(t0)
        g.assert_sampling(t0)


# ---------------------------------------------------------------------------------------------- fault 9
def test_state_dir_is_0700_and_files_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)  # what a shell gives `sparkd run` by hand
    try:
        state = tmp_path / "state"
        with guarded(tmp_path, state) as g:
            t0 = time.time()
            g.stop_during(t0)
            g.assert_sampling(t0)
            assert wait_for(lambda: (state / "sparkd.db-wal").exists(), 5.0)
            assert (state.stat().st_mode & 0o777) == 0o700
            files = [p for p in state.rglob("*") if p.is_file()]
            assert {p.name for p in files} >= {"sparkd.db", "sparkd.db-wal", "sparkd.db-shm", "token", "sparkd.lock"}
            loose = {p.name: oct(p.stat().st_mode & 0o777) for p in files if p.stat().st_mode & 0o077}
            assert loose == {}, loose
    finally:
        os.umask(old)


def test_records_dropped_by_a_full_writer_queue_are_a_critical_event_once_per_increase(tmp_path: Path) -> None:
    """Writer.dropped (the queue full: records the rules saw, not recorded) reaches the event log, not
    only a log line: one records_dropped event per increase, when the writer wakes the keeper."""
    import asyncio

    from sparkd.config import load_settings
    from sparkd.loop.daemon import Daemon

    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "kernlog_source": "off",
            "queue_max": 10,
            "api": {"enabled": False},
        }
    )

    async def go() -> list[dict[str, Any]]:
        d = Daemon(settings, serve_api=False)
        await d.startup()
        assert d.writer is not None
        for i in range(20):  # nobody drains the queue between these: 10 fit (startup left some)
            d.writer.submit("sample", {"ts": 1000.0 + i, "mem_available": 1})
        await asyncio.sleep(0.2)  # the keeper, woken by the writer, reports
        await d._db_step()  # nothing new: no second event
        evs = [e for e in d.recent_events if e["kind"] == "records_dropped"]
        await d.shutdown("test")
        return evs

    evs = asyncio.run(go())
    assert len(evs) == 1 and evs[0]["severity"] == "critical", evs
    assert evs[0]["details"]["dropped"] >= 10 and "dropped after the rules saw them" in evs[0]["message"]


@pytest.mark.parametrize(
    ("reason", "severity", "said"), [("SIGTERM", "info", "stopped cleanly"), ("crash: boom", "critical", "ended")]
)
def test_a_run_end_note_is_taken_for_its_own_run_only_and_a_crash_stays_critical(
    tmp_path: Path, reason: str, severity: str, said: str
) -> None:
    """``report_unclean_end`` on a real database: the note of the run before is recorded (a crash's stays critical:
    its ``daemon_crashed`` went with the database); another run's note (a database restored from a backup) is
    removed and the critical ``unclean_exit`` is said as before."""
    import asyncio
    import json
    from types import SimpleNamespace

    from sparkd.loop.daemon_db import RUN_END_FILE, report_unclean_end
    from sparkd.store.store import Store

    store = Store.open(tmp_path / "sparkd.db")
    events: list[tuple[str, str, str]] = []
    daemon = SimpleNamespace(
        store=store,
        settings=SimpleNamespace(state_dir=str(tmp_path)),
        event=lambda kind, message, severity="info", details=None: events.append((kind, severity, message)),
    )
    note = tmp_path / RUN_END_FILE
    for own in (True, False):
        events.clear()
        prev = store.start_run(pid=4242, version="t", hostname="h", config={})
        now = store.start_run(pid=4343, version="t", hostname="h", config={})
        run = {"id": prev if own else prev - 1, "stopped_at": time.time(), "exit_reason": reason, "samples": 7}
        note.write_text(json.dumps({**run, "pid": 4242}))
        asyncio.run(report_unclean_end(daemon, now))  # type: ignore[arg-type]
        assert not note.exists()
        ((kind, sev, message),) = events
        if own:
            assert kind == "run_end_recovered" and sev == severity and f"pid 4242) {said} ({reason})" in message
            assert db_query(tmp_path / "sparkd.db", "SELECT exit_reason FROM daemon_runs WHERE id=?", (prev,)) == [
                (reason,)
            ]
        else:
            assert kind == "unclean_exit" and sev == "critical", events
    store.close()


def test_an_operators_command_at_the_connection_cap_says_so_not_that_no_daemon_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Half-open connections held the API at its cap: `sparkd stop` said "no daemon answers … Connection reset by
    peer" while the daemon ran and guarded (helper-33). It now says the daemon closed the connection and why it may
    have (its cap), and the daemon counts the refusal."""
    import socket

    from sparkd.config import load_settings
    from sparkd.face.cli.control import _api

    state = tmp_path / "state"
    with guarded(tmp_path, state, api="max_connections = 8\nheader_timeout_s = 30.0\n") as g:
        cap = g.status()["http"]["connection_cap"]
        assert cap == 8  # the least the daemon allows (httpserver.connection_cap)
        held = [socket.create_connection(("127.0.0.1", g.port), timeout=5) for _ in range(cap)]  # no head, ever
        try:
            time.sleep(0.3)
            with pytest.raises(SystemExit) as ex:
                _api(load_settings(tmp_path / "sparkd.toml"), "POST", "/api/container/stop", timeout_s=10)
            err = capsys.readouterr().err
        finally:
            for s in held:
                s.close()
        assert ex.value.code == 3
        assert "closed the connection without an answer" in err and "connection cap" in err, err
        assert "no daemon answers" not in err, err
        st = wait_for(lambda: g.status(), 5.0)
        assert st["http"]["refused"] >= 1, st["http"]


# ------------------------------------------------------------------------------- helper-40's faults
def test_a_sighup_is_said_and_ignored_the_guard_goes_on(tmp_path: Path) -> None:
    """SIGHUP (a closed terminal of a foreground ``sparkd run``; ``kill -HUP``, ``systemctl reload`` habits) ended the
    daemon at once with no event, and systemd's ``Restart=on-failure`` counts SIGHUP as a clean exit: the guard stayed
    down (helper-40). It is said and ignored; the guard samples on and still stops."""
    t0 = time.time()
    with guarded(tmp_path) as g:
        g.p.send_signal(signal.SIGHUP)
        said = wait_for(lambda: g.events("signal_ignored"), 10.0, 0.1)
        assert said and "SIGHUP ignored: sparkd does not reload its configuration" in said[0]["message"], said
        assert g.p.poll() is None
        g.stop_during(t0)
        g.assert_sampling(t0)


def test_a_terminal_stop_signal_is_said_and_ignored_the_guard_does_not_pause(tmp_path: Path) -> None:
    """SIGTSTP (Ctrl-Z on a foreground ``sparkd run``) froze the guard (``State: T``) until SIGCONT, said only by a
    ``guard_gap`` afterwards (helper-45); SIGTTIN/SIGTTOU do the same to a background run touching its terminal."""
    t0 = time.time()
    with guarded(tmp_path) as g:
        g.p.send_signal(signal.SIGTSTP)
        said = wait_for(lambda: g.events("signal_ignored"), 10.0, 0.1)
        assert said and said[0]["message"].startswith("SIGTSTP ignored: a guard does not pause"), said
        # SIGTTIN/SIGTTOU ignored outright (SIG_IGN), not handled: a handler returns into the terminal write the
        # kernel restarts under `stty tostop`, which signals again for ever (helper-46)
        status = Path(f"/proc/{g.p.pid}/status").read_text()
        ignored = int(status.split("SigIgn:")[1].split()[0], 16)
        assert all(ignored >> (s - 1) & 1 for s in (signal.SIGTTIN, signal.SIGTTOU)), hex(ignored)
        for sig in (signal.SIGTTIN, signal.SIGTTOU):
            g.p.send_signal(sig)
        time.sleep(0.5)
        state = Path(f"/proc/{g.p.pid}/status").read_text().split("State:")[1].split()[0]
        assert state != "T" and g.p.poll() is None, state
        g.stop_during(t0)
        g.assert_sampling(t0)


def test_a_pressure_file_with_a_number_that_is_not_one_blinds_psi_and_the_guard_goes_on(tmp_path: Path) -> None:
    """``some avg10=.`` passed the fast parser's ``[0-9.]+`` and ``float()`` raised in the tick: ``daemon_crashed``,
    and every restart died in its start-up with no event (helper-40). It reads as PSI not read; the guard goes on."""
    good = "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"
    (tmp_path / "proc" / "pressure").mkdir(parents=True)
    (tmp_path / "proc" / "pressure" / "memory").write_text(good)
    t0 = time.time()
    with guarded(tmp_path) as g:
        assert wait_for(lambda: g.status()["sample"]["psi_some_avg10"] == 0.0, 10.0, 0.1)
        rewrite_in_place(g.proc / "pressure" / "memory", good.replace("some avg10=0.00", "some avg10=."))
        assert wait_for(lambda: g.status()["sample"]["psi_some_avg10"] is None, 10.0, 0.1)
        assert g.p.poll() is None and not g.events("daemon_crashed")
        g.stop_during(t0)
        g.assert_sampling(t0)


def test_an_api_port_another_program_holds_is_said_the_guard_runs_and_the_api_comes_when_it_is_free(
    tmp_path: Path,
) -> None:
    """sparkd exited (rc 1) when its API port was held by another program or a ``cluster.listen`` address was not
    up yet, and under systemd restarted every 5 s without ever guarding (helper-40). It guards without the API, says
    so (critical ``api_unavailable``), and serves the API once the port is free (``api.retry_s``)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(HEALTHY)
    state = tmp_path / "state"
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    cfg = (
        f'interval_s = {INTERVAL_S}\nfast_interval_s = {INTERVAL_S}\nkernlog_source = "off"\nproc_root = "{proc}"\n'
        f"[api]\nport = {port}\nretry_s = 1\n"
        '[[rules]]\nname = "low_available"\nwhen = ["MemAvailable < 6GiB"]\nsamples = 2\n'
    )
    try:
        with sparkd_run(tmp_path, config=cfg, args=(), state_dir=state) as p:
            db = state / "sparkd.db"
            said = wait_for(
                lambda: db_query(db, "SELECT message, severity FROM events WHERE kind = 'api_unavailable'"), 30
            )
            assert said and said[0][1] == "critical", said
            assert f"the API cannot listen on 127.0.0.1:{port}: Address already in use" in said[0][0], said
            assert "SPARKD_API__PORT" in said[0][0] and "tries again every 1 s" in said[0][0], said
            # the guard runs meanwhile: it samples and decides a stop
            (proc / "meminfo").write_text(LOW)
            assert wait_for(lambda: db_query(db, "SELECT 1 FROM events WHERE kind = 'stop_not_executed'"), 15)
            (proc / "meminfo").write_text(HEALTHY)
            assert p.poll() is None
            # `sparkd status` says the API is not served; `sparkd stop` sends its token to nothing but the daemon
            # (it went to whatever held the port, and exited 0 on an answer of 200: helper-42)
            said = "API: NOT SERVED: the API cannot listen on"
            status = wait_for(lambda: said in (out := cli_run(tmp_path / "sparkd.toml", "status").stdout) and out, 10)
            assert status, cli_run(tmp_path / "sparkd.toml", "status").stdout
            stop = cli_run(tmp_path / "sparkd.toml", "stop")
            assert stop.returncode == 3 and f"does not serve its API on port {port}" in stop.stderr, stop
            busy.settimeout(0.5)
            with pytest.raises(TimeoutError):
                busy.accept()  # nothing connected to the program holding the port
            busy.close()
            assert wait_for(lambda: db_query(db, "SELECT message FROM events WHERE kind = 'api_available'"), 15)
            assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        busy.close()


def test_starts_a_broken_configuration_refused_are_said_by_the_next_start_with_the_time_unguarded(
    tmp_path: Path,
) -> None:
    """A configuration edited into an error, then a restart: under systemd's ``Restart=always`` each ``sparkd run``
    exited 2 five seconds after the last, nothing was guarded, and the next good start's history read only
    ``daemon_stopped`` then ``daemon_started`` (helper-45). The refusals are counted in the state directory and the
    next start says them: a critical ``start_refused``."""
    state = tmp_path / "state"
    cfg = tmp_path / "sparkd.toml"
    cfg.write_text(f'state_dir = "{state}"\n[[rules]]\nname = "low"\nwhen = ["MemAvailable < 20573MB"]\n')
    t0 = time.time()
    for _ in range(2):
        r = cli_run(cfg, "run", "--no-api")
        assert r.returncode == 2 and "20573MB" in r.stderr, (r.returncode, r.stderr[-500:])
    with guarded(tmp_path, state=state) as g:
        said = g.events("start_refused")
        assert [e["severity"] for e in said] == ["critical"], said
        msg = said[0]["message"]
        assert msg.startswith("sparkd refused to start 2 times from ") and "20573MB" in msg, msg
        assert "nothing was guarded for at least" in msg
        assert said[0]["details"]["first_ts"] >= t0 - 1 and said[0]["details"]["count"] == 2
        assert not (state / "start_refused.json").exists()  # said once: the next start says nothing
        assert g.p.poll() is None
        # a refused `sparkd run` by hand while this one guards left nothing unguarded: not counted (helper-46)
        bad = tmp_path / "bad.toml"
        bad.write_text(f'state_dir = "{state}"\ninterval_s = 0\n')
        assert cli_run(bad, "run", "--no-api").returncode == 2
        assert not (state / "start_refused.json").exists()


def test_a_configuration_file_edited_while_sparkd_runs_is_said_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The running daemon did not notice its file edited into an error; the next restart was refused (above). It
    says so within ``CONFIG_CHECK_S`` (a ``stat``; the file is read only when it changed), and when it loads again."""
    import asyncio

    from click.testing import CliRunner

    from sparkd.config import load_settings
    from sparkd.face import presenters as views
    from sparkd.face.cli import main
    from sparkd.loop import daemon_db
    from sparkd.loop.daemon import Daemon

    monkeypatch.setattr(daemon_db, "CONFIG_CHECK_S", 0.1)
    cfg = tmp_path / "sparkd.toml"
    good = f'state_dir = "{tmp_path / "state"}"\nkernlog_source = "off"\n'
    cfg.write_text(good)

    async def scenario() -> list[dict[str, Any]]:
        d = Daemon(load_settings(cfg), serve_api=False)
        d.config_path = cfg
        await d.startup()
        try:

            async def said(kind: str) -> list[dict[str, Any]]:
                for _ in range(100):
                    if found := [e for e in d.recent_events if e["kind"] == kind]:
                        return found
                    await asyncio.sleep(0.05)
                return []

            await asyncio.sleep(0.3)
            assert not [e for e in d.recent_events if e["kind"].startswith("config_file")]  # unchanged: nothing said
            cfg.write_text(good + "interval_s = 0\n")
            invalid = await said("config_file_invalid")
            cfg.write_text(good + "interval_s = 0\n# touched, same error\n")
            await asyncio.sleep(0.4)
            assert len([e for e in d.recent_events if e["kind"] == "config_file_invalid"]) == 1  # once per error
            assert d.status_json().config_file.state == "invalid"  # type: ignore[union-attr]
            assert (
                views.headline(d.status_json().model_dump(mode="json"), None)["label"] == "configuration file invalid"
            )
            cfg.write_text(good)
            valid = await said("config_file_valid")
            # a valid edit is not applied (sparkd never reloads): said, shown, and told apart from a revert (helper-47)
            assert d.status_json().config_file.state == "as_started"  # type: ignore[union-attr]
            cfg.write_text(good + "dry_run = true\n[container]\nstop_timeout_s = 20\n")
            changed = await said("config_changed_not_applied")
            st = d.status_json()
            assert st.config_file is not None and st.config_file.changed == ["dry_run", "container.stop_timeout_s"]
            h = views.headline(st.model_dump(mode="json"), None)
            assert h["config_note"] == (
                "configuration file changed since start (dry_run, container.stop_timeout_s): restart sparkd to apply"
            )
            shown = await asyncio.to_thread(CliRunner().invoke, main, ["--config", str(cfg), "config", "show"])
            assert f"the sparkd running now (pid {os.getpid()}) runs with the configuration it loaded" in shown.output
            cfg.write_text(good)
            back = await said("config_file_as_started")
            assert d.status_json().config_file.state == "as_started"  # type: ignore[union-attr]
            return invalid + valid + changed + back
        finally:
            await d.shutdown("test")

    invalid, valid, changed, back = asyncio.run(scenario())
    assert changed["severity"] == "warning" and changed["details"]["changed"] == ["dry_run", "container.stop_timeout_s"]
    assert "Not applied" in changed["message"] and "restart sparkd to apply" in changed["message"]
    assert back["message"] == f"the configuration file {cfg} matches what sparkd runs with again"
    assert invalid["severity"] == "warning" and f"the configuration file {cfg} no longer loads" in invalid["message"]
    assert (
        "interval_s" in invalid["message"] and "next start (a restart, a reboot) will be refused" in invalid["message"]
    )
    assert valid["message"].startswith(f"the configuration file {cfg} loads again")


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"first_ts": "x", "last_ts": 1, "count": 1, "error": "e"}',
        '{"first_ts": 5, "last_ts": 1, "count": 1, "error": "e"}',
        '{"first_ts": 1e300, "last_ts": 1e300, "count": 1, "error": "e"}',
        '{"first_ts": 1, "last_ts": 2, "count": "2", "error": "e"}',
    ],
)
def test_a_refused_starts_file_that_does_not_read_is_dropped_not_a_crash_at_start(tmp_path: Path, text: str) -> None:
    """A hand-edited ``start_refused.json`` with the right keys and wrong values crashed the start-up that read it
    (``float``/``gmtime``, helper-46): it is dropped."""
    from sparkd.store import refused

    (tmp_path / refused.FILE_NAME).write_text(text)
    assert refused.take(tmp_path) is None and not (tmp_path / refused.FILE_NAME).exists()
    refused.record(tmp_path, "bad", 100.0)
    refused.record(tmp_path, "worse", 160.0)
    assert refused.take(tmp_path) == {"first_ts": 100.0, "last_ts": 160.0, "count": 2, "error": "worse"}


def test_the_config_watch_compares_with_the_file_as_sparkd_run_loaded_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit made while the daemon started (its database opening) was taken for what it runs, and never said
    (helper-49); ``sparkd run --dry-run`` (an override, not an edit) must not read as a change."""
    import asyncio

    from sparkd.config import load_settings
    from sparkd.face.cli.observe import _file_settings
    from sparkd.loop import daemon_db

    monkeypatch.setattr(daemon_db, "CONFIG_CHECK_S", 0.05)
    p = tmp_path / "sparkd.toml"

    class D:
        def __init__(self, settings: Any, baseline: Any) -> None:
            self.settings, self.config_baseline, self.config_file = settings, baseline, None
            self.should_exit = asyncio.Event()
            self.events: list[str] = []

        def event(self, kind: str, message: str, **_: object) -> None:
            self.events.append(kind)

    def watch(d: D, edit: Any = None) -> None:
        async def go() -> None:
            t = asyncio.create_task(daemon_db.config_watch_loop(d, p))  # type: ignore[arg-type]
            await asyncio.sleep(0.2)
            d.should_exit.set()
            await t

        if edit:
            edit()
        asyncio.run(go())

    p.write_text(f'state_dir = "{tmp_path}"\ndry_run = true\n')
    settings = load_settings(p)
    d = D(settings, _file_settings(p, settings, None))
    watch(d, lambda: p.write_text(f'state_dir = "{tmp_path}"\ndry_run = false\n'))  # before the watch's first look
    assert d.config_file is not None and d.config_file.state == "changed" and d.config_file.changed == ["dry_run"]
    assert d.events == ["config_changed_not_applied"]
    # `sparkd run --dry-run` over a file that says false: nothing to say
    p.write_text(f'state_dir = "{tmp_path}"\ndry_run = false\n')
    settings = load_settings(p, overrides={"dry_run": True})
    d = D(settings, _file_settings(p, settings, {"dry_run": True}))
    watch(d)
    assert d.config_file is not None and d.config_file.state == "as_started" and d.events == []


def test_sparkd_status_still_reads_when_the_configuration_file_no_longer_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sparkd status` (and events, samples) exited 2 on the broken file, printing nothing else: exactly when the
    operator needed it, to see that the next start would be refused (helper-50). It says the error, then reads the
    state directory the file names with default settings."""
    import asyncio

    from click.testing import CliRunner

    from sparkd.config import load_settings
    from sparkd.face.cli import main
    from sparkd.loop import daemon_db
    from sparkd.loop.daemon import Daemon

    monkeypatch.setattr(daemon_db, "CONFIG_CHECK_S", 0.1)
    cfg = tmp_path / "sparkd.toml"
    good = f'state_dir = "{tmp_path / "state"}"\nkernlog_source = "off"\n'
    cfg.write_text(good)

    async def scenario() -> None:
        d = Daemon(load_settings(cfg), serve_api=False)
        d.config_path = cfg
        await d.startup()
        try:
            cfg.write_text(good + "interval_s = -5\n")
            for _ in range(100):
                if d.config_file is not None and d.config_file.state == "invalid":
                    break
                await asyncio.sleep(0.05)
        finally:
            await d.shutdown("test")  # its last snapshot says the file no longer loads

    asyncio.run(scenario())
    r = CliRunner().invoke(main, ["--config", str(cfg), "status"])
    assert r.exit_code == 0, r.output
    assert "interval_s = -5" in r.stderr and f"reading {tmp_path / 'state'} with the default settings" in r.stderr
    assert f"CONFIG: configuration file {cfg} no longer loads" in r.stdout, r.stdout
    assert "sparkd's next start will be refused" in r.stdout
    r = CliRunner().invoke(main, ["--config", str(cfg), "events", "--since", "1h"])
    assert r.exit_code == 0 and "config_file_invalid" in r.stdout, r.output
    # a command that acts still refuses a file it cannot load
    assert CliRunner().invoke(main, ["--config", str(cfg), "plan"]).exit_code == 2
