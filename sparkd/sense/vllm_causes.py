"""Root causes of a failed vLLM start, found in single log lines (used by ``sense.vllm_log``).

vLLM prints a generic line (``EngineCore failed to start.``, ``Engine core
initialization failed. See root cause above``) around the real exception; the
known causes below are what operators act on (field-2 reports, public bug
reports). Wordings differ between releases; each pattern accepts the older
and newer ones written in tests/test_vllm_causes.py:

* ``free_memory``: ``Free memory on device [cuda:0] (F/T GiB) on startup is
  less than desired GPU memory utilization (GMU, W GiB)``;
* ``max_model_len``: ``… max seq len (N) …`` with ``X GiB KV cache is needed``,
  ``available KV cache memory (Y GiB)``, ``estimated maximum model length is
  M`` (v1) or ``maximum number of tokens that can be stored in KV cache (K)``
  (v0);
* ``no_kv_memory``: ``No available memory for the cache blocks``;
* ``cuda_oom``: ``torch.OutOfMemoryError`` / ``torch.cuda.OutOfMemoryError`` /
  ``CUDA error: out of memory``, with ``Tried to allocate S MiB`` as bytes.

Figures are GiB floats as printed (field names ``failure_*`` of the launch
record), token counts ints, the OOM request in bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

NUM = r"\d[\d,]*(?:\.\d+)?"


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _int(text: str) -> int:
    return int(_num(text))


@dataclass(frozen=True, slots=True)
class Cause:
    """``kind`` (see the module doc), ``message`` (the exception text of the line) and ``figures``
    (launch-record field name → value)."""

    kind: str
    message: str
    figures: dict[str, Any] = field(default_factory=dict)


# Causes. Searched anywhere in a line (a traceback's last line, an ERROR log line, …).
_FREE_MEMORY_RE = re.compile(
    rf"Free memory on device\s*(?P<failure_device>[^\s(]+)?\s*\("
    rf"(?P<failure_free_gib>{NUM})\s*/\s*(?P<failure_total_gib>{NUM})\s*GiB\)"
    rf" on startup is less than desired GPU memory utilization\s*\("
    rf"(?P<failure_requested_gmu>{NUM}),\s*(?P<failure_requested_gib>{NUM})\s*GiB\)"
)
_MAXLEN_RE = re.compile(rf"max seq len\s*\((?P<len>{NUM})\)", re.IGNORECASE)
_MAXLEN_FIGURES: tuple[tuple[str, re.Pattern[str], Callable[[str], Any]], ...] = (
    ("failure_kv_needed_gib", re.compile(rf"(?P<v>{NUM})\s*GiB KV cache is needed"), _num),
    ("failure_kv_available_gib", re.compile(rf"available KV cache memory\s*\((?P<v>{NUM})\s*GiB\)"), _num),
    (
        "failure_kv_capacity_tokens",
        re.compile(rf"maximum number of tokens that can be stored in KV cache\s*\((?P<v>{NUM})\)"),
        _int,
    ),
    ("failure_estimated_max_model_len", re.compile(rf"estimated maximum model length is\s*(?P<v>{NUM})"), _int),
)
_NO_KV_RE = re.compile(r"No available memory for the cache blocks")
_OOM_RE = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory", re.IGNORECASE)
_OOM_TRIED_RE = re.compile(rf"Tried to allocate\s+(?P<v>{NUM})\s*(?P<unit>[KMGT]i?B)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
GENERIC_RE = re.compile(
    r"EngineCore failed to start.*|Engine core initialization failed.*|Engine process failed to start.*"
)
EXCEPTION_RE = re.compile(r"(?:^|\]\s*|\s)(?P<msg>(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception):\s.*)$")
GRAPH_FRAME_RE = re.compile(r"capture_model|cuda_?graph|CUDAGraph", re.IGNORECASE)
_LEVEL_PREFIX_RE = re.compile(r"^\s*(?:[A-Z]+\s+\d\d-\d\d \d\d:\d\d:\d\d\s+)?(?:\[[^\]]*\]\s*)?")


def find_cause(msg: str) -> Cause | None:
    """The known cause in one (prefix-stripped) log line, or ``None``. Never raises: a cause whose
    figures do not parse is not a cause sparkd can state."""
    try:
        if m := _FREE_MEMORY_RE.search(msg):
            figs: dict[str, Any] = {
                "failure_free_gib": _num(m.group("failure_free_gib")),
                "failure_total_gib": _num(m.group("failure_total_gib")),
                "failure_requested_gmu": _num(m.group("failure_requested_gmu")),
                "failure_requested_gib": _num(m.group("failure_requested_gib")),
            }
            if m.group("failure_device"):
                figs["failure_device"] = m.group("failure_device")
            return Cause("free_memory", exception_text(msg), figs)
        if m := _MAXLEN_RE.search(msg):
            figs = {"failure_max_model_len": _int(m.group("len"))}
            for name, pattern, conv in _MAXLEN_FIGURES:
                if fm := pattern.search(msg):
                    figs[name] = conv(fm.group("v"))
            return Cause("max_model_len", exception_text(msg), figs)
        if _NO_KV_RE.search(msg):
            return Cause("no_kv_memory", exception_text(msg))
        if _OOM_RE.search(msg):
            figs = {}
            if tm := _OOM_TRIED_RE.search(msg):
                figs["failure_oom_request_bytes"] = int(_num(tm.group("v")) * _UNITS[tm.group("unit")[0]])
            return Cause("cuda_oom", exception_text(msg), figs)
    except (ValueError, OverflowError):
        return None
    return None


def exception_text(msg: str) -> str:
    """The exception part of a line (``ValueError: …``), else the line without its log-level prefix."""
    if e := EXCEPTION_RE.search(msg):
        return e.group("msg").strip()
    return _LEVEL_PREFIX_RE.sub("", msg, count=1).strip()
