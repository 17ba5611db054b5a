"""Two Sparks as one: each node a full guard; stops coordinated over the control API.

A trip on this node stops the local container through the normal procedure; at the same
moment (not after it) ``Cluster.on_local_stop`` asks every peer to stop its container
with intent ``peer_emergency``, naming this node, the rule and the reason
(``POST <peer>/api/peer/stop`` with the pair's token). The local stop never waits for a
peer: the broadcast runs as its own task with ``cluster.peer_timeout_s`` per call, and a
peer that cannot be reached is an event (``peer_unreachable``, critical: it notifies).

Why: with tensor parallelism over Ray, if either node stops computing, requests on both
stall; a start-up collapse on one node froze both (CONTEXT.md "The machine").

Peer calls come from the node's link address (the first of ``cluster.listen``) so that
the peer can check them against its configured peer addresses.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from sparkd.config import ClusterSettings, PeerSettings
from sparkd.errors import Refused

log = logging.getLogger("sparkd.cluster")

Emit = Callable[..., Any]


#: How often ``Cluster.keep_resolved`` looks up the peers named by host name (s).
RESOLVE_EVERY_S = 60.0


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _addresses(host: str) -> set[str]:
    """IP addresses of a peer's URL host (a literal, or what the resolver says now)."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {str(ai[4][0]) for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


@dataclass(frozen=True, slots=True)
class PeerResult:
    """One peer call: ``ok``; ``status`` HTTP status or None; ``error`` why it failed; ``elapsed_s``."""

    peer: str
    ok: bool
    status: int | None
    error: str | None
    elapsed_s: float
    body: dict[str, Any] | None = None


#: How often a peer's token file is read again (s): a rotated token takes effect within this.
TOKEN_REFRESH_S = 5.0
#: A token file read empty is read again this many times, this far apart (s): an operator's rotation that rewrites
#: it in place (``echo new > file``: truncate, then write) read as "no token", and every call to and from that peer
#: failed its authentication until the next read, TOKEN_REFRESH_S later (a trip's broadcast among them).
EMPTY_REREADS, EMPTY_REREAD_S = 3, 0.1


class TokenFile:
    """A token file read in a worker thread, never on the event loop. The loop runs the guard's ticks, the stop and
    the API: a token file on a hung mount (or a FIFO) froze all of them at a trip's broadcast, and any local GET of
    ``/api/cluster`` froze the guard for as long (helper-33). ``get()`` answers at once with the value last read
    (None before the first read ends, or when unreadable or empty: read empty, it is read ``EMPTY_REREADS`` more
    times first) and starts a new read when the last is older than ``TOKEN_REFRESH_S``; at most one read per file
    is under way (a read that hangs holds one thread only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.value: str | None = None
        self.read_at: float | None = None  # monotonic s of the last read that ended
        self._idle = threading.Event()  # set while no read is under way
        self._idle.set()
        self._mu = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        """Start a read in a daemon thread unless one is under way."""
        with self._mu:
            if not self._idle.is_set():
                return
            self._idle.clear()
        threading.Thread(target=self._read, name="sparkd-peer-token", daemon=True).start()

    def _read(self) -> None:
        try:
            text: str | None = None
            for attempt in range(EMPTY_REREADS + 1):
                try:
                    text = self.path.read_text().strip() or None
                except (OSError, UnicodeDecodeError):
                    text = None
                    break
                if text is not None:
                    break
                if attempt < EMPTY_REREADS:  # read empty: a rotation in progress (truncated, not written yet)?
                    time.sleep(EMPTY_REREAD_S)
            self.value, self.read_at = text, time.monotonic()
        finally:
            self._idle.set()

    def get(self) -> str | None:
        if self.read_at is None or time.monotonic() - self.read_at >= TOKEN_REFRESH_S:
            self.refresh()
        return self.value

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a read under way to end (tests, start-up); True when none is under way."""
        return self._idle.wait(timeout_s)


class Cluster:
    """The peers of this node and the calls to them.

    ``emit(kind, message, *, severity, details)``: the daemon's event function (set by
    ``attach``). Raises nothing from its calls: failures become results and events.
    """

    def __init__(self, settings: ClusterSettings, *, emit: Emit | None = None) -> None:
        self.settings = settings
        self.emit = emit
        self.tokens = {p.name: TokenFile(p.token_file) for p in settings.peers}
        self.peer_addresses: dict[str, set[str]] = {
            p.name: _addresses(urlsplit(p.url).hostname or "") for p in settings.peers
        }
        self.tasks: set[asyncio.Task[Any]] = set()
        self.last_status: dict[str, tuple[float, dict[str, Any]]] = {}
        self.actions: Any = None
        self.unresolved: set[str] = set()  # peers whose host name resolved to no address at the last look

    def attach_actions(self, actions: Any) -> None:
        """The local container's control interface (``request(action, source=, reason=)``)."""
        self.actions = actions

    @property
    def enabled(self) -> bool:
        return bool(self.settings.peers)

    def attach(self, daemon: Any) -> None:
        """Send events through ``daemon.event`` and broadcast on every stop the daemon decides."""
        self.emit = daemon.event
        self.actions = daemon.actions
        daemon.stop_hooks.append(self.on_local_stop)

    # -- incoming -------------------------------------------------------------------------
    def token(self, peer: PeerSettings) -> str | None:
        """The pair's shared secret from ``peer.token_file`` (None when unreadable or empty), as last read: never
        read on the event loop (``TokenFile``)."""
        tf = self.tokens.get(peer.name)
        if tf is None:
            tf = self.tokens[peer.name] = TokenFile(peer.token_file)
        return tf.get()

    async def keep_resolved(self, every_s: float = RESOLVE_EVERY_S) -> None:
        """Resolve the peers named by host name again every ``every_s``, off the event loop; until cancelled. A name
        resolved once at start: one that did not resolve at boot (the link network or DNS not up yet) left the peer
        refused (403) until sparkd restarted, its stop requests too, said only as ``peer_refused`` (helper-53). A name
        that resolves to nothing is said once (``peer_unresolved``, warning), and its return (``peer_resolved``)."""
        named = [(p.name, urlsplit(p.url).hostname or "") for p in self.settings.peers]
        named = [(n, h) for n, h in named if not _is_ip(h)]
        while named:
            for name, host in named:
                found = await asyncio.to_thread(_addresses, host)
                if found:
                    self.peer_addresses[name] = found
                    if name in self.unresolved:
                        self.unresolved.discard(name)
                        self._emit("peer_resolved", f"peer {name}'s host {host} resolves again", "info", {"peer": name})
                elif name not in self.unresolved:
                    self.unresolved.add(name)
                    self._emit(
                        "peer_unresolved",
                        f"peer {name}'s host {host} resolves to no address: its calls (a stop its trip asks for) are "
                        f"refused until it does; looked up again every {every_s:g} s (an IP address in the peer's url "
                        "needs no lookup)",
                        "warning",
                        {"peer": name, "host": host, "addresses_kept": sorted(self.peer_addresses.get(name, set()))},
                    )
            await asyncio.sleep(every_s)

    def peer_from(self, client_host: str | None) -> PeerSettings | None:
        """The configured peer whose address ``client_host`` is (None for anyone else)."""
        if client_host is None:
            return None
        for p in self.settings.peers:
            if client_host in self.peer_addresses.get(p.name, set()):
                return p
        return None

    def authenticate(self, client_host: str | None, bearer: str | None) -> PeerSettings | None:
        """The calling peer when both its address and its token match; else None."""
        peer = self.peer_from(client_host)
        if peer is None or not bearer:
            return None
        expected = self.token(peer)
        if expected is None or not hmac.compare_digest(expected.encode(), bearer.encode()):
            return None
        return peer

    # -- outgoing -------------------------------------------------------------------------
    def _client(self, timeout_s: float | None = None) -> httpx.AsyncClient:
        local = self.settings.listen[0] if self.settings.listen else None
        transport = httpx.AsyncHTTPTransport(local_address=local, verify=self.settings.tls_ca_file or True)
        return httpx.AsyncClient(transport=transport, timeout=timeout_s or self.settings.peer_timeout_s)

    async def _call(
        self, peer: PeerSettings, method: str, path: str, json: Any = None, *, timeout_s: float | None = None
    ) -> PeerResult:
        t0 = time.monotonic()
        token = self.token(peer)
        if token is None:
            return PeerResult(peer.name, False, None, f"token file {peer.token_file} unreadable or empty", 0.0)
        limit_s = timeout_s or self.settings.peer_timeout_s
        try:
            # the whole call within the limit: httpx's timeout is per read, and a peer that trickled its answer held
            # the broadcast open for ever, neither peer_stop_sent nor peer_unreachable said (helper-43)
            async with asyncio.timeout(limit_s), self._client(timeout_s) as c:
                r = await c.request(method, peer.url + path, json=json, headers={"Authorization": f"Bearer {token}"})
                await r.aread()
        except TimeoutError:
            return PeerResult(peer.name, False, None, f"no whole answer within {limit_s:g} s", time.monotonic() - t0)
        except httpx.HTTPError as exc:
            return PeerResult(peer.name, False, None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
        try:
            body = r.json()
        except ValueError:
            body = None
        ok = 200 <= r.status_code < 300
        err = None if ok else f"HTTP {r.status_code}: {str(body)[:200]}"
        return PeerResult(peer.name, ok, r.status_code, err, time.monotonic() - t0, body)

    def on_local_stop(self, decision: Any) -> None:
        """Stop hook: start the broadcast now, beside the local stop (never awaited by it)."""
        if not self.enabled:
            return
        task = asyncio.get_running_loop().create_task(
            self.broadcast_stop(rule=str(decision.rule), reason=str(decision.reason)), name="sparkd-peer-stop"
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def broadcast_stop(self, *, rule: str, reason: str) -> list[PeerResult]:
        """Ask every peer, concurrently, to stop with intent ``peer_emergency``."""
        body = {"origin": self.settings.node, "rule": rule, "reason": reason, "intent": "peer_emergency"}
        results = await asyncio.gather(*(self._call(p, "POST", "/api/peer/stop", body) for p in self.settings.peers))
        for res in results:
            if res.ok:
                self._emit(
                    "peer_stop_sent",
                    f"asked peer {res.peer} to stop (rule {rule}); answered in {res.elapsed_s:.2f} s",
                    "warning",
                    {"peer": res.peer, "rule": rule, "answer": res.body},
                )
            else:
                self._emit(
                    "peer_unreachable",
                    f"peer {res.peer} could not be asked to stop: {res.error}",
                    "critical",
                    {"peer": res.peer, "rule": rule, "error": res.error},
                )
        return list(results)

    async def start_peers(self) -> list[PeerResult]:
        """Ask every peer to launch (coordinated launch; the head calls this before launching itself).

        A launch takes longer than a stop call: each call may take ``max(peer_timeout_s, 120 s)``.
        """
        timeout_s = max(self.settings.peer_timeout_s, 120.0)
        calls = (self._call(p, "POST", "/api/peer/start", timeout_s=timeout_s) for p in self.settings.peers)
        return list(await asyncio.gather(*calls))

    def _request_fn(self) -> Any:
        fn = getattr(self.actions, "request", None)
        if fn is None:
            raise Refused("monitor-only: no container configured")
        return fn

    def accept_stop(self, peer: str, *, origin: str, rule: str, reason: str) -> dict[str, Any]:
        """A peer's trip: start the local stop in the background (intent ``peer_emergency``); answer at once."""
        why = f"peer_emergency from {origin}: {rule}: {reason}"
        self._emit(
            "peer_stop_requested",
            f"peer {peer} asks to stop: {rule}",
            "critical",
            {"peer": peer, "origin": origin, "rule": rule, "reason": reason},
        )
        fn = getattr(self.actions, "request", None)
        if fn is None:
            return {"accepted": False, "why": "monitor-only: no container configured"}

        async def stop() -> None:
            try:
                await fn("stop", source=f"peer:{peer}", reason=why)
            except Exception as exc:  # recorded, never raised into the event loop
                # critical: the peer was answered "accepted" and stopped its own model, this one runs on (helper-53)
                self._emit("peer_stop_not_executed", f"{why}: {exc}", "critical", {"peer": peer})

        task = asyncio.get_running_loop().create_task(stop(), name="sparkd-peer-stop-local")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return {"accepted": True, "node": self.settings.node}

    async def accept_start(self, peer: str) -> dict[str, Any]:
        """The head's coordinated launch: launch the local container now; return once launched."""
        fn = self._request_fn()
        self._emit("peer_start_requested", f"peer {peer} asks to launch (coordinated launch)", "info", {"peer": peer})
        result: dict[str, Any] = await fn("start", source=f"peer:{peer}")
        return result

    async def coordinated_launch(self, source: str) -> dict[str, Any]:
        """Head only: every peer launches first; then this node after ``worker_start_delay_s``.

        Raises Refused when this node is not the head, is monitor-only, or a worker did not launch
        (then this node is not launched either).
        """
        if self.settings.role != "head":
            raise Refused(f"cluster.role is {self.settings.role!r}: a coordinated launch starts on the head")
        fn = self._request_fn()
        results = await self.start_peers()
        failed = [r for r in results if not r.ok]
        if failed:
            why = "; ".join(f"{r.peer}: {r.error}" for r in failed)
            self._emit("cluster_launch_refused", f"coordinated launch stopped: {why}", "critical", {"failed": why})
            raise Refused(f"coordinated launch: a worker did not launch ({why}); this node was not launched")
        self._emit(
            "cluster_workers_running",
            f"workers running ({', '.join(r.peer for r in results)}); head launches in "
            f"{self.settings.worker_start_delay_s:g} s",
            "info",
            {"workers": [r.peer for r in results]},
        )
        await asyncio.sleep(self.settings.worker_start_delay_s)
        local: dict[str, Any] = await fn("start", source=f"{source} (coordinated launch)")
        return {"workers": [r.peer for r in results], "head": local}

    async def peer_statuses(self) -> list[dict[str, Any]]:
        """Each peer's ``/api/status`` (or why not, with the age of the last one seen)."""
        results = await asyncio.gather(*(self._call(p, "GET", "/api/status") for p in self.settings.peers))
        out = []
        now = time.time()
        for res in results:
            if res.ok and isinstance(res.body, dict):
                self.last_status[res.peer] = (now, res.body)
                out.append({"node": res.peer, "reachable": True, "age_s": 0.0, "status": res.body})
            else:
                seen = self.last_status.get(res.peer)
                out.append(
                    {
                        "node": res.peer,
                        "reachable": False,
                        "error": res.error,
                        "age_s": None if seen is None else round(now - seen[0], 1),
                        "status": None if seen is None else seen[1],
                    }
                )
        return out

    def _emit(self, kind: str, message: str, severity: str, details: dict[str, Any]) -> None:
        if self.emit is None:
            log.warning("%s: %s", kind, message)
            return
        self.emit(kind, message, severity=severity, details=details)
