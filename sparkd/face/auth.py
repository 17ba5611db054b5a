"""Who may change things: the API token, dashboard sessions, CSRF, Origin and Host checks.

sparkd can stop and start containers (the Docker socket is root-equivalent), so
every mutating request must prove it comes from the operator:

* **Token** — a random secret generated on first run into ``settings.token_file``
  (mode 0600, created atomically: written to a private temp file, then hard-linked
  into place, so a reader never sees a half-written token and two starters agree).
  API clients send ``Authorization: Bearer <token>``.
* **Session** — the dashboard logs in once with the token (``/login``) and gets an
  HttpOnly, SameSite=Strict cookie ``<issued>.<nonce>.<hmac>`` signed with a key
  derived from the token (rotating the token ends every session).
* **CSRF** — cookie-authenticated POSTs must also carry the session-bound CSRF
  token (``X-CSRF-Token`` header — htmx sends it via ``hx-headers`` — or a
  ``csrf_token`` form field).
* **Origin** — mutating methods with a foreign ``Origin`` (or ``Origin: null``) or
  ``Sec-Fetch-Site`` other than ``same-origin``/``none`` are refused (403).
* **Host** — every request's ``Host`` must parse strictly as ``host[:port]`` (a
  name or IPv4 address, or an IPv6 address in brackets; the port ASCII digits
  only) and name one of ``api.allowed_hosts`` (with or without the port), which
  defeats DNS rebinding (400). Anything else (``a@b``, ``host:80x``, ``host/x``) is refused.
* **Reads of secrets** — postmortem bundles (container logs, configuration) need
  the bearer token or a session cookie; a GET needs no CSRF token.

All comparisons of secrets use ``hmac.compare_digest``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sparkd.errors import BadHost, ConfigError, Forbidden, SparkdError, TooLarge, Unauthorized
from sparkd.hostport import allowed_entry, parse_host

log = logging.getLogger("sparkd.face.auth")

SESSION_COOKIE = "sparkd_session"
CSRF_HEADER = "x-csrf-token"
CLIENT_HEADER = "x-sparkd-client"  # "cli": sparkd's own CLI (a label in events and archive names; grants nothing)
SESSION_MAX_AGE_S = 7 * 86400
MAX_SESSIONS = 1000  # live sessions kept server-side; the oldest goes first
# Failed logins: the first LOGIN_FREE_FAILURES per client cost nothing, then each waits
# 2 ** (failures - LOGIN_FREE_FAILURES) s, at most LOGIN_BACKOFF_MAX_S (810 tries/s were possible).
LOGIN_FREE_FAILURES = 5
LOGIN_BACKOFF_MAX_S = 300.0
LOGIN_CLIENTS_MAX = 10000
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


# --------------------------------------------------------------------------- token file
def ensure_token(path: str | Path) -> str:
    """Return the API token stored in ``path``, creating it (0600) on first run.

    The directory is created with mode 0700 when missing. An existing file that is
    group- or world-accessible is tightened to 0600 (and that is logged).

    Raises:
        ConfigError: the file cannot be created or read, or holds no usable token
            (the message names the path).
    """
    p = Path(path)
    try:
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            return _read_token(p)
        except FileNotFoundError:
            pass
        token = secrets.token_urlsafe(32)
        if not _write_token(p, token):
            return _read_token(p)
        log.info("API token created in %s (mode 0600)", p)
        return token
    except OSError as e:
        raise ConfigError(f"cannot create or read the API token file {p}: {e}") from None


def restore_token(path: str | Path, token: str) -> bool:
    """Write the running daemon's ``token`` to ``path`` again when the file is gone (deleted while sparkd
    ran, e.g. with the whole state directory): the CLI and an operator logging in to the dashboard read
    it there, and without it ``sparkd stop`` fails during an incident. The token stays the one the daemon
    accepts; a new one takes a restart. Returns whether it was written (False: a file is there).

    Raises:
        OSError: the directory or the file cannot be made (a full disk, a read-only mount).
    """
    p = Path(path)
    if os.path.lexists(p):
        return False
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return _write_token(p, token)


def _write_token(p: Path, token: str) -> bool:
    """``token`` to ``p`` (mode 0600, synced), atomically: False when another writer made ``p`` first.
    Raises OSError."""
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (token + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # a full disk: no empty temporary file left behind at each start
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    try:
        os.link(tmp, p)  # atomic, fails if another process won the race
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def _read_token(p: Path) -> str:
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"API token file {p} is not a regular file")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
            log.warning("API token file %s was readable by others; mode set to 0600", p)
        data = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if len(data) < 16:
        raise ConfigError(f"API token file {p} holds no usable token (at least 16 characters); delete it to regenerate")
    return data


# --------------------------------------------------------------------------- sessions
class LoginLimiter:
    """Failed logins per client (address) with exponential back-off; monotonic clock (injectable).

    ``retry_after(client)`` → seconds to wait before a login from ``client`` is even checked (None:
    go ahead); ``failed(client)`` → that wait after one more failure; ``succeeded`` forgets the client.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._clients: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        self.failures_total = 0

    def retry_after(self, client: str) -> float | None:
        until = self._clients.get(client, (0, 0.0))[1]
        wait = until - self.clock()
        return wait if wait > 0 else None

    def failed(self, client: str) -> float:
        self.failures_total += 1
        n = self._clients.pop(client, (0, 0.0))[0] + 1
        wait = 0.0 if n <= LOGIN_FREE_FAILURES else min(2.0 ** (n - LOGIN_FREE_FAILURES), LOGIN_BACKOFF_MAX_S)
        self._clients[client] = (n, self.clock() + wait)
        while len(self._clients) > LOGIN_CLIENTS_MAX:
            self._clients.popitem(last=False)
        return wait

    def failures(self, client: str) -> int:
        return self._clients.get(client, (0, 0.0))[0]

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)


class Auth:
    """Token, session and CSRF checks for one app. ``clock`` is injectable for tests.

    Sessions live server-side (``MAX_SESSIONS``, oldest dropped first): a signed cookie is valid
    only while its session is listed, so ``end_session`` (logout) makes it worthless at once, and
    a restart of the daemon logs everyone out.
    """

    def __init__(self, token: str, *, clock: Callable[[], float] = time.time) -> None:
        self.token = token
        self.clock = clock
        self._key = hmac.new(token.encode(), b"sparkd-session-v1", hashlib.sha256).digest()
        self._sessions: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.logins = LoginLimiter()

    def check_token(self, candidate: str | None) -> bool:
        return bool(candidate) and hmac.compare_digest(candidate.encode(), self.token.encode())  # type: ignore[union-attr]

    def _sign(self, msg: str) -> str:
        return hmac.new(self._key, msg.encode(), hashlib.sha256).hexdigest()

    def new_session(self) -> str:
        body = f"{int(self.clock())}.{secrets.token_urlsafe(16)}"
        self._sessions[body] = None
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return f"{body}.{self._sign(body)}"

    def end_session(self, cookie: str | None) -> bool:
        """Invalidate the session of ``cookie`` server-side (logout); True when there was one."""
        sid = self.session_id(cookie)
        return sid is not None and self._sessions.pop(sid, 0) is None

    def session_id(self, cookie: str | None) -> str | None:
        """The session's ``<issued>.<nonce>`` when the cookie is authentic and fresh, else None."""
        if not cookie or cookie.count(".") != 2:
            return None
        issued, nonce, sig = cookie.split(".")
        body = f"{issued}.{nonce}"
        if not hmac.compare_digest(sig.encode(), self._sign(body).encode()):
            return None
        try:
            age = self.clock() - int(issued)
        except ValueError:
            return None
        if body not in self._sessions:  # logged out, or issued before this daemon started
            return None
        return body if -60 <= age <= SESSION_MAX_AGE_S else None

    def csrf_for(self, session_id: str) -> str:
        return self._sign("csrf:" + session_id)

    def check_csrf(self, session_id: str, candidate: str | None) -> bool:
        return bool(candidate) and hmac.compare_digest(
            candidate.encode(),  # type: ignore[union-attr]
            self.csrf_for(session_id).encode(),
        )

    def authorize(self, headers: Mapping[str, str], cookies: dict[str, str], form_csrf: str | None) -> str:
        """Check a mutating request. Returns who it is (``"token"`` or ``"session"``).

        Raises:
            Unauthorized: no valid bearer token and no valid session.
            Forbidden: a valid session without the matching CSRF token.
        """
        authz = headers.get("authorization", "")
        if authz:
            scheme, _, cred = authz.partition(" ")
            if scheme.lower() == "bearer" and self.check_token(cred.strip()):
                return "token"
            raise Unauthorized("invalid bearer token", detail="send 'Authorization: Bearer <token>' (token file)")
        sid = self.session_id(cookies.get(SESSION_COOKIE))
        if sid is None:
            raise Unauthorized(
                "authentication required",
                detail="send 'Authorization: Bearer <token>' or log in at /login",
            )
        if not self.check_csrf(sid, headers.get(CSRF_HEADER) or form_csrf):
            raise Forbidden("CSRF token missing or wrong", detail="send the page's CSRF token in X-CSRF-Token")
        return "session"

    def reader(self, headers: Mapping[str, str], cookies: Mapping[str, str]) -> str | None:
        """Who may read protected data (a GET, so no CSRF): ``"token"``, ``"session"`` or None.

        A wrong bearer token is None even with a valid session cookie beside it.
        """
        authz = headers.get("authorization", "")
        if authz:
            scheme, _, cred = authz.partition(" ")
            return "token" if scheme.lower() == "bearer" and self.check_token(cred.strip()) else None
        return "session" if self.session_id(cookies.get(SESSION_COOKIE)) is not None else None

    def authorize_read(self, headers: Mapping[str, str], cookies: Mapping[str, str]) -> str:
        """Check a read of protected data (bearer token, or session cookie without CSRF).

        Raises:
            Unauthorized: no valid bearer token and no valid session.
        """
        who = self.reader(headers, cookies)
        if who is None:
            raise Unauthorized(
                "authentication required",
                detail="send 'Authorization: Bearer <token>' or log in at /login",
            )
        return who


# --------------------------------------------------------------------------- host & origin
# host[:port]: a DNS name or IPv4 address, or an IPv6 address in brackets; the port
# ASCII digits only. No userinfo ("@"), no path, no whitespace, no second colon.
def host_allowed(host: str | None, allowed: Iterable[str]) -> bool:
    """``Host`` header check: must parse strictly, and the host (with or without port) must be listed."""
    parsed = parse_host(host)
    if parsed is None:
        return False
    name, _port = parsed
    entries = {e for e in (allowed_entry(a) for a in allowed) if e is not None}
    return parsed in entries or (name, None) in entries


def origin_refusal(method: str, headers: Mapping[str, str]) -> str | None:
    """Why a mutating request looks cross-origin, or None when it may proceed."""
    if method.upper() not in MUTATING:
        return None
    site = headers.get("sec-fetch-site")
    if site and site.lower() not in ("same-origin", "none"):
        return f"Sec-Fetch-Site: {site} — requests from other sites are refused"
    origin = headers.get("origin")
    if origin is None:
        return None
    if origin.strip().lower() == "null":
        return "Origin: null is refused"
    parts = urlsplit(origin.strip())
    host = (headers.get("host") or "").strip().lower()
    if not parts.netloc or parts.netloc.lower() != host:
        return f"Origin {origin} does not match this server ({host or 'no Host'})"
    return None


# the dashboard loads only its own vendored scripts; nobody may frame the control buttons
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        b"connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]
# everything that is not a page (JSON, metrics, scripts, archives): never sniffed, never framed, loads
# nothing; ~250 bytes less on each live update than the page's set (issue 14's bytes per tab)
NON_PAGE_HEADERS = [
    (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
]


def security_headers(response_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The security headers for a response with these headers: the page set for HTML, the short one else."""
    ctype = next((v for k, v in response_headers if k.lower() == b"content-type"), b"")
    return SECURITY_HEADERS if ctype.startswith(b"text/html") else NON_PAGE_HEADERS


ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class GuardMiddleware:
    """Pure ASGI middleware: Host allow-list for every request, Origin checks for mutations.

    Answers with the one error shape ``{"error": ..., "detail": ...}``.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str], max_body_bytes: int = 65536) -> None:
        self.app = app
        self.allowed_hosts = list(allowed_hosts)
        self.max_body_bytes = max_body_bytes

    def _capped(self, receive: Any) -> Any:
        """``receive`` that stops a body without Content-Length (chunked) at ``max_body_bytes``:
        the app sees a client disconnect, so nothing past the cap is buffered."""
        seen = 0
        limit = self.max_body_bytes

        async def capped() -> dict[str, Any]:
            nonlocal seen
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    log.warning("request body over %d bytes (api.max_body_bytes): dropped", limit)
                    return {"type": "http.disconnect"}
            return message

        return capped

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope.get("headers", [])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        err: SparkdError | None = None
        host = headers.get("host")
        hosts = sum(1 for k, _ in raw if k.lower() == b"host")
        length = headers.get("content-length")
        if hosts > 1:  # the check would read one, the app another
            err = BadHost("more than one Host header", detail=f"{hosts} Host headers; send exactly one")
        elif length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            err = TooLarge(
                "request body too large",
                detail=f"Content-Length {length[:20]!r}: at most {self.max_body_bytes} bytes "
                "(api.max_body_bytes) are accepted",
            )
        elif parse_host(host) is None:
            err = BadHost(
                "malformed Host header",
                detail=f"Host {host!r} is not host[:port] (port digits only, IPv6 in brackets); "
                f"api.allowed_hosts: {', '.join(self.allowed_hosts)}",
            )
        elif not host_allowed(host, self.allowed_hosts):
            err = BadHost(
                "Host not allowed",
                detail=f"Host {host!r} is not in api.allowed_hosts ({', '.join(self.allowed_hosts)})",
            )
        else:
            why = origin_refusal(scope["method"], headers)
            if why:
                err = Forbidden("cross-origin request refused", detail=why)
        if err is None:

            async def send_with_headers(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start" and not scope["path"].startswith(("/docs", "/redoc")):
                    headers = message.get("headers", [])
                    message["headers"] = [*headers, *security_headers(headers)]
                await send(message)

            await self.app(scope, self._capped(receive), send_with_headers)
            return
        body = json.dumps(err.to_json()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
