"""ReadHold: the API reads no new request while an emergency stop gets its SIGTERM out (a real uvicorn server, real
sockets, sparkd's protocol). The end to end case, a flood of dashboard requests during a real trip, is
``test_e2e_docker::test_a_flood_of_dashboard_requests_does_not_hold_up_the_emergency_stop``."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvicorn

from sparkd.loop.httpserver import HttpStats, RateLimitedLog, ReadHold, guarded_protocol
from sparkd.loop.quietserver import QuietServer

GET = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


def _app(slow: asyncio.Event | None) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if scope["path"] == "/slow" and slow is not None:
            await slow.wait()
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    return app


async def _answer(reader: asyncio.StreamReader, within_s: float) -> bytes | None:
    """The body of the next answer on the connection, or None when none came within ``within_s``."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within_s)
    except TimeoutError:
        return None
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


def _run(
    body: Callable[[ReadHold, int, asyncio.Event], Awaitable[None]], header_timeout_s: float = 5.0
) -> tuple[ReadHold, HttpStats]:
    gate, stats = ReadHold(), HttpStats()

    async def go() -> None:
        slow = asyncio.Event()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        port = sock.getsockname()[1]
        proto = guarded_protocol(64, header_timeout_s, stats, RateLimitedLog(logging.getLogger("t")), gate)
        server = QuietServer(uvicorn.Config(_app(slow), log_level="warning", lifespan="off", http=proto))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            await body(gate, port, slow)
        finally:
            slow.set()
            server.should_exit = True
            await asyncio.wait_for(task, 5)

    asyncio.run(go())
    return gate, stats


def test_while_held_no_new_request_is_read_on_open_or_new_connections_and_each_is_answered_at_the_release() -> None:
    async def body(gate: ReadHold, port: int, slow: asyncio.Event) -> None:
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(GET)
        assert await _answer(r1, 2) == b"/x"  # a keep-alive connection, answered before the hold
        gate.hold()
        w1.write(GET)
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)  # a connection made while held
        w2.write(b"GET /y HTTP/1.1\r\nHost: t\r\n\r\n")
        assert await _answer(r1, 0.5) is None
        assert await _answer(r2, 0.1) is None
        gate.release_any()
        assert await _answer(r1, 2) == b"/x"
        assert await _answer(r2, 2) == b"/y"
        w1.write(GET)  # and it reads as before
        assert await _answer(r1, 2) == b"/x"
        for w in (w1, w2):
            w.close()

    gate, _ = _run(body)
    assert gate.holds == 1 and gate.held_requests == 2 and not gate.held


def test_a_request_under_way_when_the_hold_begins_is_answered_while_held() -> None:
    async def body(gate: ReadHold, port: int, slow: asyncio.Event) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.2)  # read and handed to the app, which waits
        gate.hold()
        slow.set()
        assert await _answer(r, 2) == b"/slow"
        assert gate.held
        gate.release_any()
        w.close()

    _run(body)


def test_a_hold_ends_by_itself_after_its_longest_time() -> None:
    async def body(gate: ReadHold, port: int, slow: asyncio.Event) -> None:
        gate.hold(max_s=0.4)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(GET)
        assert await _answer(r, 0.2) is None
        assert await _answer(r, 2) == b"/x"  # no release called
        assert not gate.held
        w.close()

    _run(body)


def test_a_request_head_kept_waiting_by_the_hold_is_not_closed_as_slow() -> None:
    async def body(gate: ReadHold, port: int, slow: asyncio.Event) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        gate.hold()
        w.write(GET)
        assert await _answer(r, 0.8) is None  # four head deadlines of 0.2 s
        gate.release_any()
        assert await _answer(r, 2) == b"/x"
        w.close()

    _, stats = _run(body, header_timeout_s=0.2)
    assert stats.head_timeouts == 0


def test_a_connection_closed_by_its_client_while_held_is_let_go_at_the_release() -> None:
    # its reading paused, the server learns of the close only when it reads again
    async def body(gate: ReadHold, port: int, slow: asyncio.Event) -> None:
        gate.hold()
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(GET)
        await asyncio.sleep(0.2)
        assert len(gate._waiting) == 1
        w.close()
        await asyncio.sleep(0.1)
        gate.release_any()
        await asyncio.sleep(0.2)
        assert not gate._waiting
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(GET)
        assert await _answer(r2, 2) == b"/x"
        w2.close()

    _run(body)


@pytest.mark.parametrize("twice", [False, True])
def test_hold_and_release_are_idempotent(twice: bool) -> None:
    async def go() -> ReadHold:
        gate = ReadHold()
        gate.hold(max_s=10)
        if twice:
            gate.hold(max_s=0.01)  # a hold already on keeps its deadline
            await asyncio.sleep(0.05)
            assert gate.held
        gate.release_any()
        gate.release_any()
        return gate

    gate = asyncio.run(go())
    assert not gate.held and gate.holds == 1


def test_what_a_connection_sends_while_held_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a connection sends while held is kept in sparkd's memory, during the very stop that memory is short for:
    reading pauses at the first read (one socket read at most is kept, however much the client sends), and a
    connection whose kept bytes would pass ``KEEP_MAX_BYTES`` (uvicorn resumed its reading) is closed."""
    from sparkd.loop import httpserver

    async def body(gate: ReadHold, port: int, slow: asyncio.Event) -> None:
        gate.hold()
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 9999999\r\n\r\n" + b"x" * 4_000_000)
        await asyncio.sleep(0.5)
        (proto,) = gate._waiting
        assert 0 < len(proto._kept) <= 256 * 1024, len(proto._kept)  # one read, not the 4 MB sent
        w.transport.abort()
        monkeypatch.setattr(httpserver, "KEEP_MAX_BYTES", 16)
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(GET)  # 29 bytes > 16: closed, nothing kept
        assert await asyncio.wait_for(r2.read(), 2) == b""
        assert gate._waiting == {proto}  # the closed one was not kept (the first waits: its close is unread)
        gate.release_any()

    _run(body)


def test_a_hold_is_ended_by_its_owner_or_by_a_sigterm_not_by_another_stops_clean_up() -> None:
    """Two emergency stops at once (a probe failure and a trip): the second finds the hold on and ends with
    ``trip_during_stop``; its clean-up must not end the first's hold before the first's SIGTERM (helper-34)."""

    async def go() -> list[bool]:
        gate, seen = ReadHold(), []
        first = gate.hold()
        second = gate.hold()
        assert first == 1 and second is None
        gate.release(second)  # the second stop's clean-up: not its hold
        seen.append(gate.held)
        gate.release(0)  # an older hold's number: not the one on
        seen.append(gate.held)
        gate.release_any()  # the SIGTERM is out: whatever hold is on ends
        seen.append(gate.held)
        third = gate.hold()
        gate.release(first)  # the first stop's late clean-up: the third hold stays
        seen.append(gate.held)
        gate.release(third)
        seen.append(gate.held)
        return seen

    assert asyncio.run(go()) == [True, True, False, True, False]


def test_connections_on_the_link_networks_sockets_are_never_held() -> None:
    """Peers call on ``cluster.listen``'s sockets only: a peer's stop request kept by the hold waited past its
    ``peer_timeout_s`` (3 s) and read as a critical ``peer_unreachable`` (helper-34). The daemon puts those sockets'
    addresses in ``ReadHold.exempt``; the dashboard's socket is held as before."""
    gate, stats = ReadHold(), HttpStats()

    async def go() -> None:
        socks = []
        for _ in range(2):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.bind(("127.0.0.1", 0))
            sock.listen(8)
            socks.append(sock)
        api_port, link_port = (s.getsockname()[1] for s in socks)
        gate.exempt = {("127.0.0.1", link_port)}
        proto = guarded_protocol(64, 5.0, stats, RateLimitedLog(logging.getLogger("t")), gate)
        server = QuietServer(uvicorn.Config(_app(None), log_level="warning", lifespan="off", http=proto))
        task = asyncio.create_task(server.serve(sockets=socks))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            gate.hold()
            r1, w1 = await asyncio.open_connection("127.0.0.1", api_port)
            r2, w2 = await asyncio.open_connection("127.0.0.1", link_port)
            w1.write(GET)
            w2.write(GET)
            assert await _answer(r2, 2) == b"/x"  # the peer's, at once
            assert await _answer(r1, 0.3) is None  # the dashboard's waits
            gate.release_any()
            assert await _answer(r1, 2) == b"/x"
            for w in (w1, w2):
                w.close()
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 5)

    asyncio.run(go())
