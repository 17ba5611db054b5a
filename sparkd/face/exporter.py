"""``GET /metrics``: Prometheus text from the daemon's in-memory state at scrape time.

A per-app ``CollectorRegistry`` holds one custom collector (no global registry,
no metrics updated from the guard path). The endpoint takes a snapshot on the
event loop (``status_json`` reads loop-owned state; a typed ``sparkd.loop.status.Status``), lists the archive
directory in a worker thread, and hands both to the collector through a
context variable, so concurrent scrapes do not mix.

Names follow node_exporter's meminfo collector where they mirror /proc/meminfo
(``sparkd_memory_MemAvailable_bytes``) and /proc/pressure
(``sparkd_pressure_memory_some_avg10``, a percentage as the kernel prints it).
Counters read totals the daemon keeps since its start.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.responses import Response

from sparkd.core.choices import CONTAINER_MODES
from sparkd.core.lifecycle import ContainerState
from sparkd.loop.status import Status

if TYPE_CHECKING:
    from fastapi import FastAPI

    from sparkd.loop.status import DaemonView

#: sample column → meminfo name (gauge ``sparkd_memory_<name>_bytes``)
MEMINFO_GAUGES = {
    "mem_total": "MemTotal",
    "mem_available": "MemAvailable",
    "mem_free": "MemFree",
    "cached": "Cached",
    "buffers": "Buffers",
    "anon_pages": "AnonPages",
    "slab": "Slab",
    "page_tables": "PageTables",
    "shmem": "Shmem",
    "swap_free": "SwapFree",
    "swap_total": "SwapTotal",
}
PSI_GAUGES = ("some_avg10", "some_avg60", "full_avg10", "full_avg60")
#: label values of ``sparkd_container_state``: every ``ContainerState`` (the same words as /api/status)
CONTAINER_STATES: tuple[str, ...] = tuple(s.value for s in ContainerState)


@dataclass
class Snapshot:
    status: Status
    ticks: list[float] = field(default_factory=list)
    archives: tuple[int, int] = (0, 0)  # count, total bytes
    sample_age_s: float | None = None  # since the guard's last sample (monotonic); None before the first
    sample_max_age_s: float = 3.0  # older: the memory gauges are left out (``/healthz``'s limit)
    read_error: bool = False  # the guard's last read of /proc/meminfo failed: left out too


_SNAPSHOT: contextvars.ContextVar[Snapshot | None] = contextvars.ContextVar("sparkd_metrics_snapshot", default=None)


def take_snapshot(daemon: DaemonView) -> Snapshot:
    """In-memory state only; call on the event loop."""
    # not views.status_view: a scrape shows the last GPU reading and does not ask for another (gpu_quiet_interval_s)
    from sparkd.face.presenters import guard_age_s, sample_max_age_s

    return Snapshot(
        status=daemon.status_json(),
        ticks=sorted(daemon.tick_durations),
        sample_age_s=guard_age_s(daemon),
        sample_max_age_s=sample_max_age_s(daemon),
        read_error=daemon.guard is not None and daemon.guard.read_error is not None,
    )


class SparkdCollector(Collector):
    """Reads the snapshot set for this scrape (or ``take_snapshot`` when called directly)."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        snap = _SNAPSHOT.get() or take_snapshot(self.daemon)
        if snap.sample_age_s is not None:
            age = GaugeMetricFamily(
                "sparkd_sample_age_seconds",
                "Seconds since the guard's last memory sample; past 3 intervals the memory gauges are left out",
            )
            age.add_metric([], snap.sample_age_s)
            yield age
        # a reading sparkd can no longer take is no reading: the last good MemAvailable was served as current while
        # every rule was blind, and a Prometheus alert on it could never fire (helper-53)
        if snap.sample_age_s is not None and snap.sample_age_s <= snap.sample_max_age_s and not snap.read_error:
            yield from self._memory(snap.status)
        yield from self._rules(snap.status)
        yield from self._daemon(snap)

    @staticmethod
    def _memory(st: Status) -> Iterator[Metric]:
        """meminfo gauges (node_exporter names), driver memory, /dev/shm, PSI."""
        sample = st.sample.model_dump() if st.sample else {}
        for col, name in MEMINFO_GAUGES.items():
            if sample.get(col) is not None:
                g = GaugeMetricFamily(f"sparkd_memory_{name}_bytes", f"/proc/meminfo {name} in bytes")
                g.add_metric([], float(sample[col]))
                yield g
        if sample.get("driver_bytes") is not None:
            g = GaugeMetricFamily(
                "sparkd_driver_memory_bytes",
                "Memory taken through the GPU driver (estimate: MemTotal − MemFree − Buffers − Cached − "
                "AnonPages − Slab − PageTables − KernelStack)",
            )
            g.add_metric([], float(sample["driver_bytes"]))
            yield g
        if sample.get("mem_available_minus_cma") is not None:
            g = GaugeMetricFamily(
                "sparkd_memory_usable_bytes",
                "Usable memory the default rules judge: MemAvailable - CmaFree (MemAvailable without CMA)",
            )
            g.add_metric([], float(sample["mem_available_minus_cma"]))
            yield g
        if sample.get("shm_bytes") is not None:
            g = GaugeMetricFamily("sparkd_dev_shm_bytes", "Bytes in /dev/shm")
            g.add_metric([], float(sample["shm_bytes"]))
            yield g
        for p in PSI_GAUGES:
            v = sample.get(f"psi_{p}")
            if v is not None:
                g = GaugeMetricFamily(f"sparkd_pressure_memory_{p}", f"/proc/pressure/memory {p} (percent)")
                g.add_metric([], float(v))
                yield g
        if st.consumers is not None:  # per-group totals only: process names stay out of the label space
            g = GaugeMetricFamily(
                "sparkd_memory_group_rss_bytes",
                "RSS of the processes of one group at the last process scan (container, host co-tenants, system)",
                labels=["group"],
            )
            for group, total in sorted(st.consumers.totals_bytes.items()):
                g.add_metric([group], float(total))
            yield g
            g = GaugeMetricFamily(
                "sparkd_cotenant_limit_bytes", "Host co-tenant RSS above which sparkd warns (consumers.cotenant_limit)"
            )
            g.add_metric([], float(st.consumers.cotenant_limit_bytes))
            yield g

    @staticmethod
    def _rules(st: Status) -> Iterator[Metric]:
        """Per-rule counters, samples required, trips and near misses; NVRM lines."""
        rules = st.rules
        counter = GaugeMetricFamily(
            "sparkd_rule_counter", "Consecutive samples the rule's condition held", labels=["rule"]
        )
        need = GaugeMetricFamily("sparkd_rule_samples_required", "Samples a rule needs to trip", labels=["rule"])
        trips = CounterMetricFamily("sparkd_rule_trips", "Rule trips since sparkd started", labels=["rule"])
        idle = CounterMetricFamily(
            "sparkd_rule_idle_trips",
            "Of sparkd_rule_trips, trips with the model down as sparkd saw it (nothing to stop)",
            labels=["rule"],
        )
        near = CounterMetricFamily(
            "sparkd_rule_near_misses", "Samples a rule's condition held but its evidence gate did not", labels=["rule"]
        )
        for r in rules:
            counter.add_metric([r.name], float(r.counter))
            need.add_metric([r.name], float(r.samples))
            trips.add_metric([r.name], float(r.trips))
            idle.add_metric([r.name], float(r.idle_trips))
            near.add_metric([r.name], float(r.near_misses))
        yield from (counter, need, trips, idle, near)
        blind = GaugeMetricFamily(
            "sparkd_rule_blind",
            "1 when the rule cannot evaluate because an input it needs was not read (reason says which)",
            labels=["rule", "reason"],
        )
        for r in rules:
            blind.add_metric([r.name, r.blind or ""], 1.0 if r.blind else 0.0)
        yield blind
        sensors = GaugeMetricFamily(
            "sparkd_input_blind",
            "1 for each input a rule needs that cannot be read (MemAvailable, MemFree, PSI, kernel log, /dev/shm)",
            labels=["input", "reason"],
        )
        for name, why in st.blind.sensors.items():
            sensors.add_metric([name, why], 1.0)
        yield sensors
        bursts = CounterMetricFamily(
            "sparkd_nvrm_bursts", "NV_ERR_NO_MEMORY bursts (nvrm_burst lines within nvrm_window_s), one per window"
        )
        bursts.add_metric([], float(st.kernel_log.nvrm_bursts))
        yield bursts

        nvrm = CounterMetricFamily("sparkd_nvrm_errors", "NV_ERR_NO_MEMORY kernel-log lines seen since sparkd started")
        nvrm.add_metric([], float(st.kernel_log.nvrm_lines))
        yield nvrm
        lines = CounterMetricFamily("sparkd_kernel_log_lines", "Kernel-log lines read since sparkd started")
        lines.add_metric([], float(st.kernel_log.lines_read))
        yield lines
        lost = CounterMetricFamily(
            "sparkd_kernel_log_lost", "Kernel-log records overwritten in the ring buffer before sparkd read them"
        )
        lost.add_metric([], float(st.kernel_log.lost))
        yield lost

    @staticmethod
    def _daemon(snap: Snapshot) -> Iterator[Metric]:
        """Container state and stops, archives, tick quantiles, samples, writer drops, interval."""
        st = snap.status
        c = st.container
        cs = GaugeMetricFamily("sparkd_container_state", "1 for the container's current state", labels=["state"])
        for s in CONTAINER_STATES:
            cs.add_metric([s], 1.0 if s == c.state.value else 0.0)
        yield cs
        mode = GaugeMetricFamily("sparkd_container_mode", "1 for how sparkd holds the container", labels=["mode"])
        for m in CONTAINER_MODES:
            mode.add_metric([m], 1.0 if m == c.mode else 0.0)
        yield mode
        if c.mode != "monitor-only" and c.engine in ("up", "down"):  # unknown before the first look: absent
            up = GaugeMetricFamily(
                "sparkd_docker_engine_up", "1 while the Docker engine answers; 0: no stop can reach the container"
            )
            up.add_metric([], 1.0 if c.engine == "up" else 0.0)
            yield up
        if c.mode != "monitor-only":
            watched = GaugeMetricFamily(
                "sparkd_container_watched",
                "1 while sparkd's looks at the container succeed; 0: they fail in a row (watch_failing: the engine "
                "refuses docker inspect), its state may be stale",
            )
            watched.add_metric([], 0.0 if c.watch_error else 1.0)
            yield watched
        stops = CounterMetricFamily("sparkd_container_stops", "Container stops sparkd executed", labels=["how"])
        stops.add_metric(["stop"], float(c.stops_total))
        stops.add_metric(["kill"], float(c.kills_total))
        yield stops

        n, size = snap.archives
        g = GaugeMetricFamily("sparkd_archives", "Postmortem bundles in the archive directory")
        g.add_metric([], float(n))
        yield g
        g = GaugeMetricFamily("sparkd_archives_bytes", "Total size of the postmortem bundles")
        g.add_metric([], float(size))
        yield g

        ticks = snap.ticks
        tick = GaugeMetricFamily(
            "sparkd_tick_seconds", "Guard tick duration over the last ≤600 ticks (quantile)", labels=["quantile"]
        )
        if ticks:
            for q in (0.5, 0.9, 0.99, 1.0):
                tick.add_metric([f"{q:g}"], ticks[min(len(ticks) - 1, int(q * len(ticks)))])
        yield tick
        samples = CounterMetricFamily("sparkd_samples", "Samples the guard took since sparkd started")
        samples.add_metric([], float(st.samples_taken))
        yield samples
        dropped = CounterMetricFamily("sparkd_db_dropped", "Records dropped because the database writer was behind")
        dropped.add_metric([], float(st.writer.dropped))
        yield dropped
        refused = CounterMetricFamily("sparkd_db_refused", "Records the database refused for good (dropped)")
        refused.add_metric([], float(st.writer.refused))
        yield refused
        db = GaugeMetricFamily("sparkd_db_up", "1 while the database records, 0 while sparkd guards from memory")
        recording = st.database is not None and st.database.state == "ok" and not st.database.write_hung_s
        db.add_metric([], 1.0 if recording else 0.0)  # a hung write records nothing either
        yield db
        hr = CounterMetricFamily(
            "sparkd_http_connections_refused", "API connections closed at once: over the connection cap"
        )
        hr.add_metric([], float(st.http.refused if st.http else 0))
        yield hr
        ht = CounterMetricFamily(
            "sparkd_http_head_timeouts", "API connections closed for not sending a request head in time"
        )
        ht.add_metric([], float(st.http.head_timeouts if st.http else 0))
        yield ht
        interval = GaugeMetricFamily("sparkd_sample_interval_seconds", "Current sampling interval")
        interval.add_metric([], float(st.interval_s))
        yield interval


def build_registry(daemon: DaemonView) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SparkdCollector(daemon))
    return reg


def _archive_totals(archive_dir: Any) -> tuple[int, int]:
    from sparkd.act.archive import list_archives

    items = list_archives(archive_dir)
    return len(items), sum(a.size_bytes for a in items)


async def metrics_response(app: FastAPI, daemon: DaemonView) -> Response:
    reg = getattr(app.state, "metrics_registry", None)
    if reg is None:
        reg = app.state.metrics_registry = build_registry(daemon)
    snap = take_snapshot(daemon)
    snap.archives = await asyncio.to_thread(_archive_totals, daemon.settings.archives_path)
    token = _SNAPSHOT.set(snap)
    try:
        body = generate_latest(reg)
    finally:
        _SNAPSHOT.reset(token)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
