"""Two Sparks as one, on one machine: two real sparkd daemons with peers over loopback addresses,
two test containers on the real Docker engine.

Node addresses: each daemon's API listens on 127.0.0.1 (its own port) and on a link
address of its own (127.0.0.2 for the worker, 127.0.0.3 for the head), as the ConnectX-7
link network would give; each calls its peer from its link address.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fvhelpers import free_port, wait_for
from sparkdapi import SparkdUnderTest

from sparkd.config import ClusterSettings, PeerSettings
from sparkd.loop.cluster import Cluster

pytest_plugins = ["dockerkit"]

WORKER_LINK, HEAD_LINK = "127.0.0.2", "127.0.0.3"
HIGH = "MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n"
LOW = "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 5242880 kB\n"  # 5 GiB: < 6, above the hard floor


def _cluster_toml(node: str, role: str, link: str, peer: str, peer_link: str, peer_port: int, token: Path) -> str:
    return (
        f'[cluster]\nnode = "{node}"\nrole = "{role}"\nlisten = ["{link}"]\npeer_timeout_s = 2.0\n'
        "worker_start_delay_s = 0.5\n"
        f'[[cluster.peers]]\nname = "{peer}"\nurl = "http://{peer_link}:{peer_port}"\ntoken_file = "{token}"\n'
    )


@pytest.fixture
def pair(tmp_path: Path, image: str, case_labels: dict[str, str], launcher: Any) -> Any:
    # ``launcher``: its finalizer removes every container carrying this test's case label (the daemons'
    # managed containers here), after the daemons stop
    """(worker, head): the worker reads a scripted /proc (``pair.low()`` makes it trip; the head reads the
    real one, with a rule that cannot trip here)."""
    token = tmp_path / "pair.token"
    token.write_text("pair-secret-0123456789abcdef\n")
    token.chmod(0o600)
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(HIGH)
    made = []
    for name in ("worker", "head"):
        (tmp_path / name).mkdir()
    wport, hport = free_port(), free_port()
    worker = SparkdUnderTest(
        tmp_path / "worker",
        image,
        case_labels,
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 3}],
        top={"proc_root": str(proc)},
        container={
            "name": f"sparkd-test-{case_labels['sparkd.test.case']}-w",
            "selector": {**case_labels, "node": "w"},
        },
        extra_toml=_cluster_toml("spark-w", "worker", WORKER_LINK, "spark-h", HEAD_LINK, hport, token),
    )
    head = SparkdUnderTest(
        tmp_path / "head",
        image,
        case_labels,
        rules=[{"name": "low_available", "when": ["MemAvailable < 64MiB"], "samples": 3}],
        container={
            "name": f"sparkd-test-{case_labels['sparkd.test.case']}-h",
            "selector": {**case_labels, "node": "h"},
        },
        extra_toml=_cluster_toml("spark-h", "head", HEAD_LINK, "spark-w", WORKER_LINK, wport, token),
    )
    worker.api_port, head.api_port = wport, hport  # the peers' URLs name these ports
    _set_port(worker, wport)
    _set_port(head, hport)
    made += [worker, head]
    yield worker, head
    for s in made:
        s.stop()


def _launch_pair(worker: SparkdUnderTest, head: SparkdUnderTest) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start both daemons, then the coordinated launch from the head; both containers ready."""
    worker.start()
    head.start()
    r = head.api("POST", "/api/cluster/start")
    assert r.status_code == 200, r.text
    return worker.wait_state("ready", 60), head.wait_state("ready", 60)


def _set_port(s: SparkdUnderTest, port: int) -> None:
    lines = s.config.read_text().splitlines()
    i = lines.index("[api]")
    lines[i + 1] = f"port = {port}"
    s.config.write_text("\n".join(lines) + "\n")


def test_a_trip_on_the_worker_stops_both_gracefully_at_once(pair: Any, docker_client: Any) -> None:
    worker, head = pair
    wc, hc = _launch_pair(worker, head)
    (worker.tmp.parent / "proc" / "meminfo").write_text(LOW)  # the worker's host runs low: its rule trips
    worker.wait_event("trip", 30)
    w_stop = worker.wait_event("stopped", 60)
    h_stop = head.wait_event("stopped", 60)
    w_stopping, h_stopping = worker.events("stopping")[-1], head.events("stopping")[-1]
    # both stops started within 1 s of each other (the head did not wait for the worker's stop)
    assert abs(w_stopping["ts"] - h_stopping["ts"]) < 1.0, (w_stopping["ts"], h_stopping["ts"])
    for rep in (w_stop["details"], h_stop["details"]):
        assert rep["outcome"] == "exited" and rep["exit_code"] == 0  # graceful on both
        assert rep["durations_s"]["stop"] < 30
        assert rep["archive"]
    assert "peer_emergency from spark-w: low_available" in h_stopping["message"]
    sent = worker.events("peer_stop_sent")
    assert sent and sent[-1]["details"]["peer"] == "spark-h"
    # the originating node's incident names the peer it stopped (each node archives its own stop)
    from sparkdproc import db_query

    (stop_id,) = db_query(worker.db, "SELECT id FROM events WHERE kind='stopped' ORDER BY id DESC LIMIT 1")[0]
    inc = httpx.get(f"http://127.0.0.1:{worker.api_port}/incidents/{stop_id}.json", timeout=10).json()
    assert any(p["node"] == "spark-h" and p["kind"] == "peer_stop_sent" for p in inc["peers"]), inc["peers"]
    page = httpx.get(f"http://127.0.0.1:{worker.api_port}/incidents/{stop_id}", timeout=10).text
    assert 'id="incident-peers"' in page and "spark-h" in page
    assert head.events("peer_stop_requested")[-1]["details"]["origin"] == "spark-w"
    for c in (wc, hc):
        assert docker_client.containers.get(c["container_id"]).status == "exited"
    # one view: either node shows the other
    view = httpx.get(f"http://127.0.0.1:{head.api_port}/api/cluster", timeout=10).json()
    assert view["node"] == "spark-h" and view["peers"][0]["node"] == "spark-w"
    assert view["peers"][0]["reachable"] is True
    assert view["peers"][0]["status"]["container"]["state"] == "stopped"
    # the same as a page, on either node: every node side by side
    page = httpx.get(f"http://127.0.0.1:{head.api_port}/cluster", timeout=10).text
    assert 'id="cluster-nodes"' in page and "spark-w" in page and "spark-h" in page
    assert page.count("<tr") == 3  # header + two nodes
    # the same from the command line, on the worker
    out = subprocess.run(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(worker.config), "status", "--cluster"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rows = {ln.split()[0]: ln for ln in out.stdout.splitlines()[1:]}
    assert set(rows) == {"spark-w", "spark-h"}
    assert "stopped" in rows["spark-h"] and "yes" in rows["spark-h"]


def test_a_trip_with_the_peer_daemon_dead_stops_locally_on_time(pair: Any, docker_client: Any) -> None:
    worker, head = pair
    _launch_pair(worker, head)
    head.kill9()  # the head's sparkd is gone (its container keeps running)
    t0 = time.time()
    (worker.tmp.parent / "proc" / "meminfo").write_text(LOW)
    worker.wait_event("trip", 30)
    stop = worker.wait_event("stopped", 60)
    assert stop["details"]["outcome"] == "exited" and stop["details"]["durations_s"]["stop"] < 30
    assert stop["ts"] - t0 < 35
    un = worker.wait_event("peer_unreachable", 10)
    assert un["details"]["peer"] == "spark-h"
    # the one view says the silent peer is silent (and how old its last status is, once one was seen)
    page = httpx.get(f"http://127.0.0.1:{worker.api_port}/cluster", timeout=15).text
    assert "spark-h" in page and "no " in page.split("spark-h", 1)[1][:200]


def test_peer_calls_need_the_token_and_a_peer_address(pair: Any) -> None:
    _worker, head = pair
    head.start()
    url = f"http://{HEAD_LINK}:{head.api_port}/api/peer/stop"
    body = {"origin": "spark-w", "rule": "low_available", "reason": "test"}
    good = "pair-secret-0123456789abcdef"

    def post(local: str, token: str) -> int:
        transport = httpx.HTTPTransport(local_address=local)
        with httpx.Client(transport=transport, timeout=10) as c:
            return c.post(url, json=body, headers={"Authorization": f"Bearer {token}"}).status_code

    assert post(WORKER_LINK, "wrong-token") == 403  # the worker's address, a wrong token
    assert post("127.0.0.9", good) == 403  # the right token from an address not configured
    # anyone but the peer is refused on the link address, whatever the path
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.9"), timeout=10) as c:
        assert c.get(f"http://{HEAD_LINK}:{head.api_port}/api/status").status_code == 403
    assert wait_for(lambda: head.events("peer_refused"), 10)
    assert post(WORKER_LINK, good) == 202  # the peer itself, with its token


def test_it_authenticates_by_address_and_token(tmp_path: Path) -> None:
    tok = tmp_path / "t"
    tok.write_text("s3cret\n")
    c = Cluster(
        ClusterSettings(node="a", peers=[PeerSettings(name="b", url="http://127.0.0.5:1", token_file=str(tok))])
    )
    assert c.tokens["b"].wait(5)  # read in a worker thread, never on the event loop
    assert c.authenticate("127.0.0.5", "s3cret") is not None
    assert c.authenticate("127.0.0.5", "nope") is None
    assert c.authenticate("127.0.0.6", "s3cret") is None
    assert c.authenticate(None, "s3cret") is None
    tok.write_text("")
    assert c.authenticate("127.0.0.5", "") is None  # an empty secret never matches


def test_a_token_file_that_blocks_never_blocks_the_caller_and_a_new_token_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer token on a hung mount (a FIFO here: its open blocks until a writer comes) was read on the event loop
    at a trip's broadcast and at any GET of /api/cluster: the guard, the stop and the API froze for as long
    (43 s, helper-33). It is read in a worker thread; the caller gets the value last read at once."""
    import os

    from sparkd.loop import cluster as cluster_mod

    fifo = tmp_path / "token.fifo"
    os.mkfifo(fifo)
    c = Cluster(
        ClusterSettings(node="a", peers=[PeerSettings(name="b", url="http://127.0.0.5:1", token_file=str(fifo))])
    )
    try:
        t0 = time.monotonic()
        assert c.authenticate("127.0.0.5", "s3cret") is None and c.token(c.settings.peers[0]) is None
        assert time.monotonic() - t0 < 0.5  # answered at once, the read still blocked in its thread
        assert not c.tokens["b"].wait(0.2)
    finally:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the blocked reader opens; then it reads this
        os.write(fd, b"s3cret\n")
        os.close(fd)
    assert c.tokens["b"].wait(5)
    assert c.authenticate("127.0.0.5", "s3cret") is not None
    plain = tmp_path / "t"
    plain.write_text("old\n")
    monkeypatch.setattr(cluster_mod, "TOKEN_REFRESH_S", 0.0)  # a rotated token: read again at the next use
    tf = cluster_mod.TokenFile(plain)
    assert tf.wait(5) and tf.get() == "old"
    # that get() started a read (TOKEN_REFRESH_S 0): it ends before the file is rewritten, or it may read the file
    # truncated, empty, which is no token (this test failed 1 run in 8 so)
    assert tf.wait(5)
    plain.write_text("new\n")
    assert tf.wait(5) and tf.get() in ("old", "new")  # that use started the read
    assert tf.wait(5) and tf.get() == "new"


def test_a_token_file_read_while_it_is_rewritten_in_place_gives_the_new_token_not_none(tmp_path: Path) -> None:
    """A rotation by ``echo new > token`` truncates the file, then writes it: a read between the two got "no token",
    and every call to and from that peer failed its authentication for ``TOKEN_REFRESH_S`` (a trip's broadcast among
    them). A file read empty is read again ``EMPTY_REREADS`` times, ``EMPTY_REREAD_S`` apart; one that stays empty is
    still no token."""
    from sparkd.loop import cluster as cluster_mod

    plain = tmp_path / "t"
    plain.write_text("")  # truncated: the new token is not written yet
    tf = cluster_mod.TokenFile(plain)  # its read starts now
    time.sleep(cluster_mod.EMPTY_REREAD_S / 2)  # the first read has seen the file empty
    plain.write_text("new\n")
    assert tf.wait(5) and tf.get() == "new"
    empty = tmp_path / "e"
    empty.write_text("\n")
    t0 = time.monotonic()
    te = cluster_mod.TokenFile(empty)
    assert te.wait(5) and te.get() is None
    assert time.monotonic() - t0 >= cluster_mod.EMPTY_REREADS * cluster_mod.EMPTY_REREAD_S * 0.9  # read again


def test_a_coordinated_launch_starts_the_worker_first(pair: Any) -> None:
    worker, head = pair
    worker.start()
    head.start()
    # alone, neither node launches: the head orders the launch
    time.sleep(1.0)
    assert worker.container().get("container_id") is None and head.container().get("container_id") is None
    r = head.api("POST", "/api/cluster/start")
    assert r.status_code == 200, r.text
    assert r.json()["workers"] == ["spark-w"]
    w_launch, h_launch = worker.wait_event("launched", 30), head.wait_event("launched", 30)
    running = head.wait_event("cluster_workers_running", 10)
    # the worker was launched (and running) before the head was launched
    assert w_launch["ts"] < running["ts"] <= h_launch["ts"]
    # a worker node cannot start a coordinated launch
    assert worker.api("POST", "/api/cluster/start").status_code == 422


def test_a_worker_that_fails_to_launch_keeps_the_head_down(
    tmp_path: Path, image: str, case_labels: dict[str, str], launcher: Any
) -> None:
    token = tmp_path / "pair.token"
    token.write_text("pair-secret-0123456789abcdef\n")
    wport, hport = free_port(), free_port()
    nodes = []
    for name, link, peer, peer_link, peer_port, img in (
        ("w", WORKER_LINK, "spark-h", HEAD_LINK, hport, "sparkd-test-no-such-image:0"),  # cannot launch
        ("h", HEAD_LINK, "spark-w", WORKER_LINK, wport, image),
    ):
        (tmp_path / name).mkdir()
        s = SparkdUnderTest(
            tmp_path / name,
            image,
            case_labels,
            container={
                "image": img,
                "name": f"{case_labels['sparkd.test.case']}-{name}",
                "selector": {**case_labels, "node": name},
            },
            extra_toml=_cluster_toml(
                f"spark-{name}", "worker" if name == "w" else "head", link, peer, peer_link, peer_port, token
            ),
        )
        s.api_port = wport if name == "w" else hport
        _set_port(s, s.api_port)
        nodes.append(s.start())
    head = nodes[1]
    try:
        r = head.api("POST", "/api/cluster/start")
        assert r.status_code == 422, r.text
        assert "a worker did not launch" in r.json()["detail"]
        assert head.wait_event("cluster_launch_refused", 10)
        assert head.events("launched") == []  # the head was never launched
        assert head.container().get("container_id") is None
    finally:
        for s in nodes:
            s.stop()


def test_a_peer_that_trickles_its_answer_is_said_unreachable_within_the_timeout(tmp_path: Path) -> None:
    """``cluster.peer_timeout_s`` was httpx's per read: a peer that trickled its answer a byte every 0.4 s held the
    stop broadcast open for ever, and neither ``peer_stop_sent`` nor ``peer_unreachable`` was said (helper-43)."""
    import asyncio

    from test_notify import _trickling_server

    port = _trickling_server(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n{")
    tok = tmp_path / "t"
    tok.write_text("s3cret\n")
    said: list[tuple[str, str, str]] = []
    c = Cluster(
        ClusterSettings(
            node="a",
            peers=[PeerSettings(name="b", url=f"http://127.0.0.1:{port}", token_file=str(tok))],
            peer_timeout_s=1.0,
        ),
        emit=lambda k, m, severity="info", details=None: said.append((k, severity, m)),
    )
    assert c.tokens["b"].wait(5)  # a daemon reads it long before any trip

    async def go() -> float:
        t0 = time.monotonic()
        await asyncio.wait_for(c.broadcast_stop(rule="low_available", reason="test"), 10)
        return time.monotonic() - t0

    took = asyncio.run(go())
    assert took < 3.0 and said == [
        ("peer_unreachable", "critical", "peer b could not be asked to stop: no whole answer within 1 s")
    ], (took, said)


def test_a_peer_whose_name_did_not_resolve_at_start_is_looked_up_again_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's host name was resolved once, at start: at boot before the link network or DNS was up, the peer was
    refused (403) until sparkd restarted, its stop requests too (helper-53). It is looked up again, off the event
    loop, and a name that resolves to nothing is said once, and its return. The resolver is the edge stubbed."""
    import asyncio
    import socket

    from sparkd.loop import cluster as cluster_module

    up = [False]

    def getaddrinfo(host: str, port: Any, *a: Any, **k: Any) -> list[Any]:
        assert host == "spark-b.lan"
        if not up[0]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.168.100.2", 0))]

    monkeypatch.setattr(cluster_module.socket, "getaddrinfo", getaddrinfo)
    tok = tmp_path / "t"
    tok.write_text("s3cret\n")
    peer = PeerSettings(name="b", url="http://spark-b.lan:8741", token_file=str(tok))
    said: list[tuple[str, str]] = []
    c = Cluster(ClusterSettings(node="a", peers=[peer]))
    c.emit = lambda kind, msg, *, severity, details: said.append((kind, severity))  # type: ignore[assignment]
    assert c.peer_from("192.168.100.2") is None  # not resolved at start

    async def go() -> None:
        task = asyncio.create_task(c.keep_resolved(every_s=0.05))
        try:
            for _ in range(100):
                if said:
                    break
                await asyncio.sleep(0.02)
            assert said == [("peer_unresolved", "warning")], said
            await asyncio.sleep(0.2)
            assert said == [("peer_unresolved", "warning")], said  # once
            up[0] = True  # the link network is up
            for _ in range(100):
                if c.peer_from("192.168.100.2") is not None:
                    break
                await asyncio.sleep(0.02)
            assert c.peer_from("192.168.100.2") is peer
            assert said[-1] == ("peer_resolved", "info")
        finally:
            task.cancel()

    asyncio.run(go())
