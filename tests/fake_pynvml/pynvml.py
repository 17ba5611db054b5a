"""A stand-in for pynvml (nvidia-ml-py), imported by a real ``sparkd.sense.gpu_helper`` process in tests through
``PYTHONPATH``: this machine has no NVIDIA driver. Only the driver edge is replaced; the helper process, its pipes,
its time-outs and its ends are real.

The test steers it through a file named by ``FAKE_NVML_MODE_FILE``, read at each call:
``ok`` (a GB10: memory Not Supported), ``hang`` (the utilization call never returns, as a call blocked in the
driver), ``crash`` (the process dies of SIGSEGV in the utilization call), ``crash-slow`` (the same, its stdout closed
0.5 s before), ``nodriver`` (nvmlInit fails: Driver
Not Loaded). Each call is appended to ``FAKE_NVML_LOG`` as ``<what> <pid>``.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__({3: "Not Supported", 9: "Driver Not Loaded"}.get(value, f"code {value}"))
        self.value = value


def _mode() -> str:
    with open(os.environ["FAKE_NVML_MODE_FILE"]) as f:
        return f.read().strip()


def _log(what: str) -> None:
    with open(os.environ["FAKE_NVML_LOG"], "a") as f:
        f.write(f"{what} {os.getpid()}\n")


def nvmlInit() -> None:
    _log("init")
    if _mode() == "nodriver":
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)


def nvmlShutdown() -> None:
    _log("shutdown")


def nvmlSystemGetDriverVersion() -> str:
    return "580.126.09"


def nvmlDeviceGetCount() -> int:
    return 1


def nvmlDeviceGetHandleByIndex(i: int) -> str:
    return f"h{i}"


def nvmlDeviceGetName(h: str) -> bytes:
    return b"NVIDIA GB10"


def nvmlDeviceGetUtilizationRates(h: str) -> SimpleNamespace:
    _log("read")
    mode = _mode()
    if mode == "hang":
        while True:
            time.sleep(3600)
    if mode == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "crash-slow":  # its stdout ends well before its exit status is there (a core being written)
        os.close(1)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSEGV)
    return SimpleNamespace(gpu=7, memory=0)


def nvmlDeviceGetTemperature(h: str, kind: int) -> int:
    return 36


def nvmlDeviceGetPowerUsage(h: str) -> int:
    return 11170  # mW


def nvmlDeviceGetMemoryInfo(h: str) -> SimpleNamespace:
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # GB10
