"""The supervisor's ping of the Docker engine (``Supervisor._engine_answers``), asked before every stop.

Against a hung engine each ping holds a worker thread for up to the API timeout (30 s). Trips and operators'
stops come every few seconds then: a ping still in flight is waited on again, never doubled. The engine here
is a stand-in whose ping blocks on an event (a hung engine is the slow, dangerous edge); the real engine hung
by SIGSTOP has its own end-to-end tests (``test_e2e_docker.py``: a trip, an operator's stop, a restart policy).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from sparkd.config import load_settings
from sparkd.loop import supervisor as supervisor_mod
from sparkd.loop.supervisor import Supervisor

pytestmark = pytest.mark.anyio


class HungEngine:
    """``ping`` blocks until ``answer`` is set, then answers True; counts the calls."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.calls = 0

    def ping(self) -> bool:
        self.calls += 1
        if not self.answer.wait(10.0):
            raise TimeoutError("the engine never answered")
        return True


async def test_a_ping_in_flight_is_waited_on_again_not_doubled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_mod, "EMERGENCY_PING_S", 0.2)
    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": {"guard": "sparkd-ping-test"}})
    engine = HungEngine()
    sup = Supervisor(settings, manager=engine)  # type: ignore[arg-type]
    threads_before = threading.active_count()
    # three callers while the engine hangs (a trip, then two operators' stops): no answer for any
    answers = [await sup._engine_answers() for _ in range(3)]
    answers += await asyncio.gather(sup._engine_answers(), sup._engine_answers())
    assert answers == [False] * 5
    assert engine.calls == 1, f"{engine.calls} pings for 5 questions: a thread each against a hung engine"
    assert threading.active_count() - threads_before <= 1
    # the engine answers: the ping in flight says so, and the next question asks again
    engine.answer.set()
    assert await sup._engine_answers() is True
    assert engine.calls == 1
    assert await sup._engine_answers() is True
    assert engine.calls == 2


async def test_an_engine_error_is_no_answer_and_the_next_question_asks_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor_mod, "EMERGENCY_PING_S", 0.5)
    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": {"guard": "sparkd-ping-test"}})

    class Refusing:
        calls = 0

        def ping(self) -> bool:
            Refusing.calls += 1
            raise ConnectionRefusedError("connection refused")

    sup = Supervisor(settings, manager=Refusing())  # type: ignore[arg-type]
    assert await sup._engine_answers() is False
    assert await sup._engine_answers() is False
    assert Refusing.calls == 2  # a failed ping is over: it is not reused
