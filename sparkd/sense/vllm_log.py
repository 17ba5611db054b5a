"""Parse vLLM start-up log lines into a launch record.

The figures an operator keeps per launch (CONTEXT.md, "How operators verify a
configuration", step 2; fixtures/vllm/README.md): model load size and time,
the KV cache memory and size in tokens after profiling, the maximum
concurrency, the graph-capture time and memory, the engine init time, the
moment of ``Application startup complete``, the CUDA graph memory figures
(``Estimated CUDA graph memory``, the graph pool's actual / estimated line),
the start-up *phase* reached and, when vLLM fails to start, the root cause and
the figures it carries.

Root cause, not the first generic line (field-2 reports): vLLM prints
``EngineCore failed to start.`` (and later ``Engine core initialization
failed. See root cause above``) *before or around* the real exception. Those
generic lines mark the launch failed but are never the reason; the reason is
the first known cause (free-memory refusal, max-seq-len refusal, no memory for
the KV cache blocks, CUDA out of memory) or else the first other exception
line (``SomethingError: …``). A known cause marks the launch failed on its own
(older vLLM raises the max-seq-len ``ValueError`` with no generic line).
Causes are only taken before ``Application startup complete``: a request's
error after that is not a start failure.

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

from sparkd.sense.vllm_causes import EXCEPTION_RE, GENERIC_RE, GRAPH_FRAME_RE, NUM, find_cause

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_DOCKER_TS_RE = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d+)?(Z|[+-]\d{2}:?\d{2})\s")
_PROC_PREFIX_RE = re.compile(r"^\s*\((?:[A-Za-z_][\w.-]*\s+)?pid=\d+\)\s*")
_NUM = NUM
MAX_LINE_CHARS = 65536  # longer lines are cut before matching (non-default args can be long)


# Start-up phases in the order vLLM (v1 engine) goes through them. ``kv_cache``
# means the KV pool was sized; what follows it is warm-up and CUDA graph capture.
PHASES: tuple[str, ...] = (
    "starting",  # nothing recognised yet
    "init",  # version / non-default args printed
    "model_load",  # loading weights ("Model loading took …" ends it)
    "profiling",  # memory profiling, torch.compile, CUDA graph memory estimate
    "kv_cache",  # "Available KV cache memory" / "GPU KV cache size"
    "graph_capture",  # "Capturing CUDA graphs" … "Graph capturing finished"
    "api_server",  # engine up, API server starting
    "ready",  # "Application startup complete"
)
# What a failure in each phase was doing (for the one-line reason).
_DURING = {
    "starting": "start-up",
    "init": "start-up",
    "model_load": "model loading",
    "profiling": "memory profiling",
    "kv_cache": "CUDA graph capture",  # the step after sizing the KV pool
    "graph_capture": "CUDA graph capture",
    "api_server": "API server start",
    "ready": "serving",
}


@dataclass
class LaunchRecord:
    """What one vLLM launch reported. Every figure is ``None`` until seen.

    ``phase``: the last of :data:`PHASES` that a line showed. ``failure_kind``:
    ``free_memory`` | ``max_model_len`` | ``no_kv_memory`` | ``cuda_oom`` |
    ``error`` (another exception) | ``None``; ``failure_phase`` is ``phase``
    when the failure was seen. Figures of the causes (GiB as printed):
    ``failure_kv_needed_gib`` / ``failure_kv_available_gib`` /
    ``failure_estimated_max_model_len`` (max-seq-len refusal),
    ``failure_oom_request_bytes`` (what CUDA tried to allocate).
    ``cudagraph_estimate_gib`` may be negative (a vLLM bug: see ``warnings``).
    """

    vllm_version: str | None = None
    non_default_args: dict[str, Any] | None = None
    phase: str = "starting"
    model_load_gib: float | None = None
    model_load_s: float | None = None
    cudagraph_estimate_gib: float | None = None  # "Estimated CUDA graph memory: X GiB total"
    cudagraph_pool_actual_gib: float | None = None  # "CUDA graph pool memory: X GiB (actual), …"
    cudagraph_pool_estimated_gib: float | None = None  # "… Y GiB (estimated)"
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
    failure_kind: str | None = None
    failure_phase: str | None = None
    failure_message: str | None = None  # the root cause line (never the generic one)
    failure_generic: str | None = None  # "EngineCore failed to start." and the like
    failure_device: str | None = None
    failure_free_gib: float | None = None
    failure_total_gib: float | None = None
    failure_requested_gmu: float | None = None
    failure_requested_gib: float | None = None
    failure_max_model_len: int | None = None
    failure_kv_needed_gib: float | None = None
    failure_kv_available_gib: float | None = None
    failure_kv_capacity_tokens: int | None = None  # older wording: tokens the KV cache can hold
    failure_estimated_max_model_len: int | None = None
    failure_oom_request_bytes: int | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    lines_seen: int = 0

    @property
    def state(self) -> str:
        """``"failed"``, ``"ready"`` (Application startup complete) or ``"starting"``."""
        if self.failed:
            return "failed"
        return "ready" if self.startup_complete else "starting"

    def failure_summary(self) -> str | None:
        """One short sentence for the ``vllm_start_failed`` event, or ``None`` when not failed.

        E.g. ``"vLLM refused to start: free memory 55.87 of 119.56 GiB < wanted
        95.65 GiB (gpu_memory_utilization 0.8)"`` (field-2/vllm-free-memory-refusal.log).
        """
        if not self.failed:
            return None
        k = self.failure_kind
        free, total, want, gmu = (
            self.failure_free_gib,
            self.failure_total_gib,
            self.failure_requested_gib,
            self.failure_requested_gmu,
        )
        if k == "free_memory" and free is not None and total is not None and want is not None and gmu is not None:
            return (
                f"vLLM refused to start: free memory {_gib(free)} of {_gib(total)} GiB "
                f"< wanted {_gib(want)} GiB (gpu_memory_utilization {gmu:g})"
            )
        if k == "max_model_len":
            head = f"vLLM refused to start: max_model_len {_opt(self.failure_max_model_len)}"
            if self.failure_kv_needed_gib is not None:
                text = f"{head} needs {_gib(self.failure_kv_needed_gib)} GiB of KV cache"
                if self.failure_kv_available_gib is not None:
                    text += f", only {_gib(self.failure_kv_available_gib)} GiB available"
            elif self.failure_kv_capacity_tokens is not None:
                text = f"{head} exceeds the KV cache capacity of {self.failure_kv_capacity_tokens} tokens"
            else:
                text = f"{head} does not fit the KV cache"
            if self.failure_estimated_max_model_len is not None:
                text += f" (estimated maximum model length {self.failure_estimated_max_model_len})"
            return text
        if k == "no_kv_memory":
            return "vLLM refused to start: no memory left for the KV cache blocks after the weights and profiling"
        during = _DURING.get(self.failure_phase or "starting", "start-up")
        if k == "cuda_oom":
            text = f"vLLM failed to start: CUDA out of memory during {during}"
            if self.failure_oom_request_bytes is not None:
                text += f" (tried to allocate {_fmt_bytes(self.failure_oom_request_bytes)})"
            return text
        if self.failure_message:
            return f"vLLM failed to start during {during}: {_clip(self.failure_message)}"
        return f"vLLM failed to start during {during} (no root cause in the log: {_clip(self.failure_generic or '?')})"

    def warnings(self) -> dict[str, str]:
        """Warnings the figures raise, ``{key: one sentence}`` (a key is stable: emit each once).

        ``negative_cudagraph_estimate``: vLLM estimated CUDA graph memory below
        zero (field-2/vllm-negative-cudagraph-estimate.log, a known vLLM bug
        fixed upstream); the estimate is subtracted from the budget, so the KV
        pool grows by its size and the real start-up peak exceeds the plan.
        """
        out: dict[str, str] = {}
        est = self.cudagraph_estimate_gib
        if est is not None and est < 0:
            pool = "the KV cache pool"
            if self.kv_cache_available_gib is not None:
                pool += f" ({_gib(self.kv_cache_available_gib)} GiB"
                pool += f", {self.kv_cache_tokens:,} tokens)" if self.kv_cache_tokens is not None else ")"
            out["negative_cudagraph_estimate"] = (
                f"vLLM estimated CUDA graph memory at {est:.2f} GiB (negative: a known vLLM bug); {pool} is "
                f"inflated by {-est:.2f} GiB, so the real start-up peak will be higher than planned"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state
        d["failure_summary"] = self.failure_summary()
        d["warnings"] = self.warnings()
        return d


def _gib(v: float) -> str:
    """A GiB figure as vLLM prints it: 24.0, 3.18, 90.6 (at least one decimal, at most two)."""
    text = f"{v:.2f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _opt(v: object) -> str:
    return "?" if v is None else str(v)


def _clip(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


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


_NUMS = rf"-?{_NUM}"
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
        re.compile(rf"Estimated CUDA graph memory:\s*(?P<cudagraph_estimate_gib>{_NUMS})\s*GiB"),
        _set(cudagraph_estimate_gib=_num),
    ),
    (
        re.compile(
            rf"CUDA graph pool memory:\s*(?P<cudagraph_pool_actual_gib>{_NUMS})\s*GiB\s*\(actual\)"
            rf"(?:,\s*(?P<cudagraph_pool_estimated_gib>{_NUMS})\s*GiB\s*\(estimated\))?"
        ),
        _set(cudagraph_pool_actual_gib=_num, cudagraph_pool_estimated_gib=_num),
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
            rf"(?:,\s*took\s+(?P<graph_capture_gib>{_NUMS})\s*GiB)?"
        ),
        _set(graph_capture_s=_num, graph_capture_gib=_num),
    ),
    (re.compile(rf"init engine \(.*?\) took\s+(?P<engine_init_s>{_NUM})\s*s"), _set(engine_init_s=_num)),
]

# Phase evidence: (regex, phase). The phase only moves forward.
_PHASE_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"vLLM (?:API )?server version|non-default args:|Initializing a V\d LLM engine"), "init"),
    (re.compile(r"Starting to load model|Loading weights|Loading safetensors|Model loading took"), "model_load"),
    (
        re.compile(
            r"Memory profiling takes|Initial profiling/warmup run|torch\.compile took|Profiling CUDA graph memory"
            r"|Estimated CUDA graph memory|Dynamo bytecode transform"
        ),
        "profiling",
    ),
    (re.compile(r"Available KV cache memory|GPU KV cache size|# GPU blocks"), "kv_cache"),
    (
        re.compile(r"Capturing CUDA graphs?|Capturing cudagraphs|Graph capturing finished|CUDA graph pool memory"),
        "graph_capture",
    ),
    (re.compile(r"init engine \(.*?\) took|Starting vLLM API server|Started server process"), "api_server"),
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
        self._candidate: str | None = None  # an exception line seen before any failure marker
        self._graph_frames = False  # a traceback frame named CUDA graph capture
        self._profiling_graphs = False  # "Profiling CUDA graph memory" (captures graphs) without its result yet

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
        for pattern, phase in _PHASE_PATTERNS:
            if pattern.search(msg):
                done += self._advance(phase)
        if not rec.startup_complete:
            done += self._failure(msg)
        if _COMPLETE_RE.search(msg):
            rec.startup_complete = True
            rec.startup_complete_ts = ts
            done.append("startup_complete")
            done += self._advance("ready")
        return list(dict.fromkeys(done))

    def _advance(self, phase: str) -> list[str]:
        rec = self.record
        if rec.failed or PHASES.index(phase) <= PHASES.index(rec.phase):
            return []
        rec.phase = phase
        return ["phase"]

    def _mark_failed(self) -> list[str]:
        rec = self.record
        if rec.failed:
            return []
        rec.failed = True
        phase = rec.phase
        if (phase == "kv_cache" and self._graph_frames) or (phase == "profiling" and self._profiling_graphs):
            phase = "graph_capture"
        rec.failure_phase = phase
        return ["failed", "failure_phase"]

    def _failure(self, msg: str) -> list[str]:
        rec = self.record
        done: list[str] = []
        if GRAPH_FRAME_RE.search(msg):
            self._graph_frames = True
        if "Profiling CUDA graph memory" in msg:
            self._profiling_graphs = True
        elif "Estimated CUDA graph memory" in msg:
            self._profiling_graphs = False
        if g := GENERIC_RE.search(msg):
            if rec.failure_generic is None:
                rec.failure_generic = g.group(0).strip()
                done.append("failure_generic")
            done += self._mark_failed()
            if rec.failure_message is None and self._candidate is not None:
                rec.failure_message, rec.failure_kind = self._candidate, "error"
                done += ["failure_message", "failure_kind"]
            return done
        cause = find_cause(msg)
        if cause is not None:
            if rec.failure_kind in (None, "error"):  # the first known cause wins; it beats a generic error
                for name, value in cause.figures.items():
                    setattr(rec, name, value)
                rec.failure_kind, rec.failure_message = cause.kind, cause.message
                done += [*self._mark_failed(), "failure_kind", "failure_message", *cause.figures]
            return done
        e = EXCEPTION_RE.search(msg)
        if e is None:
            return done
        text = e.group("msg").strip()
        if rec.failed and rec.failure_message is None:
            rec.failure_message, rec.failure_kind = text, "error"
            done += ["failure_message", "failure_kind"]
        elif not rec.failed and self._candidate is None:
            self._candidate = text
        return done

    def feed_many(self, lines: Iterable[str | bytes]) -> LaunchRecord:
        for line in lines:
            self.feed(line)
        return self.record


def parse_lines(lines: Iterable[str | bytes]) -> LaunchRecord:
    """Parse a finished log (an iterable of lines, e.g. ``text.splitlines()``)."""
    return LaunchLogParser().feed_many(lines)
