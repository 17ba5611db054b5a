"""Kernel-log evidence: classify NVRM ``NV_ERR_NO_MEMORY`` and OOM-killer lines.

Pure code only; the readers (``/dev/kmsg``, ``journalctl -k``, ``dmesg``) live
in :mod:`sparkd.sense.kernlog_readers` and are re-exported here.

* :func:`classify` turns one line from any reader into a :class:`KernRecord`
  or ``None``. It matches the stable part of the message (driver releases vary
  the ``mem_desc.c`` line number, function names and spacing).
* :class:`NvrmWindows` counts driver-error lines in tumbling windows; the
  MemFree rule uses :meth:`NvrmWindows.recent` as "a driver error was seen in
  the last ~10 s" (CONTEXT.md, "What the operators learned later").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Final

from sparkd.sense.kernlog_readers import (
    DmesgSource,
    JournalSource,
    KernLogSource,
    KmsgSource,
    NullSource,
    open_source,
)

__all__ = [
    "KINDS",
    "DmesgSource",
    "JournalSource",
    "KernLogSource",
    "KernRecord",
    "KmsgSource",
    "NullSource",
    "NvrmWindows",
    "classify",
    "open_source",
]

KINDS: Final = ("nvrm_no_memory", "nvrm_other", "oom_invoked", "oom_kill", "oom_killed")
NVRM_KINDS: Final = frozenset({"nvrm_no_memory", "nvrm_other"})


@dataclass(frozen=True, slots=True)
class KernRecord:
    """One classified kernel-log line.

    Attributes:
        kind: one of :data:`KINDS`.
        message: the kernel message, reader prefixes (timestamp, host, ident,
            kmsg header, ANSI colour) removed and surrounding space stripped.
        raw: the line as given to :func:`classify`.
        timestamp_s: seconds since boot (``dmesg``, kmsg, journal
            short-monotonic), else ``None``. Wall-clock prefixes (``dmesg -T``,
            journal short/short-iso) are kept verbatim in ``details["time_text"]``.
        seq: the ``/dev/kmsg`` sequence number, else ``None``.
        pid, comm: the process named by OOM lines (``oom_invoked`` has comm only).
        container_id: the 64-hex Docker id from ``task_memcg`` (``oom_kill``);
            the short (12) id is ``details["container_short_id"]``.
        details: kind-specific fields, e.g. ``status`` (``"0x00000051"``),
            ``source_file``/``source_line``, ``constraint``, ``global_oom``,
            ``task_memcg``, ``anon_rss_bytes``, ``total_vm_bytes`` (bytes, int).
    """

    kind: str
    message: str
    raw: str
    timestamp_s: float | None = None
    seq: int | None = None
    pid: int | None = None
    comm: str | None = None
    container_id: str | None = None
    details: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def is_nvrm(self) -> bool:
        """True for driver (NVRM) lines, both kinds."""
        return self.kind in NVRM_KINDS


# --- reader prefixes -------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# /dev/kmsg: "prio,seq,usec,flags[,...];message" (+ continuation lines " KEY=value").
_KMSG = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;(?P<msg>.*)$")
# dmesg -r "<6>" and dmesg -x "kern  :info  : " decorations.
_LEVEL = re.compile(r"^(?:<\d+>|[a-z]+\s*:\s*[a-z]+\s*:\s)")
_MONO = re.compile(r"^\[\s*(?P<ts>\d+\.\d+)\]\s?")
_DOW = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_MON = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_CTIME = re.compile(rf"^\[(?P<t>{_DOW} {_MON} +\d+ \d\d:\d\d:\d\d \d{{4}})\]\s?")  # dmesg -T
_ISO = re.compile(r"^(?P<t>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)\s")
_SYSLOG = re.compile(rf"^(?P<t>{_MON} +\d+ \d\d:\d\d:\d\d(?:\.\d+)?)\s")  # journal short
# journal: "host ident[pid]: message" after the time.
_JOURNAL_TAIL = re.compile(r"^(?P<host>[^\s:]+) (?P<ident>[^\s:\[]+)(?:\[\d+\])?: ?(?P<msg>.*)$")
_MONO_KERNEL = re.compile(r"^(?P<host>[^\s:]+) kernel: ?(?P<msg>.*)$")  # journal short-monotonic
_CALLER = re.compile(r"^\[\s*[TC]\d+\]\s?")  # CONFIG_PRINTK_CALLER "[T48213]"


def _strip_prefixes(line: str) -> tuple[str, float | None, int | None, dict[str, Any]]:
    """Return (message, timestamp_s, seq, details) for one reader line."""
    details: dict[str, Any] = {}
    first, *cont = line.split("\n")
    first = _ANSI.sub("", first).strip()
    m = _KMSG.match(first)
    if m:
        extra = dict(c.strip().split("=", 1) for c in cont if "=" in c)
        if extra:
            details["kmsg_dict"] = extra
        details["level"], details["facility"] = int(m["prio"]) & 7, int(m["prio"]) >> 3
        return m["msg"].strip(), int(m["usec"]) / 1e6, int(m["seq"]), details
    text = _LEVEL.sub("", first, count=1)
    ts: float | None = None
    if m := _MONO.match(text):
        ts, text = float(m["ts"]), text[m.end() :]
        if mk := _MONO_KERNEL.match(text):
            text, details["host"] = mk["msg"], mk["host"]
    elif m := _CTIME.match(text):
        details["time_text"], text = m["t"], text[m.end() :]
    elif m := _ISO.match(text) or _SYSLOG.match(text):
        details["time_text"], text = m["t"], text[m.end() :]
        # "2026-...T10:50:21,506578+00:00 msg" is dmesg --time-format iso: no host/ident.
        if "," not in m["t"] and (mj := _JOURNAL_TAIL.match(text)):
            text, details["host"], details["ident"] = mj["msg"], mj["host"], mj["ident"]
    text = _CALLER.sub("", text, count=1)
    return text.strip(), ts, None, details


# --- message matchers ------------------------------------------------------

_NVRM = re.compile(r"(?:^|[\s:])NVRM\s*:")
_NO_MEM = re.compile(r"\bNV_ERR_NO_MEMORY\b")
_NV_STATUS = re.compile(r"\(\s*(0x[0-9a-fA-F]+)\s*\)")
_NV_LOC = re.compile(r"@\s*(?P<file>[\w./-]+\.\w+)\s*:\s*(?P<line>\d+)")
_NV_FUNC = re.compile(r"NVRM\s*:\s*(?P<func>\w+)\s*:")
_NV_FROM = re.compile(r"returned from\s+(?P<from>.+?)(?:\s+@|$)")
_INVOKED = re.compile(r"^(?P<comm>.+?) invoked oom-killer:\s*(?P<rest>.*)$")
_KV_INT = re.compile(r"\b(?P<k>order|oom_score_adj)=(?P<v>-?\d+)")
_GFP = re.compile(r"\bgfp_mask=(?P<v>\S+?),")
_OOM_KILL = re.compile(r"^oom-kill:\s*(?P<body>.*)$")
_OOM_TASK = re.compile(r",\s*task=(?P<comm>.*),\s*pid=(?P<pid>\d+),\s*uid=(?P<uid>\d+)\s*$")
_DOCKER_ID = re.compile(r"(?:docker-|/docker/)(?P<id>[0-9a-f]{64})(?:\.scope)?(?:/|$)")
_KILLED = re.compile(
    r"^(?P<pre>(?:Memory cgroup )?[Oo]ut of memory(?: \(oom_kill_allocating_task\))?:\s*)?"
    r"Killed process (?P<pid>\d+) \((?P<comm>.*?)\)(?=[\s,]|$)(?P<rest>.*)$"
)
_KB = re.compile(r"(?P<k>[\w-]+):\s*(?P<v>\d+)kB")
_KILLED_INT = re.compile(r"\b(?P<k>UID|oom_score_adj):\s*(?P<v>-?\d+)\b")


def _classify_nvrm(flat: str) -> tuple[str, dict[str, Any]]:
    details: dict[str, Any] = {}
    if m := _NV_FUNC.search(flat):
        details["function"] = m["func"]
    if not _NO_MEM.search(flat):
        return "nvrm_other", details
    details["status_name"] = "NV_ERR_NO_MEMORY"
    if m := _NV_STATUS.search(flat):
        details["status"] = m[1].lower()
    if m := _NV_LOC.search(flat):
        details["source_file"], details["source_line"] = m["file"], int(m["line"])
    if m := _NV_FROM.search(flat):
        details["returned_from"] = m["from"]
    return "nvrm_no_memory", details


def _parse_oom_kill(body: str) -> tuple[str | None, int | None, dict[str, Any]]:
    """Parse "constraint=...,global_oom,task_memcg=...,task=X,pid=N,uid=U"."""
    details: dict[str, Any] = {"global_oom": False}
    comm: str | None = None
    pid: int | None = None
    if m := _OOM_TASK.search(body):
        comm, pid, details["uid"] = m["comm"], int(m["pid"]), int(m["uid"])
        body = body[: m.start()]
    key: str | None = None
    for token in body.split(","):
        token = token.strip()
        if "=" in token:
            key, value = token.split("=", 1)
            details[key] = value
        elif token == "global_oom":
            details["global_oom"] = True
        elif key is not None and token:  # "mems_allowed=0,2": a list with commas
            details[key] = f"{details[key]},{token}"
    return comm, pid, details


def classify(line: str) -> KernRecord | None:
    """Classify one kernel-log line from any reader; ``None`` when irrelevant.

    Accepted line shapes: ``dmesg`` (``[52595.758098] msg``, also ``-r``/``-x``
    decorations and ANSI colour), ``dmesg -T``, ``dmesg --time-format iso``,
    ``/dev/kmsg`` records (``6,1234,52595758098,-;msg`` with optional
    continuation lines ``" KEY=value"``, escapes already undone by the reader),
    ``journalctl -k`` short / short-iso / short-precise / short-monotonic,
    and a bare message.

    Kinds: ``nvrm_no_memory`` (an ``NVRM:`` line with ``NV_ERR_NO_MEMORY``),
    ``nvrm_other`` (any other ``NVRM:`` line), ``oom_invoked``
    (``X invoked oom-killer:``), ``oom_kill`` (``oom-kill:constraint=...``) and
    ``oom_killed`` (``[Memory cgroup ]Out of memory: Killed process N (comm)``).
    A line that merely mentions memory is ``None``. Never raises.
    """
    if not line or not line.strip():
        return None
    msg, ts, seq, details = _strip_prefixes(line)
    flat = " ".join(msg.split())
    pid: int | None = None
    comm: str | None = None
    container_id: str | None = None
    if _NVRM.search(flat):
        kind, more = _classify_nvrm(flat)
    elif m := _OOM_KILL.match(flat):
        kind = "oom_kill"
        comm, pid, more = _parse_oom_kill(m["body"])
        for cg in ("task_memcg", "oom_memcg"):
            if md := _DOCKER_ID.search(str(more.get(cg, ""))):
                container_id = md["id"]
                more["container_short_id"] = container_id[:12]
                break
    elif m := _KILLED.match(flat):
        kind, pid, comm = "oom_killed", int(m["pid"]), m["comm"]
        more = {"memcg_oom": (m["pre"] or "").startswith("Memory cgroup")}
        for mk in _KB.finditer(m["rest"]):
            more[mk["k"].replace("-", "_").lower() + "_bytes"] = int(mk["v"]) * 1024
        for mi in _KILLED_INT.finditer(m["rest"]):
            more[mi["k"].lower()] = int(mi["v"])
    elif m := _INVOKED.match(flat):
        kind, comm, more = "oom_invoked", m["comm"], {}
        for mi in _KV_INT.finditer(m["rest"]):
            more[mi["k"]] = int(mi["v"])
        if mg := _GFP.search(m["rest"] + ","):
            more["gfp_mask"] = mg["v"]
    else:
        return None
    details.update(more)
    return KernRecord(kind, msg, line, ts, seq, pid, comm, container_id, details)


# --- counting --------------------------------------------------------------


class NvrmWindows:
    """Count driver-error lines in tumbling windows ``[k*W, (k+1)*W)``.

    Each line is assigned by its arrival time ``now`` to exactly one window.
    ``now`` is the **monotonic** clock (issue 13: on the wall clock a 1 h step
    back kept one driver error "recent" for an hour and held the MemFree rule's
    evidence gate open). Wall time only labels the stored window: pass ``wall``
    (epoch s at ``now``) and the window start is reported in epoch seconds;
    without it the label is on ``now``'s clock. Time must not go backwards; if
    it does, the line is counted in the current open window (never lost, never
    twice).

    * :meth:`recent` = lines in the current window + the previous one, i.e.
      an evidence window between W and 2W seconds long (10-20 s with the
      default W = 10 s, the notes' "driver error in the last ~10 s").
    * :meth:`closed_windows` drains ``(window_start, count)`` for every window
      that has closed and had at least one line; :meth:`flush` also drains the
      open window (shutdown). Right after a drain, the sum of all drained
      counts + :attr:`open_count` == :attr:`total`.

    Raises:
        ValueError: ``window_s`` is not a positive finite number.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        self.window_s = float(window_s)
        self.total = 0
        self._k: int | None = None  # index of the open window
        self._count = 0
        self._prev: tuple[int, int] | None = None  # (index, count) of the last closed window
        self._closed: list[tuple[float, int]] = []
        self._offset = 0.0  # wall − monotonic when the open window began: labels it in epoch seconds

    def _label(self, k: int) -> float:
        return k * self.window_s + self._offset

    def _advance(self, now: float, wall: float | None = None) -> int:
        k = math.floor(now / self.window_s)
        if self._k is None:
            self._k = k
            if wall is not None:
                self._offset = wall - now
        elif k > self._k:
            if self._count:
                self._closed.append((self._label(self._k), self._count))
            self._prev, self._k, self._count = (self._k, self._count), k, 0
            if wall is not None:
                self._offset = wall - now
        return self._k

    def add(self, n: int, now: float, wall: float | None = None) -> None:
        """Count ``n`` (>= 0) lines that arrived at ``now`` (monotonic s; ``wall``: epoch s then, for
        the stored label). Raises ValueError if n < 0."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._advance(now, wall)
        self._count += n
        self.total += n

    def count_line(self, now: float, wall: float | None = None) -> None:
        """Count one line that arrived at ``now`` (see ``add``)."""
        self.add(1, now, wall)

    def recent(self, now: float) -> int:
        """Lines in the current window plus the immediately previous window."""
        if not self._count and (self._prev is None or not self._prev[1]):
            return 0  # no line in either: advancing changes nothing this answers (a frame less per idle tick, issue 18)
        k = self._advance(now)
        prev = self._prev[1] if self._prev is not None and self._prev[0] == k - 1 else 0
        return self._count + prev

    @property
    def open_count(self) -> int:
        """Lines in the window that is still open (not yet drained)."""
        return self._count

    def closed_windows(self, now: float | None = None) -> list[tuple[float, int]]:
        """Drain ``[(window_start, count), ...]`` of closed windows, oldest first.

        With ``now``, windows that ended before ``now`` are closed first.
        Windows with no lines are not listed.
        """
        if not self._count and not self._closed:
            return []  # no line since the last drain: advancing would close nothing (issue 18)
        if now is not None:
            self._advance(now)
        out, self._closed = self._closed, []
        return out

    def flush(self) -> list[tuple[float, int]]:
        """Drain every window including the open one (for shutdown)."""
        out = self.closed_windows()
        if self._k is not None and self._count:
            out.append((self._label(self._k), self._count))
            self._prev, self._count = (self._k, self._count), 0
        return out
