"""Strict ``Host`` header parsing, shared by the API's Host check and the config's
``api.allowed_hosts`` validation (standard library only)."""

from __future__ import annotations

import re

_HOST_RE = re.compile(r"(?:(\[[0-9a-f:.]+\])|([a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?))(?::([0-9]{1,5}))?", re.ASCII)


def parse_host(value: str | None) -> tuple[str, int | None] | None:
    """``Host`` value → ``(host, port)``, host lowercased (IPv6 keeps its brackets); None if malformed.

    An allow-list entry may also be a bare IPv6 address (``::1`` → ``[::1]``).
    """
    if not value:
        return None
    m = _HOST_RE.fullmatch(value.lower())
    if m is None:
        return None
    host = m.group(1) or m.group(2)
    port = int(m.group(3)) if m.group(3) is not None else None
    if port is not None and port > 65535:
        return None
    return host, port


def allowed_entry(entry: str) -> tuple[str, int | None] | None:
    e = entry.strip().lower()
    if ":" in e and not e.startswith("[") and e.count(":") > 1:
        e = f"[{e}]"  # a bare IPv6 address in the config
    return parse_host(e)
