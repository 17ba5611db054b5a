"""Optional GPU readings: NVML through ``pynvml`` (package ``nvidia-ml-py``) and nvidia-smi text.

On the unified-memory GB10 "Not Supported" is a normal answer, not an error:
the driver cannot report framebuffer memory, so ``nvmlDeviceGetMemoryInfo``
fails with ``NVML_ERROR_NOT_SUPPORTED`` on some driver releases and succeeds
on others with a total equal to MemTotal; ``nvidia-smi`` prints
``Not Supported`` in its table and ``[N/A]`` in CSV queries. Utilization,
temperature and power do work. Host ``/proc/meminfo`` stays the ground truth
for memory (CONTEXT.md, "The machine"; tests/fixtures/nvidia-smi/README.md).

Shapes:
    ``read_gpu(nvml=None) -> list[GpuReading]`` — one per device, or one
    ``GpuReading.unavailable(reason)`` when the package or the driver is missing.
    ``parse_nvidia_smi_query_csv(text) -> list[dict[str, float | str | None]]``
    ``parse_nvidia_smi_table(text) -> SmiTable``

NVML calls can block inside the driver. The guard loop must never call
``read_gpu``/``GpuSampler.sample`` inline: the daemon reads through a helper process
(``sparkd.sense.gpu_helper.GpuHelper``, which holds the ``GpuSession``), asked from a worker thread.

``python -m sparkd.sense.gpu`` prints the readings as JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sparkd.units import MiB

log = logging.getLogger(__name__)

# pynvml error codes (nvml.h); used when the injected module lacks the constant.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_TEMPERATURE_GPU = 0


@dataclass(slots=True, frozen=True)
class GpuReading:
    """One device's NVML view. Sizes in bytes, power in W, temperature in °C.

    ``memory_supported`` is ``False`` when NVML answered NOT_SUPPORTED (GB10);
    then ``memory_total_bytes``/``memory_used_bytes`` are ``None``. When a
    driver reports memory on GB10 the total equals MemTotal and is kept as is.
    ``available`` is ``False`` only for ``GpuReading.unavailable(reason)``.
    ``notes`` lists fields that failed for another reason (``"power: ..."``).
    ``no_driver`` (an unavailable reading only) is ``True`` when sparkd knows the host has no NVIDIA driver loaded
    (``/proc/driver/nvidia`` absent, ``sparkd.sense.gpu_helper``): then the driver-memory estimate
    (``Sample.driver_bytes``) is a remainder of the meminfo arithmetic, not driver memory.
    ``final`` (an unavailable reading only) is ``False`` when asking again may help (a helper process that
    failed, ``sparkd.sense.gpu_helper``) and ``True`` when it will not (no driver, no package, no device);
    it is not part of ``to_json``.
    """

    index: int | None
    name: str | None = None
    driver_version: str | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_supported: bool | None = None
    available: bool = True
    reason: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    no_driver: bool = False
    final: bool = True

    @classmethod
    def unavailable(cls, reason: str, *, final: bool = True, no_driver: bool = False) -> GpuReading:
        """No readings at all: package missing, driver not loaded (``no_driver`` where that is known), no device
        (``final``), or a helper that failed (``final=False``)."""
        return cls(index=None, available=False, reason=reason, final=final, no_driver=no_driver)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        del d["final"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GpuReading:
        """The inverse of ``to_json``. Raises ``TypeError`` for an unknown or missing field."""
        return cls(**{**d, "notes": tuple(d.get("notes") or ())})


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _import_pynvml() -> Any:
    import pynvml  # optional dependency (nvidia-ml-py), imported lazily

    return pynvml


def _is_not_supported(nvml: Any, exc: BaseException) -> bool:
    code = getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED)
    return getattr(exc, "value", None) == code


def read_gpu(nvml: Any = None) -> list[GpuReading]:
    """Read every NVIDIA device through NVML once: ``nvmlInit``, the readings, ``nvmlShutdown``;
    never raises. For repeated readings keep a ``GpuSession`` open instead (``bench/nvml.py``:
    the init is most of a reading's cost).

    Args:
        nvml: an object with pynvml's API (``nvmlInit``, ``nvmlDeviceGetCount``,
            ``NVMLError``, ...). ``None`` imports ``pynvml`` lazily; tests inject
            a fake.

    Returns:
        One ``GpuReading`` per device, or ``[GpuReading.unavailable(reason)]``
        when ``nvidia-ml-py`` is not installed, NVML cannot initialize (no
        driver) or there is no device.
    """
    session = GpuSession(nvml)
    try:
        return session.read()
    finally:
        session.close()


class GpuSession:
    """One NVML session kept open across readings: ``nvmlInit`` at the first ``read`` and again
    after a reading that failed (no device answered, a handle lost or an answer in ``STALE_CODES``: the
    driver reloaded, a GPU fell off the bus), ``nvmlShutdown`` at ``close``. The driver's version and the
    devices' handles and names are asked once per session. Not thread-safe: one reader at a time.

    ``read()`` has ``read_gpu``'s shape and never raises.
    """

    #: A session that turned stale again at its first reading (a device gone for good, a refused handle) is kept
    #: this long (s) before the next ``nvmlInit``: an init costs ~13 ms of CPU (bench/nvml.py on an H200 host).
    REOPEN_BACKOFF_S = 300.0

    def __init__(self, nvml: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml = nvml
        self._open = False
        self._clock = clock
        self._stale_streak = 0  # readings in a row that said the session is stale
        self._reopened_at: float | None = None  # when a stale session was last closed to reopen (clock s)
        # what does not change within a session: the driver's version, each device's handle and name. Asked
        # once per session, not at every reading (issue 18: 4 of a reading's 8 NVML calls, bench/nvml.py)
        self._devices: tuple[str | None, list[_Device]] | None = None

    def read(self) -> list[GpuReading]:
        nvml = self._nvml
        if nvml is None:
            try:
                nvml = self._nvml = _import_pynvml()
            except ImportError:
                return [GpuReading.unavailable("nvidia-ml-py (pynvml) is not installed")]
        nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        if not self._open:
            try:
                nvml.nvmlInit()
            except nvml_error as exc:
                return [GpuReading.unavailable(f"NVML init failed: {exc}")]
            except OSError as exc:  # libnvidia-ml.so missing on some pynvml versions
                return [GpuReading.unavailable(f"NVML library not found: {exc}")]
            self._open = True
        if self._devices is None:
            found = _find_devices(nvml, nvml_error)
            if isinstance(found, GpuReading):
                self.close()  # start afresh at the next reading
                return [found]
            self._devices = found
        driver, devices = self._devices
        read = [_read_device(nvml, nvml_error, d, driver) for d in devices]
        if not any(stale for _r, stale in read):
            self._stale_streak = 0
            return [r for r, _stale in read]
        now = self._clock()
        reopened = self._reopened_at
        # the first stale answer reopens at once (a driver reloaded: the next reading finds it); while reopening
        # does not help (a device gone for good), once per REOPEN_BACKOFF_S
        if self._stale_streak == 0 or reopened is None or now - reopened >= self.REOPEN_BACKOFF_S:
            self.close()  # start afresh at the next reading: init, and find the devices again
            self._reopened_at = now
        self._stale_streak += 1
        return [r for r, _stale in read]

    def close(self) -> None:
        """End the session (``nvmlShutdown``); the next ``read`` opens a new one."""
        self._devices = None
        if self._open:
            self._open = False
            nvml = self._nvml
            with contextlib.suppress(getattr(nvml, "NVMLError", Exception)):
                nvml.nvmlShutdown()


@dataclass(frozen=True)
class _Device:
    """One device as a session found it: its index, handle (None: NVML gave none), name and notes."""

    index: int
    handle: Any
    name: str | None
    notes: tuple[str, ...]


def _find_devices(nvml: Any, nvml_error: type[BaseException]) -> tuple[str | None, list[_Device]] | GpuReading:
    """The driver's version and each device's handle and name; or why there is none (a ``GpuReading``)."""
    try:
        driver: str | None = _text(nvml.nvmlSystemGetDriverVersion())
    except nvml_error:
        driver = None
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except nvml_error as exc:
        return GpuReading.unavailable(f"NVML device count failed: {exc}")
    if count == 0:
        return GpuReading.unavailable("NVML reports no device")
    devices = []
    for index in range(count):
        notes: list[str] = []
        name = h = None
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml_error as exc:
            notes.append(f"handle: {exc}")
        if h is not None:
            try:
                name = _text(nvml.nvmlDeviceGetName(h))
            except nvml_error as exc:
                notes.append(f"name: {exc}")
        devices.append(_Device(index, h, name, tuple(notes)))
    return driver, devices


#: NVML's answers that mean the session's handles are no good any more (nvml.h ``nvmlReturn_t``): uninitialized,
#: invalid argument (a stale handle), not found, driver not loaded, timeout, GPU is lost, reset required,
#: operating system, library and driver versions differ, GPU not found, unknown. After one of them the session
#: starts afresh, and finds its devices again (at most every ``REOPEN_BACKOFF_S`` while it keeps happening).
STALE_CODES = frozenset({1, 2, 6, 9, 10, 15, 16, 17, 18, 28, 999})


def _read_device(
    nvml: Any, nvml_error: type[BaseException], dev: _Device, driver: str | None
) -> tuple[GpuReading, bool]:
    """The readings that move (utilization, temperature, power, memory) of a device the session found, and
    whether an answer said the session is stale (``STALE_CODES``)."""
    notes: list[str] = list(dev.notes)
    stale = False

    def call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal stale
        try:
            return fn(*args)
        except nvml_error as exc:
            notes.append(f"{what}: {exc}")
            stale = stale or getattr(exc, "value", None) in STALE_CODES
            return None

    index, h, name = dev.index, dev.handle, dev.name
    if h is None:
        return GpuReading(index=index, driver_version=driver, notes=tuple(notes)), True
    util = call("utilization", nvml.nvmlDeviceGetUtilizationRates, h)
    temp_kind = getattr(nvml, "NVML_TEMPERATURE_GPU", NVML_TEMPERATURE_GPU)
    temp = call("temperature", nvml.nvmlDeviceGetTemperature, h, temp_kind)
    power_mw = call("power", nvml.nvmlDeviceGetPowerUsage, h)
    total = used = None
    supported: bool | None
    try:
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        total, used, supported = int(mem.total), int(mem.used), True
    except nvml_error as exc:
        # NOT_SUPPORTED is GB10's normal answer; anything else is a note.
        supported = False if _is_not_supported(nvml, exc) else None
        if supported is None:
            notes.append(f"memory: {exc}")
            stale = stale or getattr(exc, "value", None) in STALE_CODES
    reading = GpuReading(
        index=index,
        name=name,
        driver_version=driver,
        utilization_pct=None if util is None else float(util.gpu),
        temperature_c=None if temp is None else float(temp),
        power_w=None if power_mw is None else power_mw / 1000.0,
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_supported=supported,
        notes=tuple(notes),
    )
    return reading, stale


class GpuSampler:
    """Calls NVML at most every ``interval_s`` seconds and logs each condition once.

    ``sample()`` returns the cached readings between calls. "memory Not
    Supported" (GB10) and "NVML unavailable" are logged once at INFO, not per
    sample; a condition that clears and comes back is logged again.

    Args:
        interval_s: minimum seconds between NVML calls (10 s: readings are
            dashboard context, never a stop trigger).
        reader: default one ``GpuSession`` kept open (one ``nvmlInit`` for the daemon's life,
            not one per reading: the init is the costly part, llnl/variorum#427); or a fake.
        clock: monotonic seconds (``time.monotonic``); injectable for tests.
    """

    def __init__(
        self,
        interval_s: float = 10.0,
        *,
        reader: Callable[[], list[GpuReading]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.interval_s = interval_s
        self._reader = reader if reader is not None else GpuSession().read
        self._clock = clock
        self._log = logger
        self._last_at: float | None = None
        self._last: list[GpuReading] = []
        self._logged: set[str] = set()

    def sample(self) -> list[GpuReading]:
        now = self._clock()
        if self._last_at is not None and now - self._last_at < self.interval_s:
            return self._last
        self._last_at = now
        self._last = self._reader()
        self._note(self._last)
        return self._last

    def _note(self, readings: list[GpuReading]) -> None:
        current: dict[str, str] = {}
        for r in readings:
            if not r.available:
                current["unavailable"] = f"GPU readings unavailable: {r.reason}"
            elif r.memory_supported is False:
                current[f"mem-ns-{r.index}"] = (
                    f"GPU {r.index} ({r.name}): NVML memory is Not Supported "
                    "(unified memory); /proc/meminfo is the ground truth"
                )
        for key, msg in current.items():
            if key not in self._logged:
                self._log.info(msg)
        self._logged = set(current)


# --- nvidia-smi text ---------------------------------------------------------

_NA = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", ""}
_NUM = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([A-Za-z%]*)\s*$")
_HEADER = re.compile(r"^\s*([^\[]+?)\s*(?:\[([^\]]+)\])?\s*$")


def parse_nvidia_smi_query_csv(text: str) -> list[dict[str, float | str | None]]:
    """Parse ``nvidia-smi --query-gpu=... --format=csv[,nounits]`` output (header required).

    Keys are the query field names without unit (``"memory.total"``). Values:
    ``[N/A]``/``[Not Supported]`` → ``None``; a ``MiB`` field → bytes (``int``);
    other numbers (``%``, ``W``, °C) → ``float``;
    anything else stays a string (``"NVIDIA GB10"``).
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    fields: list[tuple[str, str | None]] = []
    for h in lines[0].split(","):
        m = _HEADER.match(h)
        fields.append((m.group(1), m.group(2)) if m else (h.strip(), None))
    rows: list[dict[str, float | str | None]] = []
    for line in lines[1:]:
        row: dict[str, float | str | None] = {}
        for (name, unit), raw in zip(fields, line.split(","), strict=False):
            row[name] = _value(raw.strip(), unit)
        rows.append(row)
    return rows


def _value(raw: str, unit: str | None) -> float | str | None:
    if raw in _NA:
        return None
    m = _NUM.match(raw)
    if not m:
        return raw
    number = float(m.group(1))
    if (unit or m.group(2)) == "MiB":
        return int(number * MiB)
    return number


@dataclass(slots=True, frozen=True)
class SmiGpu:
    """One GPU row of the nvidia-smi table. ``memory_supported`` False on GB10."""

    index: int
    name: str
    memory_supported: bool
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None


@dataclass(slots=True, frozen=True)
class SmiTable:
    """What sparkd needs from the default ``nvidia-smi`` table."""

    driver_version: str | None
    cuda_version: str | None
    gpus: tuple[SmiGpu, ...]

    @property
    def memory_not_supported(self) -> bool:
        """True when any GPU prints ``Not Supported`` under Memory-Usage (GB10)."""
        return any(not g.memory_supported for g in self.gpus)


_DRIVER = re.compile(r"Driver Version:\s*(\S+)")
_CUDA = re.compile(r"CUDA Version:\s*(\S+)")
_GPU_ROW = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|")
_MEM = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB")


def parse_nvidia_smi_table(text: str) -> SmiTable:
    """Parse the default ``nvidia-smi`` table: driver, CUDA, and per GPU name and Memory-Usage.

    The GPU row (``|   0  NVIDIA GB10   On  |``) is followed by a row whose
    middle column is either ``123MiB / 81559MiB`` or ``Not Supported``.
    """
    lines = text.splitlines()
    driver = _DRIVER.search(text)
    cuda = _CUDA.search(text)
    gpus = []
    for i, line in enumerate(lines):
        m = _GPU_ROW.match(line)
        if not m:
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        cols = nxt.split("|")
        mem_col = cols[2] if len(cols) > 2 else ""
        mm = _MEM.search(mem_col)
        if mm:
            used, total = int(mm.group(1)) * MiB, int(mm.group(2)) * MiB
            gpus.append(SmiGpu(int(m.group(1)), m.group(2), True, used, total))
        else:
            gpus.append(SmiGpu(int(m.group(1)), m.group(2), "Not Supported" not in mem_col))
    return SmiTable(driver.group(1) if driver else None, cuda.group(1) if cuda else None, tuple(gpus))


def main() -> int:
    """``python -m sparkd.sense.gpu``: print NVML readings as JSON (for checks on a GPU host)."""
    readings = read_gpu()
    print(json.dumps([r.to_json() for r in readings], indent=2))
    return 0 if all(r.available for r in readings) else 1


if __name__ == "__main__":
    raise SystemExit(main())
