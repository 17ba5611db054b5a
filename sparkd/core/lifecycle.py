"""The serving container's lifecycle as data: one ``ContainerState``, an ``Observation`` of
what Docker says *now* (plus the few sparkd-side facts that matter), and a pure
``transition(state, observation) -> Step`` that the supervisor executes.

States (the values are what status, events, the API, the exporter and templates show):

* ``none``: no container known (monitor-only, or not launched yet);
* ``starting``: running, vLLM's ``/health`` not answering 200 yet;
* ``ready``: running and healthy;
* ``unhealthy``: running, but ``/health`` fails or no progress while requests wait;
* ``restarting``: Docker's restart policy is cycling it (Docker may even say running);
* ``stopping``: sparkd's stop procedure is under way;
* ``stopped``: stopped by sparkd (a rule, the hard floor or an operator);
* ``exited``: ended on its own (exit code recorded);
* ``failed``: a launch that did not reach ready;
* ``unknown``: the Docker engine does not answer (status shows it; the supervisor keeps the last state).

Each observation falls into one ``ObsClass`` (``classify``); the transition is a function of
(state, class), with the observation only filling in messages. ``python -m sparkd.core.lifecycle
--mermaid`` prints the state diagram generated from it (``docs/lifecycle.md`` holds it).

No I/O, no clock reads: times in an observation are Docker's (UTC epoch seconds) and compared,
never read here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from enum import StrEnum

from sparkd.core.supervision import STOP_UNDOING_POLICIES


class ContainerState(StrEnum):
    NONE = "none"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    EXITED = "exited"
    FAILED = "failed"
    UNKNOWN = "unknown"


RUNNING_STATES = frozenset({ContainerState.STARTING, ContainerState.READY, ContainerState.UNHEALTHY})
#: states in which Docker runs (or is about to run again) the container: a stop request applies
ACTIVE_STATES = RUNNING_STATES | {ContainerState.RESTARTING}
#: states in which the container is not running by sparkd's last observation
DOWN_STATES = frozenset({ContainerState.STOPPED, ContainerState.EXITED, ContainerState.FAILED})


class Probe(StrEnum):
    """sparkd's own probe of the running container (``sense.vllm_http``)."""

    UNPROBED = "unprobed"  # not probed in this observation
    OK = "ok"  # /health 200 and (when readable) token progress
    FAILING = "failing"  # /health not 200
    STALLED = "stalled"  # /health 200 but no token progress while requests wait, 3 polls in a row


@dataclass(frozen=True)
class Observation:
    """What Docker says now about the one container, plus sparkd-side facts.

    Docker's side (``docker inspect``: ``State`` and ``HostConfig.RestartPolicy``):
    ``exists`` (False: removed), ``running`` (``State.Running``; Docker says True while it waits
    to restart), ``restarting`` (``State.Restarting``), ``exit_code``, ``oom_killed``,
    ``restart_count`` (``RestartCount``: restarts done by the restart policy),
    ``started_at`` (``State.StartedAt``, UTC epoch seconds, None when never started),
    ``docker_health`` (``State.Health.Status`` when the image has a HEALTHCHECK),
    ``restart_policy`` (``HostConfig.RestartPolicy.Name``: ``no``, ``always``,
    ``unless-stopped``, ``on-failure``).

    sparkd's side: ``engine_up`` (False: the engine did not answer; nothing else is known),
    ``stopping`` (sparkd's stop procedure is under way), ``launched`` (sparkd itself just
    started this container), ``probe`` (the /health and progress probe), ``startup_expired``
    (still not ready ``container.startup_timeout_s`` after the launch), ``seen_started_at`` and
    ``seen_restart_count`` (the start time and restart count sparkd recorded last; None: never
    seen), ``restart_warned`` (the restart-policy warning was given for this container),
    ``guarded`` (guard mode: sparkd never starts it, so a start outside sparkd is how it runs, not a warning),
    ``auto_remove`` (``docker run --rm``: its removal after an exit is Docker's own),
    ``was_ready`` (this run was /health-ready before: its launch record says so, when sparkd comes back beside it; a
    failing /health is then ``unhealthy``, not a start-up that has not finished),
    ``name``, ``detail`` (the probe's error or stall description, for messages).
    """

    exists: bool = True
    running: bool = False
    restarting: bool = False
    exit_code: int | None = None
    oom_killed: bool = False
    restart_count: int = 0
    started_at: float | None = None
    docker_health: str | None = None
    restart_policy: str | None = None
    engine_up: bool = True
    stopping: bool = False
    launched: bool = False
    probe: Probe = Probe.UNPROBED
    startup_expired: bool = False
    seen_started_at: float | None = None
    seen_restart_count: int | None = None
    restart_warned: bool = False
    guarded: bool = False
    was_ready: bool = False
    auto_remove: bool = False  # ``HostConfig.AutoRemove`` (`docker run --rm`): Docker removes it after any exit
    name: str = "container"
    detail: str | None = None

    @property
    def new_restarts(self) -> int:
        """Restarts Docker did since sparkd last looked (all of ``restart_count`` on first sight)."""
        return max(0, self.restart_count - (self.seen_restart_count or 0))


class ObsClass(StrEnum):
    """The kinds of observation the transition distinguishes (``classify``), in priority order."""

    ENGINE_DOWN = "engine_down"  # the engine does not answer
    GONE = "gone"  # the container no longer exists
    STOP_REQUESTED = "stop_requested"  # sparkd's stop procedure is under way
    LAUNCHED = "launched"  # sparkd just launched it
    DOCKER_RESTARTING = "docker_restarting"  # State.Restarting, or RestartCount grew
    STARTED_ANEW = "started_anew"  # running with a start time sparkd has not seen: started outside sparkd
    EXITED = "exited"  # not running
    STARTUP_EXPIRED = "startup_expired"  # running, /health failing past the start-up timeout
    HEALTHY = "healthy"  # running, probe ok
    STALLED = "stalled"  # running, /health ok but no progress
    FAILING = "failing"  # running, /health failing
    UNPROBED = "unprobed"  # running, not probed


def classify(obs: Observation) -> ObsClass:
    """The one class of ``obs``; the first that applies in ``ObsClass`` order."""
    if not obs.engine_up:
        return ObsClass.ENGINE_DOWN
    if not obs.exists:
        return ObsClass.GONE
    if obs.stopping:
        return ObsClass.STOP_REQUESTED
    if obs.launched:
        return ObsClass.LAUNCHED
    if obs.restarting or obs.new_restarts > 0:
        return ObsClass.DOCKER_RESTARTING
    if not obs.running:
        return ObsClass.EXITED
    if obs.started_at != obs.seen_started_at:
        return ObsClass.STARTED_ANEW
    if obs.startup_expired and obs.probe is not Probe.OK:
        return ObsClass.STARTUP_EXPIRED
    return {
        Probe.OK: ObsClass.HEALTHY,
        Probe.STALLED: ObsClass.STALLED,
        Probe.FAILING: ObsClass.FAILING,
        Probe.UNPROBED: ObsClass.UNPROBED,
    }[obs.probe]


class EffectKind(StrEnum):
    """What the supervisor does besides moving the state."""

    EMIT = "emit"  # record event ``event`` (kind) with ``message`` and ``severity``
    ADOPT = "adopt"  # take this run as the guarded one: its start time (the /dev/shm age test), logs, rules
    COUNT_RESTARTS = "count_restarts"  # ``count`` restarts Docker did since the last look
    RECORD_EXIT = "record_exit"  # ended on its own: launch record, postmortem, then maybe auto-restart
    MARK_READY = "mark_ready"  # first /health 200 of this run: the ``ready`` event and launch record
    FORGET = "forget"  # removed outside sparkd: drop the container id
    STOP = "stop"  # stop it (a launch that never became ready)


@dataclass(frozen=True)
class Effect:
    kind: EffectKind
    event: str | None = None
    message: str = ""
    severity: str = "info"
    count: int = 0


@dataclass(frozen=True)
class Step:
    """The result of one transition: the new state, why (for ``state_reason``; None: unchanged),
    and the effects in the order the supervisor runs them. When ``state`` differs from the old
    state the supervisor records one ``container_<state>`` event with ``reason``."""

    state: ContainerState
    reason: str | None = None
    effects: tuple[Effect, ...] = field(default_factory=tuple)


S = ContainerState
K = ObsClass


def _emit(event: str, message: str, severity: str = "info") -> Effect:
    return Effect(EffectKind.EMIT, event=event, message=message, severity=severity)


def _restarting(state: ContainerState, obs: Observation) -> Step:
    effects: list[Effect] = []
    if state in (S.NONE, S.UNKNOWN) or obs.seen_started_at is None:
        effects.append(Effect(EffectKind.ADOPT, event="adopted"))  # first sight
    if obs.new_restarts:
        effects.append(Effect(EffectKind.COUNT_RESTARTS, count=obs.new_restarts))
    if not obs.restart_warned:
        policy = obs.restart_policy or "unknown"
        effects.append(
            _emit(
                "restart_loop",
                f"{obs.name} is being restarted by Docker's restart policy '{policy}' "
                f"(RestartCount {obs.restart_count}"
                + (f", last exit code {obs.exit_code}" if obs.exit_code else "")
                + "); sparkd counts the restarts and will stop it if a rule trips",
                "warning",
            )
        )
    return Step(S.RESTARTING, f"Docker restart policy '{obs.restart_policy or 'unknown'}'", tuple(effects))


def _started_anew(state: ContainerState, obs: Observation) -> Step:
    if state in (S.NONE, S.UNKNOWN):
        return Step(S.STARTING, "adopted", (Effect(EffectKind.ADOPT, event="adopted"),))
    was = state.value
    # guard mode: sparkd tells the operator to start it themselves; doing so is no warning (note 11)
    said = "started again" if obs.guarded else "started outside sparkd"
    severity = "info" if obs.guarded else "warning"
    by = ""
    if state is S.STOPPED and obs.restart_policy in STOP_UNDOING_POLICIES:
        # after sparkd's stop: a dockerd restart or a reboot starts an `always` container again, unasked (helper-43)
        by = f" — by hand, or by its restart policy '{obs.restart_policy}' when dockerd restarted"
        severity = "warning"
    return Step(
        S.STARTING,
        f"{said} (was {was})",
        (
            Effect(EffectKind.ADOPT),
            _emit(
                "restarted_outside",
                f"{obs.name} was {said} (it was {was}){by}; guarding it again: rules apply",
                severity,
            ),
        ),
    )


def _running(state: ContainerState, k: ObsClass, obs: Observation) -> Step:
    """Running, same start time as sparkd saw last: the probe decides."""
    if state in (S.STOPPED, S.EXITED):  # Docker runs what sparkd believed down: Docker is right
        return _started_anew(state, obs)
    if state in (S.FAILED, S.STOPPING):  # a stop is on its way
        return Step(state)
    if state is S.RESTARTING and k is not K.HEALTHY:
        return Step(state)
    if k is K.HEALTHY:
        if state is S.READY:
            return Step(state)
        if state is S.UNHEALTHY:
            # after a failing /health too, not only a stall: "progress resumed" said only the latter (helper-39)
            return Step(S.READY, "recovered: /health answers and tokens progress")
        return Step(S.READY, "/health ready", (Effect(EffectKind.MARK_READY),))
    if k is K.STALLED:
        if state is S.STARTING:  # /health answers: ready first, the stall counts from there
            return Step(S.READY, "/health ready", (Effect(EffectKind.MARK_READY),))
        return Step(S.UNHEALTHY, obs.detail or "no token progress") if state is not S.UNHEALTHY else Step(state)
    if k is K.FAILING and (state is S.READY or (state is S.STARTING and obs.was_ready)):
        # a run adopted as "starting" that was ready before sparkd came back: read "starting … adopted" for as long
        # as /health failed, and the completion probe (ready or unhealthy only) never ran again (helper-37)
        return Step(S.UNHEALTHY, f"/health: {obs.detail}")
    if state in (S.NONE, S.UNKNOWN):
        return Step(S.STARTING, "adopted")
    return Step(state)


def transition(state: ContainerState, obs: Observation) -> Step:
    """The next state and effects for ``obs`` seen in ``state``. Pure; total over every
    (state, ``classify(obs)``) pair (``tests/test_lifecycle.py`` walks them all)."""
    k = classify(obs)
    if k is K.ENGINE_DOWN:
        return Step(state)  # nothing is known: keep the last state (status shows the engine down)
    if k is K.GONE:
        if state in (S.NONE, S.STOPPING):
            return Step(state)
        why = "container removed outside sparkd"
        if obs.auto_remove:  # `docker run --rm`: Docker's own removal after an exit, nobody's by hand (helper-55)
            why = (
                "exited and removed by Docker (docker run --rm)"
                if state in ACTIVE_STATES
                else "removed by Docker after its exit (docker run --rm)"
            )
        return Step(S.NONE, why, (Effect(EffectKind.FORGET),))
    if k is K.STOP_REQUESTED:
        return Step(state) if state is S.NONE else Step(S.STOPPING, obs.detail or "stop requested")
    if k is K.LAUNCHED:
        return Step(S.STARTING, obs.detail or "launched by sparkd")
    if k is K.DOCKER_RESTARTING:
        return Step(state) if state is S.STOPPING else _restarting(state, obs)
    if k is K.EXITED:
        if state is S.STOPPING:
            return Step(S.STOPPED, obs.detail or f"stopped by sparkd (exit code {obs.exit_code})")
        if state in ACTIVE_STATES:
            how = f"exit code {obs.exit_code}, OOMKilled={obs.oom_killed}"
            return Step(S.EXITED, how, (Effect(EffectKind.RECORD_EXIT, message=how),))
        if state is S.UNKNOWN:
            return Step(S.EXITED, f"exit code {obs.exit_code}")
        return Step(state)
    if k is K.STARTED_ANEW:
        if state is S.STOPPING:
            return Step(state)
        if state is S.RESTARTING and obs.restart_count >= (obs.seen_restart_count or 0):
            # Docker counts a restart when it schedules it; the new start comes with the same count.
            # A start by hand resets the count (docker start → RestartCount 0).
            return Step(state)
        return _started_anew(state, obs)
    if k is K.STARTUP_EXPIRED:
        if state is S.STARTING:
            why = obs.detail or "not ready in time"
            return Step(S.FAILED, why, (Effect(EffectKind.STOP, message=why),))
        return _running(state, K.FAILING, obs)
    return _running(state, k, obs)


#: one observation of each class, for the table test and the diagram
EXAMPLES: dict[ObsClass, Observation] = {
    K.ENGINE_DOWN: Observation(engine_up=False),
    K.GONE: Observation(exists=False),
    K.STOP_REQUESTED: Observation(running=True, stopping=True, started_at=1.0, seen_started_at=1.0),
    K.LAUNCHED: Observation(running=True, launched=True, started_at=2.0, seen_started_at=1.0),
    K.DOCKER_RESTARTING: Observation(
        running=True,
        restarting=True,
        restart_count=3,
        seen_restart_count=2,
        exit_code=1,
        started_at=1.0,
        seen_started_at=1.0,
        restart_policy="unless-stopped",
    ),
    K.STARTED_ANEW: Observation(running=True, started_at=2.0, seen_started_at=1.0, seen_restart_count=0),
    K.EXITED: Observation(running=False, exit_code=1, started_at=1.0, seen_started_at=1.0, seen_restart_count=0),
    K.STARTUP_EXPIRED: Observation(
        running=True,
        started_at=1.0,
        seen_started_at=1.0,
        seen_restart_count=0,
        probe=Probe.FAILING,
        startup_expired=True,
    ),
    **{
        cls: Observation(running=True, started_at=1.0, seen_started_at=1.0, seen_restart_count=0, probe=p)
        for cls, p in (
            (K.HEALTHY, Probe.OK),
            (K.STALLED, Probe.STALLED),
            (K.FAILING, Probe.FAILING),
            (K.UNPROBED, Probe.UNPROBED),
        )
    },
}


def edges() -> list[tuple[ContainerState, ObsClass, ContainerState, tuple[EffectKind, ...]]]:
    """Every (state, class) → (new state, effect kinds) of ``transition`` over ``EXAMPLES``."""
    out = []
    for s in ContainerState:
        for k, obs in EXAMPLES.items():
            step = transition(s, replace(obs, restart_warned=False))
            out.append((s, k, step.state, tuple(e.kind for e in step.effects)))
    return out


def mermaid() -> str:
    """The state diagram (Mermaid ``stateDiagram-v2``) of the changes of state in ``edges()``;
    arcs between the same two states are merged, their classes joined with ``/``."""
    arcs: dict[tuple[ContainerState, ContainerState], list[str]] = {}
    for s, k, new, _eff in edges():
        if new is not s:
            arcs.setdefault((s, new), []).append(k.value)
    lines = ["stateDiagram-v2", "    [*] --> none"]
    for (s, new), ks in arcs.items():
        lines.append(f"    {s.value} --> {new.value}: {' / '.join(ks)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["--mermaid"]:
        print("usage: python -m sparkd.core.lifecycle --mermaid", file=sys.stderr)
        return 2
    sys.stdout.write(mermaid())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
