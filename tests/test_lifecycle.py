"""The container lifecycle as data (``sparkd.core.lifecycle``): every (state, observation class)
pair against a table written out here by hand, the effects that matter, and the committed
diagram equal to the generated one."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO

from sparkd.core.lifecycle import (
    EXAMPLES,
    ContainerState,
    EffectKind,
    ObsClass,
    Observation,
    Probe,
    Step,
    classify,
    main,
    mermaid,
    transition,
)

S = ContainerState
K = ObsClass
ALL = list(S)


def same(**over: S) -> dict[S, S]:
    """Every state stays where it is, except the ones named (``state_value=new``)."""
    return {s: over.get(s.value, s) for s in ALL}


def to(new: S, **over: S) -> dict[S, S]:
    """Every state goes to ``new``, except the ones named."""
    return {s: over.get(s.value, new) for s in ALL}


# The expected next state for each class, state by state. Written from the lifecycle's rules in
# words (docs/lifecycle.md), not computed from the module.
EXPECTED: dict[ObsClass, dict[S, S]] = {
    # the engine does not answer: nothing is known, the last state is kept
    K.ENGINE_DOWN: same(),
    # removed outside sparkd: forgotten, except while nothing is known or sparkd is stopping it
    K.GONE: to(S.NONE, stopping=S.STOPPING),
    # sparkd's stop procedure runs: stopping (there is nothing to stop without a container)
    K.STOP_REQUESTED: to(S.STOPPING, none=S.NONE),
    # sparkd launched it: starting, whatever came before
    K.LAUNCHED: to(S.STARTING),
    # Docker's restart policy cycles it: restarting (sparkd's own stop goes on)
    K.DOCKER_RESTARTING: to(S.RESTARTING, stopping=S.STOPPING),
    # running with a start time sparkd has not seen: adopted / started outside sparkd → starting;
    # while Docker restarts it (same RestartCount) it is the loop going on
    K.STARTED_ANEW: to(S.STARTING, stopping=S.STOPPING, restarting=S.RESTARTING),
    # not running: a running one has exited, sparkd's stop is done; already-down states stay
    K.EXITED: same(
        starting=S.EXITED,
        ready=S.EXITED,
        unhealthy=S.EXITED,
        restarting=S.EXITED,
        stopping=S.STOPPED,
        unknown=S.EXITED,
    ),
    # not ready within the start-up timeout: a starting launch failed; otherwise like /health failing
    K.STARTUP_EXPIRED: same(
        starting=S.FAILED,
        ready=S.UNHEALTHY,
        stopped=S.STARTING,
        exited=S.STARTING,
        none=S.STARTING,
        unknown=S.STARTING,
    ),
    # /health 200 with progress: ready; a container believed down but running is taken back
    K.HEALTHY: same(
        starting=S.READY,
        unhealthy=S.READY,
        restarting=S.READY,
        none=S.READY,
        unknown=S.READY,
        stopped=S.STARTING,
        exited=S.STARTING,
    ),
    # /health 200 but no progress: unhealthy once ready (a starting one becomes ready first)
    K.STALLED: same(
        starting=S.READY,
        ready=S.UNHEALTHY,
        none=S.UNHEALTHY,
        unknown=S.UNHEALTHY,
        stopped=S.STARTING,
        exited=S.STARTING,
    ),
    # /health failing: a ready one is unhealthy; starting stays starting
    K.FAILING: same(
        ready=S.UNHEALTHY,
        none=S.STARTING,
        unknown=S.STARTING,
        stopped=S.STARTING,
        exited=S.STARTING,
    ),
    # running, not probed this time: only a container believed down or unknown moves
    K.UNPROBED: same(none=S.STARTING, unknown=S.STARTING, stopped=S.STARTING, exited=S.STARTING),
}


def test_the_examples_cover_every_observation_class_and_classify_as_named() -> None:
    assert set(EXAMPLES) == set(ObsClass) == set(EXPECTED)
    for cls, obs in EXAMPLES.items():
        assert classify(obs) is cls


@pytest.mark.parametrize("state", ALL, ids=[s.value for s in ALL])
@pytest.mark.parametrize("cls", list(ObsClass), ids=[k.value for k in ObsClass])
def test_it_moves_every_state_for_every_observation_class_as_the_table_says(state: S, cls: ObsClass) -> None:
    step = transition(state, EXAMPLES[cls])
    assert step.state is EXPECTED[cls][state]
    if step.state is not state:
        assert step.reason, "a change of state says why (state_reason and its event)"


def test_a_container_started_by_hand_after_sparkd_stopped_it_is_adopted_with_an_event() -> None:
    obs = Observation(running=True, started_at=200.0, seen_started_at=100.0, seen_restart_count=0, name="vllm")
    step = transition(S.STOPPED, obs)
    assert step.state is S.STARTING
    kinds = [e.kind for e in step.effects]
    assert kinds == [EffectKind.ADOPT, EffectKind.EMIT]
    ev = step.effects[1]
    assert ev.event == "restarted_outside" and ev.severity == "warning"
    assert "vllm" in ev.message and "was stopped" in ev.message and "rules apply" in ev.message


def test_a_guarded_container_started_again_by_its_operator_is_said_without_a_warning() -> None:
    """Guard mode: sparkd tells the operator to start the container themselves; doing so was a warning (note 11)."""
    obs = Observation(
        running=True, started_at=200.0, seen_started_at=100.0, seen_restart_count=0, name="vllm", guarded=True
    )
    step = transition(S.STOPPED, obs)
    assert step.state is S.STARTING and [e.kind for e in step.effects] == [EffectKind.ADOPT, EffectKind.EMIT]
    ev = step.effects[1]
    assert ev.event == "restarted_outside" and ev.severity == "info"
    assert ev.message == "vllm was started again (it was stopped); guarding it again: rules apply"


@pytest.mark.parametrize(
    ("policy", "was", "warned"),
    [
        ("always", S.STOPPED, True),
        ("unless-stopped", S.STOPPED, False),
        ("always", S.EXITED, False),
        ("no", S.STOPPED, False),
    ],
)
def test_a_guarded_container_back_after_sparkds_stop_under_restart_policy_always_is_a_warning(
    policy: str, was: ContainerState, warned: bool
) -> None:
    """`always` starts a container again when dockerd restarts, after sparkd's `docker stop` (Docker's "Start
    containers automatically"); that was an info event, unnotified (helper-43)."""
    obs = Observation(
        running=True, started_at=200.0, seen_started_at=100.0, name="vllm", guarded=True, restart_policy=policy
    )
    ev = transition(was, obs).effects[1]
    assert ev.event == "restarted_outside" and (ev.severity == "warning") is warned
    assert ("by its restart policy 'always' when dockerd restarted" in ev.message) is warned, ev.message


def test_first_sight_of_a_running_container_is_adopted_not_restarted_outside() -> None:
    step = transition(S.NONE, Observation(running=True, started_at=5.0))
    assert step.state is S.STARTING
    assert [(e.kind, e.event) for e in step.effects] == [(EffectKind.ADOPT, "adopted")]


def test_a_docker_restart_is_counted_and_warned_about_once_naming_the_policy() -> None:
    obs = Observation(
        running=True,
        restart_count=3,
        seen_restart_count=1,
        started_at=9.0,
        seen_started_at=5.0,
        exit_code=1,
        restart_policy="unless-stopped",
        name="vllm",
    )
    step = transition(S.STARTING, obs)
    assert step.state is S.RESTARTING and "unless-stopped" in (step.reason or "")
    counts = [e.count for e in step.effects if e.kind is EffectKind.COUNT_RESTARTS]
    assert counts == [2]  # two restarts since the last look, not Docker's total
    warn = [e for e in step.effects if e.kind is EffectKind.EMIT]
    assert len(warn) == 1 and warn[0].severity == "warning" and warn[0].event == "restart_loop"
    assert "'unless-stopped'" in warn[0].message and "will stop it if a rule trips" in warn[0].message
    again = transition(S.RESTARTING, replace(obs, restart_count=4, seen_restart_count=3, restart_warned=True))
    assert again.state is S.RESTARTING
    assert [e.kind for e in again.effects] == [EffectKind.COUNT_RESTARTS] and again.effects[0].count == 1


def test_first_sight_of_a_restarting_container_adopts_it_and_counts_dockers_restarts() -> None:
    obs = Observation(running=True, restarting=True, restart_count=4, started_at=3.0, restart_policy="always")
    step = transition(S.NONE, obs)
    assert step.state is S.RESTARTING
    assert [e.kind for e in step.effects] == [EffectKind.ADOPT, EffectKind.COUNT_RESTARTS, EffectKind.EMIT]
    assert step.effects[0].event == "adopted" and step.effects[1].count == 4


def test_docker_running_while_it_waits_to_restart_is_restarting_not_running() -> None:
    # Docker reports Running=true during the restart back-off; State.Restarting tells the truth
    obs = Observation(running=True, restarting=True, restart_count=2, seen_restart_count=2, started_at=1.0)
    assert classify(replace(obs, seen_started_at=1.0)) is K.DOCKER_RESTARTING


def test_a_start_by_hand_that_resets_the_restart_count_is_started_anew_not_a_restart() -> None:
    obs = Observation(running=True, restart_count=0, seen_restart_count=5, started_at=9.0, seen_started_at=5.0)
    assert classify(obs) is K.STARTED_ANEW


def test_an_exit_of_a_running_container_records_the_exit_code() -> None:
    obs = Observation(running=False, exit_code=3, oom_killed=True, started_at=1.0, seen_started_at=1.0)
    step = transition(S.READY, obs)
    assert step.state is S.EXITED and step.reason == "exit code 3, OOMKilled=True"
    assert [e.kind for e in step.effects] == [EffectKind.RECORD_EXIT]


def test_gone_forgets_and_startup_timeout_stops() -> None:
    assert [e.kind for e in transition(S.READY, Observation(exists=False)).effects] == [EffectKind.FORGET]
    step = transition(S.STARTING, replace(EXAMPLES[K.STARTUP_EXPIRED], detail="not ready within 5 s"))
    assert step.state is S.FAILED and step.reason == "not ready within 5 s"
    assert [e.kind for e in step.effects] == [EffectKind.STOP]


def test_first_ready_marks_the_launch_ready_and_a_recovery_says_progress_resumed() -> None:
    assert [e.kind for e in transition(S.STARTING, EXAMPLES[K.HEALTHY]).effects] == [EffectKind.MARK_READY]
    assert transition(S.UNHEALTHY, EXAMPLES[K.HEALTHY]).reason == "recovered: /health answers and tokens progress"


def test_the_committed_diagram_is_the_generated_one() -> None:
    doc = (REPO / "docs" / "lifecycle.md").read_text()
    m = re.search(r"```mermaid\n(.*?)```", doc, re.S)
    assert m, "docs/lifecycle.md has no mermaid block"
    assert m.group(1) == mermaid(), "regenerate: python -m sparkd.core.lifecycle --mermaid"
    for s in ContainerState:
        if s is not S.UNKNOWN or "unknown -->" in m.group(1):
            assert f"{s.value} -->" in m.group(1) or f"--> {s.value}" in m.group(1)


def test_the_diagram_command_prints_it_and_refuses_other_arguments() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sparkd.core.lifecycle", "--mermaid"], capture_output=True, text=True, check=True
    )
    assert out.stdout == mermaid() and out.stdout.startswith("stateDiagram-v2\n")
    assert "stopped --> starting: launched / started_anew" in out.stdout
    assert main(["--svg"]) == 2


def test_probe_values_are_the_classes_of_a_running_container() -> None:
    running = Observation(running=True, started_at=1.0, seen_started_at=1.0)
    got = {p: classify(replace(running, probe=p)) for p in Probe}
    assert got == {Probe.OK: K.HEALTHY, Probe.STALLED: K.STALLED, Probe.FAILING: K.FAILING, Probe.UNPROBED: K.UNPROBED}


def test_a_restart_loop_starting_its_next_run_stays_restarting_but_a_start_by_hand_does_not() -> None:
    # Docker raised RestartCount to 4 when it scheduled the restart; the new run comes with 4 too
    nxt = Observation(running=True, restart_count=4, seen_restart_count=4, started_at=9.0, seen_started_at=5.0)
    assert classify(nxt) is K.STARTED_ANEW
    assert transition(S.RESTARTING, nxt).state is S.RESTARTING
    by_hand = replace(nxt, restart_count=0)  # docker start resets RestartCount
    step = transition(S.RESTARTING, by_hand)
    assert step.state is S.STARTING
    assert [e.event for e in step.effects if e.kind is EffectKind.EMIT] == ["restarted_outside"]


def test_a_run_that_was_ready_and_fails_health_when_sparkd_comes_back_is_unhealthy_not_starting() -> None:
    """Adopted after a restart of sparkd, a model that was ready (its launch record) and fails /health read "starting
    … adopted" for as long as that lasted (helper-37). It is unhealthy; a run that was never ready stays starting."""
    failing = replace(EXAMPLES[K.FAILING], was_ready=True, detail="HTTP 500")
    assert transition(S.STARTING, failing) == Step(S.UNHEALTHY, "/health: HTTP 500")
    assert transition(S.STARTING, replace(failing, was_ready=False)).state is S.STARTING
    assert transition(S.READY, failing).state is S.UNHEALTHY  # as before
    # the start-up timeout is the supervisor's to judge (it leaves startup_expired false for such a run): if set,
    # a starting run still fails as before
    assert transition(S.STARTING, replace(failing, startup_expired=True)).state is S.FAILED
