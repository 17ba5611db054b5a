"""Parse vLLM start-up log lines into a launch record.

The figures an operator keeps per launch (CONTEXT.md, "How operators verify a
configuration", step 2; fixtures/vllm/README.md): model load size and time,
the KV cache memory and size in tokens after profiling, the maximum
concurrency, the graph-capture time and memory, the engine init time, the
moment of ``Application startup complete`` and, when vLLM refuses to start,
the free-memory figures of its refusal.

Tolerance: each figure has its own pattern, searched anywhere in a line, so
prefixes (``(EngineCore_DP0 pid=…)``, Docker's ``--timestamps`` prefix, ANSI
colours) and lines that carry several figures (some releases print the KV size
and the concurrency on one line) both work. A figure that never appears stays
``None``; a line that matches nothing, or a number that does not parse, is
skipped — feeding lines never raises.

Units: sizes are ``*_gib`` floats exactly as vLLM printed them (2 decimals);
converting them to bytes would invent precision. Times are ``*_s`` floats.
Timestamps are UTC epoch seconds, taken from the Docker prefix when there is
one, else from ``feed(..., received_at=...)``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_DOCKER_TS_RE = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d+)?(Z|[+-]\d{2}:?\d{2})\s")
_PROC_PREFIX_RE = re.compile(r"^\s*\((?:[A-Za-z_][\w.-]*\s+)?pid=\d+\)\s*")
_NUM = r"\d[\d,]*(?:\.\d+)?"
MAX_LINE_CHARS = 65536  # longer lines are cut before matching (non-default args can be long)


@dataclass
class LaunchRecord:
    """What one vLLM launch reported. Every figure is ``None`` until seen."""

    vllm_version: str | None = None
    non_default_args: dict[str, Any] | None = None
    model_load_gib: float | None = None
    model_load_s: float | None = None
    kv_cache_available_gib: float | None = None
    kv_cache_tokens: int | None = None
    kv_cache_blocks: int | None = None  # "# GPU blocks: N" (older releases)
    max_concurrency: float | None = None  # "1.30x" → 1.30
    max_concurrency_tokens_per_request: int | None = None
    graph_capture_s: float | None = None
    graph_capture_gib: float | None = None
    engine_init_s: float | None = None
    startup_complete: bool = False
    startup_complete_ts: float | None = None
    failed: bool = False
    failure_message: str | None = None
    failure_device: str | None = None
    failure_free_gib: float | None = None
    failure_total_gib: float | None = None
    failure_requested_gmu: float | None = None
    failure_requested_gib: float | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    lines_seen: int = 0

    @property
    def state(self) -> str:
        """``"failed"``, ``"ready"`` (Application startup complete) or ``"starting"``."""
        if self.failed:
            return "failed"
        return "ready" if self.startup_complete else "starting"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state
        return d


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _int(text: str) -> int:
    return int(_num(text))


# (regex, setter) pairs; a setter returns the names of the fields it set.
_Setter = Callable[[LaunchRecord, "re.Match[str]"], list[str]]


def _set(**conv: Callable[[str], Any]) -> _Setter:
    """A setter that assigns named groups to same-named fields (groups that did not match stay)."""

    def setter(rec: LaunchRecord, m: re.Match[str]) -> list[str]:
        done: list[str] = []
        for name, fn in conv.items():
            raw = m.group(name)
            if raw is not None:
                setattr(rec, name, fn(raw))
                done.append(name)
        return done

    return setter


def _set_args(rec: LaunchRecord, m: re.Match[str]) -> list[str]:
    try:
        value = ast.literal_eval(m.group(1))  # literals only: never evaluates code
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return []
    if not isinstance(value, dict):
        return []
    rec.non_default_args = value
    return ["non_default_args"]


def _set_failed(rec: LaunchRecord, m: re.Match[str]) -> list[str]:
    rec.failed = True
    if rec.failure_message is None:
        rec.failure_message = m.group(0).strip()
    return ["failed", "failure_message"]


def _set_free_memory(rec: LaunchRecord, m: re.Match[str]) -> list[str]:
    rec.failure_message = m.group(0).strip()
    return [
        *_set(
            failure_device=str,
            failure_free_gib=_num,
            failure_total_gib=_num,
            failure_requested_gmu=_num,
            failure_requested_gib=_num,
        )(rec, m),
        *_set_failed(rec, m),
    ]


_PATTERNS: list[tuple[re.Pattern[str], _Setter]] = [
    (re.compile(r"vLLM (?:API )?server version:?\s*v?(?P<vllm_version>\d[\w.+-]*)"), _set(vllm_version=str)),
    (re.compile(r"non-default args:\s*(\{.*\})\s*$"), _set_args),
    (
        re.compile(
            rf"Model loading took\s+(?P<model_load_gib>{_NUM})\s*GiB(?:\s+memory)?"
            rf"(?:\s+and\s+(?P<model_load_s>{_NUM})\s*s)?"
        ),
        _set(model_load_gib=_num, model_load_s=_num),
    ),
    (
        re.compile(rf"Available KV cache memory:\s*(?P<kv_cache_available_gib>{_NUM})\s*GiB"),
        _set(kv_cache_available_gib=_num),
    ),
    (re.compile(rf"GPU KV cache size:\s*(?P<kv_cache_tokens>{_NUM})\s*tokens"), _set(kv_cache_tokens=_int)),
    (re.compile(r"# GPU blocks:\s*(?P<kv_cache_blocks>\d[\d,]*)"), _set(kv_cache_blocks=_int)),
    (
        re.compile(
            rf"Maximum concurrency for\s+(?P<max_concurrency_tokens_per_request>{_NUM})"
            rf"\s+tokens per request:\s*(?P<max_concurrency>{_NUM})\s*x"
        ),
        _set(max_concurrency_tokens_per_request=_int, max_concurrency=_num),
    ),
    (
        re.compile(
            rf"Graph capturing finished in\s+(?P<graph_capture_s>{_NUM})\s*s\w*"
            rf"(?:,\s*took\s+(?P<graph_capture_gib>{_NUM})\s*GiB)?"
        ),
        _set(graph_capture_s=_num, graph_capture_gib=_num),
    ),
    (re.compile(rf"init engine \(.*?\) took\s+(?P<engine_init_s>{_NUM})\s*s"), _set(engine_init_s=_num)),
    (
        re.compile(
            rf"Free memory on device\s+(?P<failure_device>\S+)\s+\("
            rf"(?P<failure_free_gib>{_NUM})\s*/\s*(?P<failure_total_gib>{_NUM})\s*GiB\)"
            rf" on startup is less than desired GPU memory utilization\s+\("
            rf"(?P<failure_requested_gmu>{_NUM}),\s*(?P<failure_requested_gib>{_NUM})\s*GiB\)"
            r".*"
        ),
        _set_free_memory,
    ),
    (re.compile(r"EngineCore failed to start.*|Engine core initialization failed.*"), _set_failed),
]
_COMPLETE_RE = re.compile(r"Application startup complete")


def strip_prefixes(line: str) -> tuple[str, float | None]:
    """Remove ANSI colours, Docker's timestamp and a ``(Name pid=N)`` prefix.

    Returns ``(message, docker_ts)`` with ``docker_ts`` in UTC epoch seconds or
    ``None`` when the line has no (parseable) Docker timestamp.
    """
    line = _ANSI_RE.sub("", line).rstrip("\r\n")
    ts: float | None = None
    m = _DOCKER_TS_RE.match(line)
    if m:
        base, frac, zone = m.groups()
        zone = "+00:00" if zone == "Z" else zone
        try:
            ts = datetime.fromisoformat(base + zone).timestamp() + float(frac or 0)
        except ValueError:
            ts = None
        line = line[m.end() :]
    return _PROC_PREFIX_RE.sub("", line, count=1), ts


class LaunchLogParser:
    """Incremental parser: ``feed`` lines as they stream, read ``record`` any time."""

    def __init__(self) -> None:
        self.record = LaunchRecord()

    def feed(self, line: str | bytes, *, received_at: float | None = None) -> list[str]:
        """Take one log line; return the names of the record fields it just set.

        ``bytes`` are decoded as UTF-8 with replacement. ``received_at`` (UTC
        epoch seconds) stamps the line when it carries no Docker timestamp.
        Never raises on content.
        """
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        msg, ts = strip_prefixes(line[:MAX_LINE_CHARS])
        rec = self.record
        rec.lines_seen += 1
        ts = ts if ts is not None else received_at
        if ts is not None:
            rec.last_ts = ts
            if rec.first_ts is None:
                rec.first_ts = ts
        done: list[str] = []
        for pattern, setter in _PATTERNS:
            m = pattern.search(msg)
            if m is None:
                continue
            try:
                done += setter(rec, m)
            except (ValueError, OverflowError):
                continue  # a figure that does not parse is left as it was
        if _COMPLETE_RE.search(msg):
            rec.startup_complete = True
            rec.startup_complete_ts = ts
            done.append("startup_complete")
        return list(dict.fromkeys(done))

    def feed_many(self, lines: Iterable[str | bytes]) -> LaunchRecord:
        for line in lines:
            self.feed(line)
        return self.record


def parse_lines(lines: Iterable[str | bytes]) -> LaunchRecord:
    """Parse a finished log (an iterable of lines, e.g. ``text.splitlines()``)."""
    return LaunchLogParser().feed_many(lines)
