"""Notifier: webhook and command delivery, filters, rate limit, failures — and that
none of it slows the guard (a hanging receiver is measured, not assumed)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sparkd.act import notify
from sparkd.act.notify import Notifier
from sparkd.config import NotifySettings, Settings
from sparkd.loop.guard import Guard
from tests.conftest import FIXTURES

PROC_WATERMARK = FIXTURES / "proc-watermark"


def wait_for(pred: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


class Receiver:
    """http.server on 127.0.0.1 (ephemeral port) in a thread; answers from ``codes`` in turn."""

    def __init__(self, codes: list[int] | None = None) -> None:
        self.codes = list(codes or [])
        self.bodies: list[dict[str, Any]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                outer.bodies.append(json.loads(self.rfile.read(n)))
                code = outer.codes.pop(0) if outer.codes else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?token=secret"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class HangingReceiver:
    """Accepts connections, reads nothing, never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.conns: list[socket.socket] = []
        self.accepted = 0
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(c)
            self.accepted += 1

    def close(self) -> None:
        self._stop = True
        self.thread.join(1)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notify, "BACKOFF_BASE_S", 0.01)


def ev(kind: str = "stopped", message: str = "stopped sparkd-vllm: low_available", **kw: Any) -> dict[str, Any]:
    return {
        "ts": 1717000000.5,
        "kind": kind,
        "severity": "critical",
        "message": message,
        "details": {"rule": "low_available", "MemAvailable": 5 * 2**30},
        "launch_id": "L1",
        **kw,
    }


def test_webhook_gets_the_stopped_event_json(receiver: Receiver) -> None:
    n = Notifier(NotifySettings(webhook_url=receiver.url, min_interval_s=0))
    n.submit(ev())
    assert n.close(5) == 0
    assert len(receiver.bodies) == 1
    b = receiver.bodies[0]
    assert b["kind"] == "stopped" and b["severity"] == "critical" and b["source"] == "sparkd"
    assert b["message"] == "stopped sparkd-vllm: low_available"
    assert b["ts"] == 1717000000.5 and b["ts_iso"].startswith("2024-05-29T16:26:40.5")
    assert b["details"] == {"rule": "low_available", "MemAvailable": 5 * 2**30}
    assert b["launch_id"] == "L1" and b["suppressed"] == 0
    assert n.stats.sent == 1 and n.stats.failed == 0


def test_webhook_retries_500_then_succeeds(receiver: Receiver) -> None:
    receiver.codes = [500, 503]
    failures: list[tuple[str, str, dict[str, Any]]] = []
    n = Notifier(
        NotifySettings(webhook_url=receiver.url, retries=2, min_interval_s=0),
        on_failure=lambda *a: failures.append(a),
    )
    n.submit(ev())
    n.close(5)
    assert len(receiver.bodies) == 3
    assert failures == [] and n.stats.sent == 1


def test_webhook_gives_up_after_retries_and_reports_without_leaking_the_token(receiver: Receiver) -> None:
    receiver.codes = [500, 500, 500, 500]
    failures: list[tuple[str, str, dict[str, Any]]] = []
    n = Notifier(
        NotifySettings(webhook_url=receiver.url, retries=1, min_interval_s=0),
        on_failure=lambda *a: failures.append(a),
    )
    n.submit(ev())
    n.close(5)
    assert len(receiver.bodies) == 2  # 1 + retries
    assert len(failures) == 1
    kind, message, details = failures[0]
    assert kind == "notify_failed"
    assert "HTTP 500" in message and "2 attempt(s)" in message and "'stopped'" in message
    assert "secret" not in message and "secret" not in json.dumps(details)
    assert details["channel"] == "webhook" and details["event_kind"] == "stopped"


def test_webhook_does_not_retry_a_404(receiver: Receiver) -> None:
    receiver.codes = [404]
    n = Notifier(NotifySettings(webhook_url=receiver.url, retries=3, min_interval_s=0))
    n.submit(ev())
    n.close(5)
    assert len(receiver.bodies) == 1 and n.stats.failed == 1


def test_command_receives_the_fields_in_env(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    code = (
        f"import os,json; open({str(out)!r},'w').write(json.dumps("
        "{k:v for k,v in os.environ.items() if k.startswith('SPARKD_EVENT')}))"
    )
    n = Notifier(NotifySettings(command=[sys.executable, "-c", code], min_interval_s=0))
    n.submit(ev(message="stopped; $(rm -rf /) `echo no shell` 'quoted'"))
    n.close(10)
    env = json.loads(out.read_text())
    assert set(env) == set(notify.EVENT_ENV_VARS)
    assert env["SPARKD_EVENT_KIND"] == "stopped"
    assert env["SPARKD_EVENT_SEVERITY"] == "critical"
    assert env["SPARKD_EVENT_MESSAGE"] == "stopped; $(rm -rf /) `echo no shell` 'quoted'"  # no shell ran it
    assert env["SPARKD_EVENT_TS"] == "1717000000.500"
    assert env["SPARKD_EVENT_LAUNCH_ID"] == "L1"
    assert env["SPARKD_EVENT_SUPPRESSED"] == "0"
    assert json.loads(env["SPARKD_EVENT_DETAILS"])["rule"] == "low_available"
    assert json.loads(env["SPARKD_EVENT_JSON"])["kind"] == "stopped"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_command_timeout_kills_the_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    code = (
        "import subprocess,sys,time;"
        "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);"
        f"open({str(pidfile)!r},'w').write(str(p.pid));time.sleep(60)"
    )
    failures: list[tuple[str, str, dict[str, Any]]] = []
    n = Notifier(
        NotifySettings(command=[sys.executable, "-c", code], timeout_s=1.0, min_interval_s=0),
        on_failure=lambda *a: failures.append(a),
    )
    t0 = time.monotonic()
    n.submit(ev())
    assert wait_for(lambda: failures, 10)
    assert time.monotonic() - t0 < 6
    n.close(1)
    assert "did not finish within 1 s" in failures[0][1]
    grandchild = int(pidfile.read_text())
    assert wait_for(lambda: not _alive(grandchild), 5), "grandchild survived the timeout"


def test_kinds_filter(receiver: Receiver) -> None:
    n = Notifier(NotifySettings(webhook_url=receiver.url, kinds=["stopped"], severities=[], min_interval_s=0))
    for k in ("trip", "sampling_fast", "stopped", "daemon_started"):
        n.submit(ev(kind=k))
    n.close(5)
    assert [b["kind"] for b in receiver.bodies] == ["stopped"]
    assert n.stats.filtered == 3


def test_a_critical_event_of_any_kind_is_sent_by_default(receiver: Receiver) -> None:
    """``unguarded_container``, ``guard_gap``, ``unclean_exit``, ``peer_unreachable``... were critical and in no
    default kind: an operator who set up notifications was not told the host was unguarded (the README said
    ``peer_unreachable`` notifies). ``notify.severities`` (default critical) sends them whatever their kind."""
    n = Notifier(NotifySettings(webhook_url=receiver.url, min_interval_s=0))
    assert "unguarded_container" not in n.kinds and "peer_unreachable" not in n.kinds
    n.submit(ev(kind="unguarded_container", severity="critical"))
    n.submit(ev(kind="peer_unreachable", severity="critical"))
    n.submit(ev(kind="sampling_fast", severity="info"))  # neither its kind nor its severity: not sent
    n.submit(ev(kind="notify_failed", severity="critical"))  # never sent, whatever its severity
    n.close(5)
    assert [b["kind"] for b in receiver.bodies] == ["unguarded_container", "peer_unreachable"]
    assert n.stats.filtered == 2


def test_star_kinds_still_never_sends_notify_failed(receiver: Receiver) -> None:
    n = Notifier(NotifySettings(webhook_url=receiver.url, kinds=["*"], min_interval_s=0))
    n.submit(ev(kind="sampling_fast"))
    n.submit(ev(kind="notify_failed"))
    n.close(5)
    assert [b["kind"] for b in receiver.bodies] == ["sampling_fast"]


def test_rate_limit_per_kind_counts_and_mentions_suppressed(receiver: Receiver) -> None:
    now = [1000.0]
    n = Notifier(NotifySettings(webhook_url=receiver.url, min_interval_s=60), clock=lambda: now[0])
    for t in (0, 5, 10, 59):
        now[0] = 1000.0 + t
        n.submit(ev(kind="trip", message=f"trip at {t}"))
    n.submit(ev(kind="stopped"))  # another kind is not limited by "trip"
    now[0] = 1000.0 + 61
    n.submit(ev(kind="trip", message="trip at 61"))
    n.close(5)
    got = [(b["kind"], b["suppressed"], b["message"]) for b in receiver.bodies]
    assert got[0] == ("trip", 0, "trip at 0")
    assert got[1] == ("stopped", 0, "stopped sparkd-vllm: low_available")
    assert got[2][0:2] == ("trip", 3)
    assert got[2][2].startswith("trip at 61") and "3 earlier 'trip' notification(s) suppressed" in got[2][2]
    assert n.stats.suppressed == 3


def test_trips_while_the_model_is_down_collapse_whatever_their_figures(receiver: Receiver) -> None:
    """A rule that keeps holding after the guard stopped the model trips once per cooldown (60 s), each trip's
    message with its own figures: the identical-alert collapse (same kind and message) never held them, and an
    operator was paged about once a minute for as long as memory stayed short (helper-39's run). A trip's
    ``collapse_as`` (set by the guard for those trips only) makes them one alert per collapse window; a trip of
    a running model is never collapsed by it."""
    now = [1000.0]
    n = Notifier(NotifySettings(webhook_url=receiver.url, min_interval_s=0), clock=lambda: now[0])
    down = {"rule": "low_available", "collapse_as": "low_available holds while the model is stopped"}
    for t, gib in ((0, 2.1), (60, 2.0), (120, 1.9)):
        now[0] = 1000.0 + t
        n.submit(ev(kind="trip", severity="warning", message=f"low_available: MemAvailable {gib} GiB", details=down))
    now[0] = 1000.0 + 180  # a trip of the model running again: its own alert
    n.submit(ev(kind="trip", message="low_available: MemAvailable 1.8 GiB", details={"rule": "low_available"}))
    n.close(5)
    assert [b["message"] for b in receiver.bodies] == [
        "low_available: MemAvailable 2.1 GiB",
        "low_available: MemAvailable 1.8 GiB",
    ]
    assert n.stats.collapsed == 2


def test_a_warning_of_a_kind_never_holds_back_a_critical_one_by_the_rate_limit(receiver: Receiver) -> None:
    """A trip with the model down (warning: nothing to stop) was notified, and the critical trip of a model started
    by hand 2 s later fell to the per-kind rate limit (``min_interval_s``, 30 s): only counted on a next ``trip``
    notification that may never come (helper-40). A critical event is rate-limited only by critical ones of its
    kind."""
    now = [1000.0]
    n = Notifier(NotifySettings(webhook_url=receiver.url, min_interval_s=30), clock=lambda: now[0])
    down = {"rule": "low_available", "collapse_as": "low_available holds while the model is stopped"}
    n.submit(ev(kind="trip", severity="warning", message="low_available: 5.1 GiB; the model is stopped", details=down))
    now[0] += 2
    n.submit(ev(kind="trip", severity="critical", message="low_available: 4.2 GiB (started by hand)"))
    now[0] += 2
    n.submit(ev(kind="trip", severity="critical", message="low_available: 4.0 GiB"))  # critical within 30 s: held
    n.close(5)
    assert [b["message"] for b in receiver.bodies] == [
        "low_available: 5.1 GiB; the model is stopped",
        "low_available: 4.2 GiB (started by hand)",
    ]
    assert n.stats.suppressed_by_kind == {"trip/critical": 1}


def test_failure_reports_notify_failed_once_and_never_recurses(tmp_path: Path) -> None:
    """The daemon passes its event() as on_failure; event() feeds notify_hooks → submit."""
    events: list[dict[str, Any]] = []
    n: Notifier

    def daemon_event(kind: str, message: str, details: dict[str, Any]) -> None:
        e = {"ts": time.time(), "kind": kind, "severity": "warning", "message": message, "details": details}
        events.append(e)
        n.submit(e)  # what Daemon.event does through notify_hooks

    n = Notifier(
        NotifySettings(command=[sys.executable, "-c", "import sys; sys.exit(3)"], kinds=["*"], min_interval_s=0),
        on_failure=daemon_event,
    )
    n.submit(ev())
    assert wait_for(lambda: events)
    time.sleep(0.5)  # a recursion would show up as more failures by now
    n.close(5)
    assert [e["kind"] for e in events] == ["notify_failed"]
    assert "exited with status 3" in events[0]["message"]
    assert n.stats.failed == 1 and n.stats.sent == 0


def test_failure_goes_through_dispatch(tmp_path: Path) -> None:
    dispatched: list[Any] = []
    got: list[tuple[str, str, dict[str, Any]]] = []

    def dispatch(fn: Any) -> None:
        dispatched.append(fn)
        fn()

    n = Notifier(
        NotifySettings(command=["/nonexistent/sparkd-hook"], min_interval_s=0),
        on_failure=lambda *a: got.append(a),
        dispatch=dispatch,
    )
    n.submit(ev())
    n.close(5)
    assert len(dispatched) == 1 and got[0][0] == "notify_failed" and "cannot run" in got[0][1]


def test_full_queue_drops_counts_and_reports(receiver: Receiver) -> None:
    hang = HangingReceiver()
    failures: list[tuple[str, str, dict[str, Any]]] = []
    try:
        n = Notifier(
            NotifySettings(webhook_url=hang.url, timeout_s=0.5, retries=0, min_interval_s=0),
            on_failure=lambda *a: failures.append(a),
            queue_max=3,
        )
        for i in range(20):
            n.submit(ev(message=f"e{i}"))
        assert n.stats.dropped >= 16  # worker holds at most one, the queue 3
        assert wait_for(lambda: any(d.get("channel") == "queue" for _, _, d in failures), 10)
        n.close(0.5)
    finally:
        hang.close()


def test_disabled_notifier_has_no_thread() -> None:
    n = Notifier(NotifySettings())
    assert not n.enabled and n._thread is None
    n.submit(ev())
    assert n.close(1) == 0


def _guard_settings(tmp_path: Path, notify_settings: NotifySettings) -> Settings:
    return Settings(
        proc_root=str(PROC_WATERMARK),
        shm_dir=str(tmp_path),
        state_dir=str(tmp_path / "state"),
        notify=notify_settings,
        cooldown_s=0,
    )


def _tick_times(guard: Guard, notifier: Notifier, n: int) -> list[float]:
    """Guard.tick() plus what the daemon does with each decision (submit a 'trip' event)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = guard.tick()
        for d in result.decisions:
            notifier.submit({"ts": time.time(), "kind": "trip", "severity": "critical", "message": d.reason})
        out.append(time.perf_counter() - t0)
    return out


def test_hanging_webhook_delays_nothing(tmp_path: Path) -> None:
    hang = HangingReceiver()
    try:
        hung_cfg = NotifySettings(webhook_url=hang.url, timeout_s=30, retries=2, min_interval_s=0)
        hung = Notifier(hung_cfg)
        # submit() alone, while the worker is stuck on the receiver that never answers
        hung.submit(ev(kind="trip"))
        assert wait_for(lambda: hang.accepted >= 1, 5)
        durations = []
        for i in range(2000):
            t0 = time.perf_counter()
            hung.submit(ev(kind="trip", message=str(i)))
            durations.append(time.perf_counter() - t0)
        submit_median = statistics.median(durations)
        assert submit_median < 200e-6, f"submit median {submit_median * 1e6:.1f} µs"
        assert max(durations) < 0.05

        # the guard tick, with and without the hanging webhook, interleaved in rounds
        # so machine noise hits both sides alike; the fixture trips rules every 5 ticks
        plain = Notifier(NotifySettings())
        g_plain = Guard(_guard_settings(tmp_path, plain.settings))
        g_hung = Guard(_guard_settings(tmp_path, hung_cfg))
        _tick_times(g_plain, plain, 20)  # warm-up
        _tick_times(g_hung, hung, 20)
        base: list[float] = []
        with_hang: list[float] = []
        for _ in range(4):
            base += _tick_times(g_plain, plain, 50)
            with_hang += _tick_times(g_hung, hung, 50)
        assert len(base) == len(with_hang) == 200
        m_base, m_hang = statistics.median(base), statistics.median(with_hang)
        print(f"guard tick median: {m_base * 1e6:.0f} µs plain, {m_hang * 1e6:.0f} µs with hanging webhook")
        assert m_hang <= 2 * m_base + 200e-6, (m_base, m_hang)
        assert hung.stats.submitted >= 1 and hung.stats.sent == 0
        t0 = time.monotonic()
        hung.close(0.5)
        assert time.monotonic() - t0 < 2.0  # close is bounded, the hung request is abandoned
    finally:
        hang.close()


def test_submit_never_raises_on_odd_events(receiver: Receiver) -> None:
    n = Notifier(NotifySettings(webhook_url=receiver.url, kinds=["*"], min_interval_s=0))
    n.submit({"kind": "trip", "details": {"obj": object()}, "ts": None})
    n.submit({})  # no kind
    n.close(5)
    assert receiver.bodies[0]["kind"] == "trip" and "object" in json.dumps(receiver.bodies[0]["details"])


def test_close_rejects_later_events(receiver: Receiver) -> None:
    n = Notifier(NotifySettings(webhook_url=receiver.url, min_interval_s=0))
    n.close(1)
    n.submit(ev())
    assert n.stats.dropped == 1 and receiver.bodies == []


def test_payload_is_valid_json_env_even_with_nul() -> None:
    body = notify.payload(ev(message="a\x00b"), 0, host="h")
    env = notify.command_env(body, base={})
    assert env["SPARKD_EVENT_MESSAGE"] == "ab"
    assert "\x00" not in env["SPARKD_EVENT_JSON"]
    assert os.environ.get("SPARKD_EVENT_KIND") is None


def _trickling_server(head: bytes) -> int:
    """An HTTP server that sends ``head`` and then one byte every 0.4 s, for ever (each read within any timeout)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def handle(c: socket.socket) -> None:
        try:
            c.recv(65536)
            c.sendall(head)
            while True:
                time.sleep(0.4)
                c.sendall(b"x")
        except OSError:
            pass

    def serve() -> None:
        while True:
            c, _ = srv.accept()
            threading.Thread(target=handle, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return int(srv.getsockname()[1])


def test_a_webhook_that_trickles_its_answer_does_not_hold_the_alerts_behind_it() -> None:
    """``timeout_s`` is httpx's per read: a body trickled a byte every 0.4 s never timed out at 1 s, the one worker
    hung in that POST for ever, every later alert was dropped, and nothing said so (helper-43). The status is all a
    webhook's answer needs: the body is not read."""
    port = _trickling_server(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    n = Notifier(
        NotifySettings(webhook_url=f"http://127.0.0.1:{port}/hook", timeout_s=1.0, retries=0, min_interval_s=0)
    )
    for i in range(3):
        n.submit({"kind": "trip", "severity": "critical", "message": f"#{i}", "ts": time.time()})
    deadline = time.monotonic() + 10
    while n.stats.sent < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    n.close(1.0)
    assert n.stats.sent == 3 and n.stats.dropped == 0, n.stats


def test_a_send_that_never_ends_is_said_from_the_submitting_side() -> None:
    """A webhook that trickles its status line's headers keeps even a streamed request open: the worker cannot say
    so of itself (its drop reports ran on it), so the next alert submitted says it once (``notify_failed``)."""
    port = _trickling_server(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    said: list[str] = []
    n = Notifier(
        NotifySettings(webhook_url=f"http://127.0.0.1:{port}/hook", timeout_s=1.0, retries=0, min_interval_s=0),
        on_failure=lambda k, m, d: said.append(m),
    )
    n.stuck_after_s = lambda: 1.5  # type: ignore[method-assign]  # (a minute and more at the defaults)
    n.submit({"kind": "trip", "severity": "critical", "message": "first", "ts": time.time()})
    time.sleep(2.5)
    for i in range(3):
        n.submit({"kind": "trip", "severity": "critical", "message": f"#{i}", "ts": time.time()})
    n.close(0.5)
    assert len(said) == 1 and said[0].startswith("notifications are stuck: one send has not ended after"), said
