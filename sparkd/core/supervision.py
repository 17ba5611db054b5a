"""Pure decisions for running unattended: back-off, circuit breaker, stop intents, probe verdicts,
maintenance expiry, heartbeat content. No I/O, no clock reads: every ``now`` is passed in
(UTC epoch seconds for anything persisted, so it survives a restart of sparkd).

Where the numbers come from (CONTEXT.md, "What the operators learned later"; issue 15):

* back-off ``base_s × 2^(n−1)`` capped at ``cap_s`` (30 s doubling to 15 min), charged only after a
  failure — never before the first attempt (the source project added 30 s to every boot that way);
* the breaker opens at 3 emergencies inside 2 h and stays open until an operator re-arms it;
* the completion probe: 5 consecutive failures; ``/health`` 200 then means congestion, not death
  (a stop would throw away a working server under load);
* a maintenance window expires with an alert after 2 h so a forgotten drain cannot hold forever.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Literal


class StopIntent(StrEnum):
    """Why the model is down. One value at a time; ``None`` (no intent) means it should be serving.

    * ``operator``: an operator stopped it; held until an operator starts it (survives restarts);
    * ``maintenance``: a drain-and-relaunch window; expires with an alert (``maintenance_expired``);
    * ``emergency``: a rule, the hard floor or the completion probe stopped it; counts toward the breaker;
    * ``exited``: the container ended on its own;
    * ``failed_launch``: a launch did not reach ready;
    * ``peer_emergency``: the other node of a linked pair stopped in an emergency.
    """

    OPERATOR = "operator"
    MAINTENANCE = "maintenance"
    EMERGENCY = "emergency"
    EXITED = "exited"
    FAILED_LAUNCH = "failed_launch"
    PEER_EMERGENCY = "peer_emergency"


#: Intents after which sparkd may relaunch by itself (with back-off).
AUTOMATIC_INTENTS = frozenset({StopIntent.EMERGENCY, StopIntent.EXITED, StopIntent.FAILED_LAUNCH})


def intent_for(source: str) -> StopIntent:
    """A stop's intent from who asked (the ``source`` of a stop request): a rule, the hard floor or the probe
    → emergency; a peer (``peer:<name>``) → peer_emergency; ``maintenance`` → maintenance; a failed start-up
    → failed_launch; anyone else → operator."""
    if source.startswith(("rule ", "probe", "hard floor")):
        return StopIntent.EMERGENCY
    if source.startswith("peer:"):  # loop.cluster.accept_stop: the other node tripped
        return StopIntent.PEER_EMERGENCY
    if source.startswith("maintenance"):
        return StopIntent.MAINTENANCE
    if source.startswith("sparkd (failed launch"):
        return StopIntent.FAILED_LAUNCH
    return StopIntent.OPERATOR


EXITED_SOURCE = "nobody: the container exited on its own, or was stopped outside sparkd"
"""``requested by:`` of the postmortem of an exit nobody of sparkd's asked for (``RunBook.handle_exit``). It read
"sparkd", as a stop of the guard's would (helper-37); it is an incident all the same (``is_incident``)."""


def is_incident(source: str) -> bool:
    """Whether a stop requested by ``source`` is an incident, whose postmortem an operator reads afterwards: one
    sparkd or an alert decided (a rule, the probe, a peer's trip, an Alertmanager alert, a failed launch, a lost
    GPU, a rollback) rather than an operator's stop, restart or resize, a maintenance drain, or sparkd's own exit
    (``daemon``). Archive pruning removes the routine ones first (``act.archive.prune_archives``)."""
    if intent_for(source) in (StopIntent.EMERGENCY, StopIntent.PEER_EMERGENCY, StopIntent.FAILED_LAUNCH):
        return True
    # "(failed launch)": a maintenance run's relaunch that never became ready is one too (helper-54)
    return (
        source in ("sparkd", "alertmanager", EXITED_SOURCE)
        or source.startswith("sparkd (")
        or ("(failed launch)" in source)
    )


# ---------------------------------------------------------------------------------------------- back-off
@dataclass(frozen=True)
class BackoffPolicy:
    """Relaunch back-off. ``base_s`` (30), ``cap_s`` (900 = 15 min), ``stable_uptime_s``: a container that
    ran this long before ending starts the count again; ``max_failed_launches`` (3): consecutive launches
    that never reached ready before sparkd holds and alerts."""

    base_s: float = 30.0
    cap_s: float = 900.0
    stable_uptime_s: float = 600.0
    max_failed_launches: int = 3


def backoff_delay_s(policy: BackoffPolicy, failures: int) -> float:
    """Seconds to wait before relaunch number ``failures`` (1 = after the first failure).

    ``failures`` ≤ 0 → 0 (the first attempt is never delayed); else
    ``min(cap_s, base_s × 2^(failures−1))``.
    """
    if failures <= 0:
        return 0.0
    return float(min(policy.cap_s, policy.base_s * 2.0 ** min(failures - 1, 60)))


@dataclass(frozen=True)
class BackoffState:
    """Consecutive unplanned ends (``failures``) and consecutive failed launches."""

    failures: int = 0
    failed_launches: int = 0


def after_end(policy: BackoffPolicy, st: BackoffState, *, uptime_s: float | None, reached_ready: bool) -> BackoffState:
    """The count after one unplanned end of a launch.

    ``uptime_s``: how long the container ran (``None`` unknown = not stable). A run of at least
    ``stable_uptime_s`` resets the count before this failure is added; a launch that never reached
    ready adds to ``failed_launches``, one that did resets it.
    """
    stable = uptime_s is not None and uptime_s >= policy.stable_uptime_s
    base = BackoffState() if stable else st
    return BackoffState(
        failures=base.failures + 1,
        failed_launches=0 if reached_ready else base.failed_launches + 1,
    )


def after_stable(policy: BackoffPolicy, st: BackoffState, uptime_s: float) -> BackoffState:
    """Reset once a running container has been up ``stable_uptime_s``; unchanged before that."""
    return BackoffState() if uptime_s >= policy.stable_uptime_s else st


# ---------------------------------------------------------------------------------------------- breaker
@dataclass(frozen=True)
class BreakerPolicy:
    """``threshold`` (3) emergencies inside ``window_s`` (7200) open the breaker; while open an alert
    repeats every ``alert_every_s`` (1800); ``reset_on_boot`` re-arms it when the host booted less than
    ``boot_uptime_s`` (300) ago."""

    threshold: int = 3
    window_s: float = 7200.0
    alert_every_s: float = 1800.0
    reset_on_boot: bool = False
    boot_uptime_s: float = 300.0


@dataclass(frozen=True)
class Breaker:
    """Persisted breaker state. ``emergencies``: (epoch s, key) pairs inside the window, oldest first;
    the key (a launch id) makes one emergency count once however many paths report it."""

    emergencies: tuple[tuple[float, str], ...] = ()
    open_since: float | None = None
    last_alert_at: float | None = None
    rearmed_by: str | None = None
    rearmed_at: float | None = None

    @property
    def is_open(self) -> bool:
        return self.open_since is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "emergencies": [[t, k] for t, k in self.emergencies],
            "open_since": self.open_since,
            "last_alert_at": self.last_alert_at,
            "rearmed_by": self.rearmed_by,
            "rearmed_at": self.rearmed_at,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Breaker:
        return cls(
            emergencies=tuple((float(t), str(k)) for t, k in d.get("emergencies") or ()),
            open_since=d.get("open_since"),
            last_alert_at=d.get("last_alert_at"),
            rearmed_by=d.get("rearmed_by"),
            rearmed_at=d.get("rearmed_at"),
        )


def record_emergency(policy: BreakerPolicy, b: Breaker, *, now: float, key: str) -> tuple[Breaker, bool]:
    """Count one emergency; returns (breaker, opened_now).

    Entries older than ``window_s`` are dropped; a ``key`` already counted changes nothing. The breaker
    opens when the window holds ``threshold`` emergencies; once open it stays open until ``rearm``.
    """
    kept = tuple((t, k) for t, k in b.emergencies if now - t < policy.window_s)
    if any(k == key for _, k in kept):
        return replace(b, emergencies=kept), False
    kept = (*kept, (now, key))
    if b.is_open or len(kept) < policy.threshold:
        return replace(b, emergencies=kept), False
    return replace(b, emergencies=kept, open_since=now, last_alert_at=None), True


def breaker_count(policy: BreakerPolicy, b: Breaker, now: float) -> int:
    """Emergencies inside the window at ``now``."""
    return sum(1 for t, _ in b.emergencies if now - t < policy.window_s)


def breaker_alert_due(policy: BreakerPolicy, b: Breaker, now: float) -> bool:
    """True while open and no alert went out in the last ``alert_every_s`` (the first one at once)."""
    return b.is_open and (b.last_alert_at is None or now - b.last_alert_at >= policy.alert_every_s)


def rearm(b: Breaker, *, who: str, now: float) -> Breaker:
    """Close the breaker and forget the counted emergencies, recording who and when.

    Raises:
        ValueError: ``who`` is empty (a re-arm must name the operator).
    """
    if not who.strip():
        raise ValueError("who: '' is not allowed; allowed: the operator's name or token source")
    return Breaker(rearmed_by=who, rearmed_at=now)


def boot_reset(policy: BreakerPolicy, b: Breaker, *, host_uptime_s: float, now: float) -> Breaker:
    """Re-arm at start of sparkd when ``reset_on_boot`` and the host booted recently; else unchanged."""
    if policy.reset_on_boot and b.is_open and host_uptime_s < policy.boot_uptime_s:
        return rearm(b, who="host boot", now=now)
    return b


# ---------------------------------------------------------------------------------------------- relaunch
@dataclass(frozen=True)
class Relaunch:
    """A relaunch decision: ``relaunch`` after ``delay_s``, or ``hold``; ``alert`` asks for a critical
    event; ``intent`` is the intent the decision respected (every decision names it)."""

    action: Literal["relaunch", "hold"]
    delay_s: float
    intent: StopIntent | None
    reason: str
    alert: bool = False


def decide_relaunch(
    policy: BackoffPolicy,
    st: BackoffState,
    *,
    intent: StopIntent | None,
    breaker_open: bool,
    auto_restart: bool,
    guarded: bool = False,
) -> Relaunch:
    """Whether and when to relaunch after the model went down with ``intent``.

    Order: operator/maintenance/peer intents hold; ``guarded`` (guard mode: sparkd never starts the container)
    holds; an open breaker holds; ``auto_restart`` off holds;
    ``max_failed_launches`` consecutive failed launches hold with an alert; otherwise relaunch after
    ``backoff_delay_s(policy, st.failures)``.
    """
    name = intent.value if intent else "none"
    if intent in (StopIntent.OPERATOR, StopIntent.MAINTENANCE, StopIntent.PEER_EMERGENCY):
        return Relaunch("hold", 0.0, intent, f"intent {name}: held until released")
    if guarded:  # "container.auto_restart is off" read as if turning it on would relaunch it (helper-39)
        return Relaunch("hold", 0.0, intent, f"intent {name}: guard mode, sparkd never starts the container")
    if breaker_open:
        return Relaunch("hold", 0.0, intent, f"intent {name}: circuit breaker open, `sparkd rearm` to relaunch")
    if not auto_restart:
        return Relaunch("hold", 0.0, intent, f"intent {name}: container.auto_restart is off")
    if st.failed_launches >= policy.max_failed_launches:
        return Relaunch(
            "hold",
            0.0,
            intent,
            f"intent {name}: {st.failed_launches} consecutive failed launches (limit "
            f"{policy.max_failed_launches}); holding",
            alert=True,
        )
    delay = backoff_delay_s(policy, st.failures)
    return Relaunch("relaunch", delay, intent, f"intent {name}: relaunch #{st.failures} after {delay:g} s back-off")


# ---------------------------------------------------------------------------------------------- probe
@dataclass(frozen=True)
class ProbeVerdict:
    """One completion probe judged: ``ok``, ``error`` (why not), ``completion_tokens``, ``finish_reason``."""

    ok: bool
    error: str | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


def judge_completion(status_code: int | None, body: Any) -> ProbeVerdict:
    """Judge a ``/v1/completions`` or ``/v1/chat/completions`` answer.

    Passing needs HTTP 200, a JSON object with ``choices[0].finish_reason`` set and
    ``usage.completion_tokens > 0`` — ``/health`` 200 with empty completions is a known failure
    (issue 15).
    """
    if status_code != 200:
        return ProbeVerdict(False, f"HTTP {status_code}" if status_code is not None else "no answer")
    if not isinstance(body, dict):
        return ProbeVerdict(False, "answer is not a JSON object")
    choices = body.get("choices")
    finish = (
        choices[0].get("finish_reason")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict)
        else None
    )
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    n = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
    if not finish:
        return ProbeVerdict(False, "no finish_reason in choices[0]", n, None)
    if n is None or n <= 0:
        return ProbeVerdict(False, f"completion_tokens is {tokens!r}, needs > 0", n, str(finish))
    return ProbeVerdict(True, None, n, str(finish))


@dataclass(frozen=True)
class ProbePolicy:
    """``interval_s`` (60) between probes, ``failures`` (5) consecutive before acting,
    ``adopt_grace_s`` (300) after adopting a running container before the first probe."""

    interval_s: float = 60.0
    failures: int = 5
    adopt_grace_s: float = 300.0


def probe_skip_reason(
    policy: ProbePolicy,
    *,
    now_s: float,
    last_probe_s: float | None,
    ready: bool,
    startup_phase: str | None,
    requests_waiting: float | None,
    adopted_at_s: float | None,
) -> str | None:
    """``None`` when a probe is due now; else why not (times on one monotonic clock, seconds).

    Skipped: not ready; a start-up phase recorded in the launch record (weight load, graph capture);
    requests waiting in vLLM's queue (a probe would only queue behind them); inside the adoption grace;
    less than ``interval_s`` since the last probe.
    """
    if not ready:
        return "not ready"
    if startup_phase and startup_phase not in ("ready", "serving"):
        return f"start-up phase {startup_phase}"
    if requests_waiting:
        return f"{requests_waiting:g} requests waiting"
    if adopted_at_s is not None and now_s - adopted_at_s < policy.adopt_grace_s:
        return "adoption grace"
    if last_probe_s is not None and now_s - last_probe_s < policy.interval_s:
        return "not due"
    return None


ProbeOutcome = Literal["ok", "failing", "congestion", "emergency"]


def probe_outcome(policy: ProbePolicy, consecutive_failures: int, *, health_ok: bool) -> ProbeOutcome:
    """What ``consecutive_failures`` failed probes mean: under ``policy.failures`` → ``failing`` (0 →
    ``ok``); at the limit, ``/health`` 200 → ``congestion`` (alert, no stop), else ``emergency``."""
    if consecutive_failures <= 0:
        return "ok"
    if consecutive_failures < policy.failures:
        return "failing"
    return "congestion" if health_ok else "emergency"


# ---------------------------------------------------------------------------------------------- guard mode
#: ``guard_candidates``' limit: the running containers named as the likely model, at most.
GUARD_CANDIDATES_MAX = 3


def guard_candidates(
    name: str, running: Iterable[tuple[str, str, str]], *, limit: int = GUARD_CANDIDATES_MAX
) -> list[str]:
    """Running containers that may be the model ``container.guard = name`` meant, when no container has that name
    (``Supervisor`` says them with ``guard_target_missing``; the headline, the container card, ``sparkd status`` and
    ``sparkd doctor`` show them). ``running``: ``(id, name, image)`` of each running container (``docker ps``).

    Ranked: 1. docker compose's ``<project>-<service>-<n>`` for a service ``name`` (helper-44 saw ``h44-vllm``
    ranked before ``h44proj-vllm-1``); 2. a name that holds ``name`` or is held by it, case aside; 3. a name
    ``difflib`` finds close (ratio ≥ 0.6: a typo, ``vlm`` for ``vllm``); 4. an image that names vLLM
    (``vllm/vllm-openai``, NVIDIA's ``…/vllm``). Other containers are not named. A ``name`` that is an id (12 or
    more hex digits) ranks by the image alone. Returns ``"NAME (IMAGE)"`` strings, best first, at most ``limit``."""
    want = name.strip().lstrip("/").lower()
    if all(ch in "0123456789abcdef" for ch in want) and len(want) >= 12:
        want = ""  # an id (``container.guard`` takes one): its letters say nothing of a name
    ranked: list[tuple[int, str, str]] = []
    for _id, cname, image in running:
        low = cname.lstrip("/").lower()
        if want and re.fullmatch(rf".+[-_]{re.escape(want)}[-_]\d+", low):
            rank = 0  # docker compose's <project>-<service>-<n> (or v1's _): the service is the name meant
        elif want and (want in low or low in want):
            rank = 1
        elif want and difflib.SequenceMatcher(None, want, low).ratio() >= 0.6:
            rank = 2
        elif "vllm" in image.lower():
            rank = 3
        else:
            continue
        ranked.append((rank, cname.lstrip("/"), image))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [f"{n} ({image})" if image else n for _, n, image in ranked[:limit]]


#: Docker restart policies that start a container again after a ``docker stop`` — sparkd's stop — once dockerd
#: restarts (a reboot, a Docker upgrade). Docker's "Start containers automatically": ``always`` "If it's manually
#: stopped, it's restarted only when Docker daemon restarts"; ``unless-stopped`` is not, ``on-failure`` "doesn't
#: restart the container if the daemon restarts".
STOP_UNDOING_POLICIES = frozenset({"always"})


def restart_policy_risk(name: str, policy: str | None) -> str | None:
    """What the guarded container's Docker restart policy (``HostConfig.RestartPolicy.Name``) does to a stop by
    sparkd, when it undoes one: a sentence for the ``restart_policy_undoes_stop`` warning (at adoption), ``sparkd
    doctor`` and the event that says the container came back; None for a policy that keeps a stop
    (``no``, ``on-failure``, ``unless-stopped``, or not read). See ``STOP_UNDOING_POLICIES``."""
    if policy not in STOP_UNDOING_POLICIES:
        return None
    return (
        f"{name}'s Docker restart policy is '{policy}': after sparkd stops it on a trip, a dockerd restart or a "
        "reboot starts it again, maybe with memory still low (sparkd guards it again once it runs). "
        f"`docker update --restart unless-stopped {name}` keeps a stop and still restarts it after a crash"
    )


# ---------------------------------------------------------------------------------------------- intents
def of_this_run(at: float, run_started_at: float | None) -> bool:
    """Whether something recorded at ``at`` (epoch s: a stop intent, a stop event) can say why the run that started
    at ``run_started_at`` (Docker's start, epoch s; None: not known) is down: not when the run started after it (a
    guarded model started by hand after its emergency stop: guard mode never clears the intent; helper-36,
    helper-37). Read by ``Supervisor._stays_stopped``, ``ContainerStatus.down_because`` (the CLI, the container
    card), ``sparkd status``'s stop outcome and the dashboard's stopped card."""
    return run_started_at is None or at >= run_started_at


def who_and_reason(who: str, reason: str) -> str:
    """``<who>: <reason>``. A rule's trip reason begins with the rule's name, and ``who`` is ``rule <name>``: the name
    is said once ("rule repeated_dips: repeated_dips: usable …" before, helper-35)."""
    name = who[len("rule ") :] if who.startswith("rule ") else None
    if name and reason.startswith(f"{name}: "):
        reason = reason[len(name) + 2 :]
    return f"{who}: {reason}"


def intent_text(intent: StopIntent, who: str, reason: str) -> str:
    """``stop intent <intent> (<who>: <reason>)`` (``who_and_reason``)."""
    return f"stop intent {intent.value} ({who_and_reason(who, reason)})"


@dataclass(frozen=True)
class IntentRecord:
    """The current stop intent with when (epoch s), who and why; persisted."""

    intent: StopIntent
    since: float
    who: str
    reason: str
    expired_alerted: bool = False

    def describe(self) -> str:
        """``stop intent emergency (rule low_available: usable 3.00 GiB < 6.00 GiB for 4 s)``: the events' and the
        state reason's words for it (``intent_text``)."""
        return intent_text(self.intent, self.who, self.reason)

    def to_json(self) -> dict[str, Any]:
        return {
            "intent": self.intent.value,
            "since": self.since,
            "who": self.who,
            "reason": self.reason,
            "expired_alerted": self.expired_alerted,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> IntentRecord:
        return cls(
            StopIntent(d["intent"]), float(d["since"]), str(d["who"]), str(d["reason"]), bool(d.get("expired_alerted"))
        )


def maintenance_expired(rec: IntentRecord | None, *, now: float, max_s: float) -> bool:
    """True once for a maintenance intent older than ``max_s`` (7200) whose expiry was not alerted yet."""
    return (
        rec is not None
        and rec.intent is StopIntent.MAINTENANCE
        and not rec.expired_alerted
        and now - rec.since >= max_s
    )


# ---------------------------------------------------------------------------------------------- heartbeat
@dataclass(frozen=True)
class HeartbeatFigures:
    """What a daily heartbeat reports: sparkd uptime (s), restarts in the last day, breaker state,
    the day's minimum MemAvailable (bytes, ``None`` unknown), state-dir disk use (bytes), the intent."""

    uptime_s: float
    restarts_24h: int
    breaker_open: bool
    breaker_count: int
    min_mem_available_bytes: int | None
    state_dir_bytes: int
    container_state: str
    intent: str | None = None


#: A heartbeat recorded further than this in the future: the wall clock stepped back since (s).
HEARTBEAT_FUTURE_SLACK_S = 300.0


def heartbeat_due(last_sent: float | None, *, now: float, interval_s: float) -> bool:
    """True when no heartbeat was delivered yet or the last one is ``interval_s`` (86400) old (UTC epoch s: it
    survives a restart). A last one later than ``now`` by more than ``HEARTBEAT_FUTURE_SLACK_S`` is due too: the
    wall clock stepped back (a one-day step held the next heartbeat for ~48 h, helper-43)."""
    return last_sent is None or now - last_sent >= interval_s or last_sent - now > HEARTBEAT_FUTURE_SLACK_S


def heartbeat_message(f: HeartbeatFigures) -> str:
    """One line: ``sparkd heartbeat: up 3d 4h; container ready; 0 restarts in 24 h; breaker closed (0/3);
    min MemAvailable 12.3 GiB; state dir 1.2 GiB``."""
    days, rest = divmod(int(f.uptime_s), 86400)
    up = f"{days}d {rest // 3600}h" if days else f"{rest // 3600}h {rest % 3600 // 60}m"
    gib = 2**30
    mem = "unknown" if f.min_mem_available_bytes is None else f"{f.min_mem_available_bytes / gib:.1f} GiB"
    breaker = f"breaker {'OPEN' if f.breaker_open else 'closed'} ({f.breaker_count} emergencies in window)"
    intent = f" (intent {f.intent})" if f.intent else ""
    return (
        f"sparkd heartbeat: up {up}; container {f.container_state}{intent}; {f.restarts_24h} restarts in 24 h; "
        f"{breaker}; min MemAvailable {mem}; state dir {f.state_dir_bytes / gib:.2f} GiB"
    )


# ---------------------------------------------------------------------------------------------- alert collapse
@dataclass
class Collapse:
    """Identical alerts (same kind and message) collapse to one per ``window_s`` (900). A message counts
    as sent only after ``delivered`` is called; while one is in flight, copies are collapsed too.
    Mutable on purpose (the notifier holds one); the clock is passed in."""

    window_s: float = 900.0
    delivered_at: dict[tuple[str, str], float] = field(default_factory=dict)
    in_flight: set[tuple[str, str]] = field(default_factory=set)
    collapsed: dict[tuple[str, str], int] = field(default_factory=dict)

    def admit(self, key: tuple[str, str], now: float) -> bool:
        """True: send it (and mark in flight). False: collapsed (counted for the next send)."""
        last = self.delivered_at.get(key)
        if key in self.in_flight or (last is not None and now - last < self.window_s):
            self.collapsed[key] = self.collapsed.get(key, 0) + 1
            return False
        self.in_flight.add(key)
        return True

    def pending(self, key: tuple[str, str]) -> int:
        """Copies collapsed since the last delivery (to report with the next send)."""
        return self.collapsed.get(key, 0)

    def done(self, key: tuple[str, str], now: float, *, ok: bool, reported: int = 0) -> None:
        """The send ended. ``ok``: recorded as delivered at ``now`` and the ``reported`` copies are
        forgotten; a failed send is not counted as sent, so the next copy goes out and reports them."""
        self.in_flight.discard(key)
        if not ok:
            return
        self.delivered_at[key] = now
        left = self.collapsed.get(key, 0) - reported
        if left > 0:
            self.collapsed[key] = left
        else:
            self.collapsed.pop(key, None)


# ---------------------------------------------------------------------------------------------- schedule
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


def parse_schedule(text: str) -> tuple[int | None, int, int]:
    """``"Sun 04:00"`` → (6, 4, 0); ``"daily 04:00"`` → (None, 4, 0). Weekday 0 = Monday (``datetime``).

    Raises:
        ValueError: names the text and the allowed form.
    """
    allowed = 'allowed: "<Mon..Sun|daily> HH:MM" (local time), e.g. "Sun 04:00"'
    parts = text.strip().lower().split()
    if len(parts) != 2 or (parts[0][:3] not in WEEKDAYS and parts[0] != "daily"):
        raise ValueError(f"maintenance_schedule: {text!r} is not allowed; {allowed}")
    hh, _, mm = parts[1].partition(":")
    if not (hh.isdigit() and mm.isdigit() and int(hh) < 24 and int(mm) < 60):
        raise ValueError(f"maintenance_schedule: {text!r} is not allowed; {allowed}")
    day = None if parts[0] == "daily" else WEEKDAYS.index(parts[0][:3])
    return day, int(hh), int(mm)


def schedule_due(spec: tuple[int | None, int, int], *, last_run: datetime | None, now: datetime) -> bool:
    """True when the most recent scheduled time at or before ``now`` (local) is after ``last_run``
    (``None``: never ran — then only a time within the last hour counts, so starting sparkd on a Monday
    does not run Sunday's window)."""
    day, hh, mm = spec
    cand = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    if cand > now:
        cand -= timedelta(days=1)
    if day is not None:
        cand -= timedelta(days=(cand.weekday() - day) % 7)
    if last_run is None:
        return now - cand < timedelta(hours=1)
    return cand > last_run
