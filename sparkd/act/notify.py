"""Send chosen events out — a command and/or a webhook — without ever slowing the guard.

``Notifier.submit(event)`` is called on the guard's path (``Daemon.event`` →
``notify_hooks``). It only filters by kind and severity, applies the per-kind rate limit and
puts the event on a bounded ``queue.Queue``: a few microseconds, no I/O, never
blocks, never raises. One worker thread (``sparkd-notify``) does the sending,
so a hanging receiver or a slow command delays only other notifications.

Event shape (what ``Daemon.event`` builds; extra keys are passed through)::

    {"ts": 1717000000.5,            # epoch seconds (float)
     "kind": "stopped",             # event kind
     "severity": "critical",        # info | warning | error | critical
     "message": "…",                # one human line
     "details": {...} | None,       # JSON-able
     "launch_id": "…" | None}

Channels (``settings.notify``, ``config.NotifySettings``):

* ``command``: an argv list, executed directly (never through a shell), with
  the event in environment variables (``EVENT_ENV_VARS``); stdin is
  ``/dev/null``. It runs in its own process group; after ``timeout_s`` the whole
  group gets SIGKILL. A non-zero exit, a timeout or an exec error is a failure.
* ``webhook_url``: ``POST`` of the JSON payload (``payload()``), ``timeout_s``
  per attempt, up to ``retries`` more attempts after a connection error, a
  timeout, HTTP 408, 429 or 5xx, with exponential back-off (0.5 s, 1 s, 2 s, …
  capped at 8 s). Any other 4xx is final. Success is any 2xx.

Collapse: identical alerts (same kind and message) collapse to one per ``collapse_s`` (default 900 s,
``supervision.alert_collapse_s``), timed from the last *successful* delivery; a copy arriving while one
is in flight is collapsed too, a failed send is not counted as sent. Collapsed copies count as
suppressed and are reported with the next send. An event whose ``details`` carry ``collapse_as`` is
identical to the others of its kind with the same ``collapse_as``, whatever its message (a rule that
keeps tripping while the model is down: its figures change at every trip, the alert does not).

Rate limit: at most one notification per kind every ``min_interval_s``
seconds (both channels together); a critical event counts apart from the lesser ones of its kind (a warning
never holds back a critical one). Events inside the interval are *suppressed*
and counted; the next notification of that kind carries ``suppressed`` (the
count) and says so in its message.

Failures: every failed send calls ``on_failure("notify_failed", message,
details)`` (the daemon passes its ``event``). Kinds in ``NEVER_NOTIFIED``
(``notify_failed``) are never sent, so a failure report can never recurse.
``on_failure`` runs on the worker thread unless a ``dispatch`` is given (the
daemon passes ``loop.call_soon_threadsafe``, because ``Daemon.event`` writes to
an ``asyncio.Queue``, which is not thread-safe).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sparkd.config import NotifySettings
from sparkd.core.supervision import Collapse

if TYPE_CHECKING:  # httpx is imported where a webhook is sent: most hosts have none (issue 18: RSS)
    import httpx

log = logging.getLogger("sparkd.act.notify")

#: Kinds that are never sent, whatever ``notify.kinds`` says (no recursion).
NEVER_NOTIFIED = frozenset({"notify_failed"})

#: Environment variables a notify command receives (values are strings).
EVENT_ENV_VARS = (
    "SPARKD_EVENT_KIND",  # "stopped"
    "SPARKD_EVENT_SEVERITY",  # "critical"
    "SPARKD_EVENT_MESSAGE",  # the message, with the suppression note when any
    "SPARKD_EVENT_TS",  # epoch seconds, e.g. "1717000000.500"
    "SPARKD_EVENT_TS_ISO",  # "2024-05-29T16:26:40.500000+00:00"
    "SPARKD_EVENT_HOST",  # socket.gethostname()
    "SPARKD_EVENT_LAUNCH_ID",  # "" when none
    "SPARKD_EVENT_SUPPRESSED",  # events of this kind suppressed since the last send, "0" if none
    "SPARKD_EVENT_DETAILS",  # details as JSON ("null" when none)
    "SPARKD_EVENT_JSON",  # the whole payload as JSON (same as the webhook body)
)

#: Longest environment value passed to a command (Linux MAX_ARG_STRLEN is 128 KiB).
MAX_ENV_VALUE = 100_000

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
DEFAULT_QUEUE_MAX = 256

OnFailure = Callable[[str, str, dict[str, Any]], Any]
Dispatch = Callable[[Callable[[], Any]], Any]


@dataclass(slots=True)
class _Item:
    event: dict[str, Any]
    suppressed: int = 0
    collapsed: int = 0


@dataclass(slots=True)
class NotifyStats:
    """Counters since construction (read them for ``status``; not locked, monotone)."""

    submitted: int = 0  # accepted onto the queue
    filtered: int = 0  # kind not chosen, or in NEVER_NOTIFIED
    suppressed: int = 0  # rate-limited
    dropped: int = 0  # queue full, or submitted after close()
    sent: int = 0  # events delivered on every configured channel
    collapsed: int = 0  # identical (kind, message) to one delivered < collapse_s ago or in flight
    failed: int = 0  # channel sends that failed (after retries)
    suppressed_by_kind: dict[str, int] = field(default_factory=dict)  # pending, reported on the next send

    def to_json(self) -> dict[str, Any]:
        return {
            "submitted": self.submitted,
            "filtered": self.filtered,
            "suppressed": self.suppressed,
            "dropped": self.dropped,
            "sent": self.sent,
            "collapsed": self.collapsed,
            "failed": self.failed,
        }


def payload(event: Mapping[str, Any], suppressed: int = 0, *, host: str | None = None) -> dict[str, Any]:
    """The JSON body of a webhook (and ``SPARKD_EVENT_JSON``) for one event.

    Shape: ``{"source": "sparkd", "host", "kind", "severity", "message", "ts"
    (epoch s), "ts_iso", "launch_id", "details", "suppressed"}``; when
    ``suppressed`` > 0 the message ends with a note naming the count. Values that
    are not JSON-able are turned into strings (the result always serializes).
    """
    kind = str(event.get("kind", "unknown"))
    ts = float(event.get("ts") or time.time())
    message = str(event.get("message", ""))
    if suppressed:
        message += f" [{suppressed} earlier '{kind}' notification(s) suppressed by the rate limit]"
    body = {
        "source": "sparkd",
        "host": host or socket.gethostname(),
        "kind": kind,
        "severity": str(event.get("severity", "info")),
        "message": message,
        "ts": ts,
        "ts_iso": datetime.fromtimestamp(ts, UTC).isoformat(),
        "launch_id": event.get("launch_id"),
        "details": event.get("details"),
        "suppressed": suppressed,
    }
    out: dict[str, Any] = json.loads(json.dumps(body, default=str))  # JSON-safe copy
    return out


def command_env(body: Mapping[str, Any], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a notify command: ``base`` (default ``os.environ``) plus ``EVENT_ENV_VARS``."""
    env = dict(os.environ if base is None else base)
    js = json.dumps(body, default=str)
    values = {
        "SPARKD_EVENT_KIND": body["kind"],
        "SPARKD_EVENT_SEVERITY": body["severity"],
        "SPARKD_EVENT_MESSAGE": body["message"],
        "SPARKD_EVENT_TS": f"{body['ts']:.3f}",
        "SPARKD_EVENT_TS_ISO": body["ts_iso"],
        "SPARKD_EVENT_HOST": body["host"],
        "SPARKD_EVENT_LAUNCH_ID": body["launch_id"] or "",
        "SPARKD_EVENT_SUPPRESSED": str(body["suppressed"]),
        "SPARKD_EVENT_DETAILS": json.dumps(body["details"], default=str),
        "SPARKD_EVENT_JSON": js,
    }
    for k, v in values.items():
        env[k] = str(v).replace("\x00", "")[:MAX_ENV_VALUE]
    return env


class Notifier:
    """Bounded queue + one worker thread that runs the command and posts the webhook.

    Args:
        settings: ``NotifySettings`` — ``kinds`` (``"*"`` = every kind), ``severities`` (sent whatever the kind),
            ``command`` (argv), ``webhook_url``, ``timeout_s``, ``retries``,
            ``min_interval_s``. With neither a command nor a webhook the notifier
            is disabled: no thread, ``submit`` filters and returns.
        on_failure: ``(kind, message, details)``, called with kind
            ``"notify_failed"`` for each failed send and once for queue drops.
        dispatch: how ``on_failure`` is invoked (default: directly, on the
            worker thread); pass ``loop.call_soon_threadsafe`` from asyncio code.
        queue_max: bounded queue length; a full queue drops and counts.
        clock: monotonic clock for the rate limit (injectable in tests).
        transport: an ``httpx`` transport (tests: ``httpx.MockTransport``).
    """

    def __init__(
        self,
        settings: NotifySettings,
        *,
        on_failure: OnFailure | None = None,
        dispatch: Dispatch | None = None,
        queue_max: int = DEFAULT_QUEUE_MAX,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.BaseTransport | None = None,
        collapse_s: float = 900.0,
    ) -> None:
        self.settings = settings
        self.kinds = frozenset(settings.kinds)
        self.all_kinds = "*" in self.kinds
        self.severities = frozenset(settings.severities)
        self.on_failure = on_failure
        self.dispatch = dispatch
        self.clock = clock
        self.transport = transport
        self.stats = NotifyStats()
        self.host = socket.gethostname()
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=queue_max)
        self._lock = threading.Lock()  # rate-limit state (submit may come from several threads)
        self._busy_since: float | None = None  # the worker's send in progress began (monotonic s)
        self._stuck_said: float | None = None  # the stuck send already said (its _busy_since)
        self._last_sent: dict[str, float] = {}
        self.collapse = Collapse(window_s=collapse_s)
        self._closed = False
        self._abort = threading.Event()
        self._dropped_reported = 0
        self.enabled = bool(settings.command or settings.webhook_url)
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="sparkd-notify", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ guard side
    def wants(self, kind: str, severity: str | None = None) -> bool:
        """Is an event of ``kind`` and ``severity`` chosen for notification: its kind in ``notify.kinds`` or its
        severity in ``notify.severities``, and not in ``NEVER_NOTIFIED``?"""
        return kind not in NEVER_NOTIFIED and (self.all_kinds or kind in self.kinds or severity in self.severities)

    def submit(self, event: dict[str, Any]) -> None:
        """Queue ``event`` for sending. Never blocks, never raises, no I/O.

        Filtered (kind not chosen), rate-limited (counted for the next send),
        or dropped (queue full / closed, counted) events return just the same.
        """
        try:
            kind = str(event.get("kind", ""))
            if self._busy_since is not None and kind != "notify_failed":
                self._check_stuck()
            if not self.enabled or not self.wants(kind, str(event.get("severity", ""))):
                self.stats.filtered += 1
                return
            if self._closed:
                self.stats.dropped += 1
                return
            now = self.clock()
            details = event.get("details")
            same = details.get("collapse_as") if isinstance(details, dict) else None
            key = (kind, str(same if same else event.get("message", "")))
            with self._lock:
                if not self.collapse.admit(key, now):  # an identical alert was delivered or is in flight
                    self.stats.suppressed += 1
                    self.stats.collapsed += 1
                    return
                collapsed = self.collapse.pending(key)
                # a critical event has a rate of its own: a warning of its kind (a trip with the model down, nothing
                # to stop) held back the critical trip of a model started by hand 2 s later (helper-40)
                rate = f"{kind}/critical" if event.get("severity") == "critical" else kind
                last = self._last_sent.get(rate)
                if last is not None and now - last < self.settings.min_interval_s:
                    self.collapse.done(key, now, ok=False)
                    self.stats.suppressed += 1
                    self.stats.suppressed_by_kind[rate] = self.stats.suppressed_by_kind.get(rate, 0) + 1
                    return
                self._last_sent[rate] = now
                pending = self.stats.suppressed_by_kind.pop(rate, 0)
            try:
                self._queue.put_nowait(_Item(dict(event), pending + collapsed, collapsed))
                self.stats.submitted += 1
            except queue.Full:
                with self._lock:
                    self.collapse.done(key, now, ok=False)
                self.stats.dropped += 1
        except Exception:  # the guard path must never see a notifier error
            log.exception("notify: submit failed")

    __call__ = submit  # usable directly as a Daemon.notify_hooks entry

    def close(self, timeout_s: float = 5.0) -> int:
        """Stop accepting events, send what is queued until ``timeout_s``, then give up.

        Returns the number of queued events left unsent. Back-off waits end at
        once; a request or command already running is bounded by ``timeout_s``
        of the settings.
        """
        self._closed = True
        if self._thread is None:
            return 0
        deadline = time.monotonic() + max(0.0, timeout_s)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(0.2)
        return sum(1 for x in list(self._queue.queue) if x is not None)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        client: httpx.Client | None = None
        if self.settings.webhook_url:
            import httpx

            client = httpx.Client(timeout=self.settings.timeout_s, transport=self.transport)
        try:
            while not self._abort.is_set():
                try:
                    item = self._queue.get(timeout=0.5)
                except queue.Empty:
                    if self._closed:
                        break
                    continue
                if item is None:
                    if self._queue.empty():
                        break
                    continue  # close() raced with late items: drain them first
                self._report_drops()
                try:
                    self._send(item, client)
                except Exception as e:  # a bug here must not kill the worker
                    log.exception("notify: unexpected error")
                    self._failed("internal", item.event, f"unexpected error: {e}", {})
        finally:
            if client is not None:
                client.close()

    def _report_drops(self) -> None:
        dropped = self.stats.dropped
        if dropped > self._dropped_reported:
            n = dropped - self._dropped_reported
            self._dropped_reported = dropped
            self._call_failure(
                f"{n} notification(s) dropped: queue full ({self._queue.maxsize} items)",
                {"channel": "queue", "dropped": n, "dropped_total": dropped},
            )

    def _send(self, item: _Item, client: httpx.Client | None) -> None:
        self._busy_since = time.monotonic()
        try:
            self._send_one(item, client)
        finally:
            self._busy_since = None

    def stuck_after_s(self) -> float:
        """How long one send may take before it is said to be stuck (``submit``): each attempt's timeout with a
        margin, and the back-off between attempts."""
        attempts = self.settings.retries + 1
        return attempts * (2 * self.settings.timeout_s + 5.0) + attempts * BACKOFF_MAX_S

    def _check_stuck(self) -> None:
        """From the submitting side (the worker cannot say it of itself): a send that has not ended within
        ``stuck_after_s`` holds every later alert, and the drop reports too (they run on the worker). Said once per
        stuck send, through ``on_failure`` (``notify_failed``)."""
        since = self._busy_since
        if since is None or since == self._stuck_said or time.monotonic() - since < self.stuck_after_s():
            return
        self._stuck_said = since
        self._call_failure(
            f"notifications are stuck: one send has not ended after {time.monotonic() - since:.0f} s (a webhook or "
            f"command that does not finish); later alerts wait, and are dropped once {self._queue.maxsize} queue",
            {"channel": "worker", "stuck_s": round(time.monotonic() - since, 1), "queued": self._queue.qsize()},
        )

    def _send_one(self, item: _Item, client: httpx.Client | None) -> None:
        body = payload(item.event, item.suppressed, host=self.host)
        ok = True
        if self.settings.command:
            ok = self._run_command(body) and ok
        if client is not None and self.settings.webhook_url:
            ok = self._post(client, self.settings.webhook_url, body) and ok
        if ok:
            self.stats.sent += 1
        key = (str(item.event.get("kind", "")), str(item.event.get("message", "")))
        with self._lock:  # counted as sent only after a successful delivery
            self.collapse.done(key, self.clock(), ok=ok, reported=item.collapsed)

    def _run_command(self, body: dict[str, Any]) -> bool:
        argv = list(self.settings.command)
        timeout = self.settings.timeout_s
        try:
            proc = subprocess.Popen(
                argv,
                env=command_env(body),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own process group: a timeout kills the whole group
                close_fds=True,
            )
        except OSError as e:
            return self._failed("command", body, f"cannot run {argv[0]!r}: {e}", {"argv": argv})
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=2.0)
            return self._failed(
                "command",
                body,
                f"{argv[0]!r} did not finish within {timeout:g} s (process group killed)",
                {"argv": argv, "timeout_s": timeout},
            )
        if proc.returncode != 0:
            tail = (err or b"").decode("utf-8", "replace").strip()[-500:]
            return self._failed(
                "command",
                body,
                f"{argv[0]!r} exited with status {proc.returncode}" + (f": {tail}" if tail else ""),
                {"argv": argv, "returncode": proc.returncode, "stderr_tail": tail},
            )
        return True

    def _post(self, client: httpx.Client, url: str, body: dict[str, Any]) -> bool:
        import httpx

        attempts = self.settings.retries + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (attempt - 1))
                if self._abort.wait(delay):
                    last += " (aborted at shutdown)"
                    break
            try:
                # the status alone: the body is never read. httpx's timeout is per read, so an answer trickled a byte
                # at a time never timed out, and the one worker hung in it for ever (helper-43)
                with client.stream("POST", url, json=body, headers={"User-Agent": "sparkd-notify"}) as r:
                    status = r.status_code
            except httpx.TimeoutException:
                last = f"no answer within {self.settings.timeout_s:g} s"
                continue
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if 200 <= status < 300:
                return True
            last = f"HTTP {status}"
            if not (status >= 500 or status in (408, 429)):
                break
        return self._failed(
            "webhook",
            body,
            f"POST {_redact(url)} failed after {attempt + 1} attempt(s): {last}",
            {"url": _redact(url), "attempts": attempt + 1, "error": last},
        )

    def _failed(self, channel: str, event: Mapping[str, Any], what: str, details: dict[str, Any]) -> bool:
        self.stats.failed += 1
        kind = str(event.get("kind", "?"))
        message = f"notification of '{kind}' by {channel} failed: {what}"
        log.warning("%s", message)
        self._call_failure(message, {"channel": channel, "event_kind": kind, **details})
        return False

    def _call_failure(self, message: str, details: dict[str, Any]) -> None:
        cb = self.on_failure
        if cb is None:
            return

        def call() -> None:
            try:
                cb("notify_failed", message, details)
            except Exception:
                log.exception("notify: on_failure callback raised")

        try:
            if self.dispatch is not None:
                self.dispatch(call)
            else:
                call()
        except Exception:  # e.g. the event loop is already closed at shutdown
            log.warning("notify: cannot report failure: %s", message)


def _redact(url: str) -> str:
    """Scheme, host and port only: webhook URLs carry tokens in the path or query (Slack, Discord)."""
    import httpx

    try:
        u = httpx.URL(url)
    except Exception:
        return "<webhook>"
    port = f":{u.port}" if u.port else ""
    return f"{u.scheme}://{u.host}{port}/…"
