"""The daemon's HTTP side: the API server on its own socket (and the cluster link sockets), composed by
``Daemon(app_factory=...)``; the loop never imports the face.

Functions over the running ``Daemon`` (its methods delegate here), so ``daemon.py`` keeps the
start-up, the main loop and the shutdown in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

from sparkd.errors import ConfigError
from sparkd.loop.httpserver import (
    ACCEPT_BACKLOG,
    HttpStats,
    OncePerInterval,
    RateLimitedLog,
    connection_cap,
    guarded_protocol,
    install_exception_handler,
    raise_nofile,
)

log = logging.getLogger("sparkd.loop.daemon")

if TYPE_CHECKING:
    from sparkd.loop.daemon import Daemon


async def start_api(daemon: Daemon) -> None:
    import uvicorn

    from sparkd.loop.quietserver import QuietServer

    assert daemon.app_factory is not None
    app = daemon.app_factory(daemon)
    host, port = daemon.settings.api.host, daemon.settings.api.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, as asyncio's own server sockets: asyncio sets TCP_NODELAY only on sockets
    # that say TCP, and without it every response waits ~40 ms for a delayed ACK (bench/api.py)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            f"the API cannot listen on {host}:{port}: {e.strerror} (another sparkd? set api.port or SPARKD_API__PORT)"
        ) from None
    sock.listen(ACCEPT_BACKLOG)
    sock.set_inheritable(True)
    daemon.api_socket = sock
    api = daemon.settings.api
    soft, hard = raise_nofile()
    cap = connection_cap(api.max_connections, soft)
    daemon.http_stats = HttpStats(cap=cap)
    limited = RateLimitedLog(logging.getLogger("sparkd.api.server"))
    daemon.http_log = limited
    install_exception_handler(asyncio.get_running_loop(), limited)
    for name in ("uvicorn.error", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, OncePerInterval) for f in logger.filters):  # a retry adds none
            logger.addFilter(OncePerInterval())
    shown = f"[{host}]" if ":" in host else host
    log.info(
        "dashboard and API at http://%s:%d/ (log in with the token in %s); at most %d connections (descriptor "
        "limit %d/%d), request head within %g s",
        shown,
        port,
        daemon.settings.token_file,
        cap,
        soft,
        hard,
        api.header_timeout_s,
    )
    try:
        links = daemon._link_sockets(port)
    except OSError:
        sock.close()  # not left bound: the next try binds it again
        daemon.api_socket = None
        raise
    daemon.read_hold.exempt = {tuple(s.getsockname()[:2]) for s in links}  # peers' calls are never held
    sockets = [sock, *links]
    cfg = uvicorn.Config(
        app,
        host=daemon.settings.api.host,
        port=daemon.settings.api.port,
        log_level="warning",
        log_config=None,  # uvicorn's records go to the root logger: sparkd's queue, not a handler writing from the loop
        access_log=False,
        lifespan="off",
        http=guarded_protocol(cap, api.header_timeout_s, daemon.http_stats, limited, daemon.read_hold),
        h11_max_incomplete_event_size=api.max_header_bytes,
        timeout_keep_alive=5,
        backlog=ACCEPT_BACKLOG,
    )
    server = QuietServer(cfg)  # no 0.1 s tick (uvicorn's Server wakes the loop ten times a second)
    # the daemon owns SIGTERM/SIGINT; uvicorn must not capture (and later re-raise) them
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    daemon.api_server = server
    daemon._tasks.append(asyncio.create_task(server.serve(sockets=sockets), name="sparkd-api"))
    for _ in range(200):
        if server.started:
            break
        if server.should_exit:
            raise OSError(f"API could not bind {daemon.settings.api.host}:{daemon.settings.api.port}")
        await asyncio.sleep(0.025)
    if daemon.settings.api.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "API bound to %s:%d — reachable beyond this machine (api.allow_remote = true)",
            daemon.settings.api.host,
            daemon.settings.api.port,
        )


def link_sockets(daemon: Daemon, port: int) -> list[socket.socket]:
    """Sockets on ``cluster.listen`` (the link network, for peer calls only; see face/peer.py)."""
    out = []
    for host in daemon.settings.cluster.listen:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            s.close()
            raise OSError(f"cluster.listen: the API cannot listen on {host}:{port}: {e.strerror}") from None
        s.listen(ACCEPT_BACKLOG)
        out.append(s)
    return out


def _why(e: ConfigError | OSError) -> str:
    """Why the API could not be served, in one line (a ConfigError's message, else the OSError's text)."""
    return e.message if isinstance(e, ConfigError) else str(e)


async def serve_api_or_say(daemon: Daemon) -> None:
    """Serve the API, or say why not and guard without it: a port another program holds, a ``cluster.listen``
    address not up yet (a link without carrier at boot), a token file that cannot be made. sparkd exited over the
    first two, and under systemd restarted every 5 s without ever guarding (helper-40). A critical
    ``api_unavailable`` event; then a try every ``api.retry_s`` until it is served (``api_available``)."""
    try:
        await daemon._start_api()
        return
    except (ConfigError, OSError) as e:
        why = _why(e)
    retry_s = daemon.settings.api.retry_s
    daemon.api_error = why
    daemon.event(
        "api_unavailable",
        f"API not served: {why}; the guard runs without it, and sparkd tries again every {retry_s:g} s",
        severity="critical",
        details={"error": why},
    )

    async def again() -> None:
        tries = 1
        while not daemon.should_exit.is_set():
            await asyncio.sleep(retry_s)
            tries += 1
            try:
                await daemon._start_api()
            except (ConfigError, OSError) as e:
                log.debug("API still not served (try %d): %s", tries, e)
                daemon.api_error = _why(e)
                continue
            daemon.api_error = None
            daemon.event(
                "api_available",
                f"API served at http://{daemon.settings.api.host}:{daemon.settings.api.port}/ after {tries} tries",
                details={"tries": tries},
            )
            return

    daemon._tasks.append(asyncio.create_task(again(), name="sparkd-api-retry"))
