/* sparkd incident chart: MemAvailable and MemFree (minimum per second) around the trip, usable
 * memory (MemAvailable − CmaFree) where it differs (a host with CMA), the tripped rule's stop lines
 * as they were at the trip (dashed), the event marks (trip drawn last, on top) and drag-to-zoom
 * (double-click resets). */
(function () {
  "use strict";
  // the timeline box opens on the trip: the events before it (the last run's start and end, logins) hid it
  const box = document.getElementById("incident-timeline");
  const trip = document.getElementById("timeline-trip");
  if (box && trip) box.scrollTop = Math.max(0, trip.offsetTop - box.offsetTop - 60);
})();
(function () {
  "use strict";
  const GiB = 1073741824;
  const el = document.getElementById("incident-chart");
  if (!el || !window.uPlot) return;
  const cfg = JSON.parse(el.dataset.config || "{}");
  const s = cfg.samples || { ts: [] };
  const marks = (cfg.marks || []).slice().sort((a, b) => (a.kind === "trip") - (b.kind === "trip"));
  const COLORS = { trip: "#f0616d", stopped: "#e05cc4", killed: "#ff4d4d", launched: "#6aa8ff", ready: "#3fb68b" };
  const gib = (a) => (a || []).map((v) => (v == null ? null : v / GiB));
  const fmt = (u, v) => (v == null ? "–" : v.toFixed(2) + " GiB");
  const series = [
    { label: "time (UTC)", value: "{YYYY}-{MM}-{DD} {HH}:{mm}:{ss}" },
    { label: "MemAvailable (min)", stroke: "#3fb68b", width: 2, value: fmt },
    { label: "MemFree (min)", stroke: "#6aa8ff", width: 1.5, value: fmt },
  ];
  const data = [s.ts, gib(s.mem_available_min), gib(s.mem_free_min)];
  const usable = s.mem_available_minus_cma_min || [];
  if (usable.some((v, i) => v != null && v !== (s.mem_available_min || [])[i])) {
    series.push({ label: "usable (min)", stroke: "#2ec4d6", width: 2, value: fmt });
    data.push(gib(usable));
  }
  const lines = cfg.lines || [];
  let drawnLines = [];
  function draw(u) {
    const ctx = u.ctx;
    const { top, height } = u.bbox;
    ctx.save();
    drawnLines = [];
    for (const l of lines) {
      const y = u.valToPos(l.value / GiB, "y", true);
      if (y < top || y > top + height) continue;
      const text = `${l.label} < ${(l.value / GiB).toFixed(1)} GiB`;
      drawnLines.push(text);
      window.sparkdStopLine(ctx, u.bbox, y, text);
    }
    for (const m of marks) {
      const x = u.valToPos(m.ts, "x", true);
      window.sparkdMark(ctx, u.bbox, x, m, COLORS[m.kind] || "#ff9f43");
    }
    ctx.restore();
  }
  const plot = new uPlot(
    {
      width: el.clientWidth || 600,
      height: 280,
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"), // UTC, as the page's text and the dashboard
      cursor: { drag: { x: true, y: false } },
      series,
      scales: {
        y: {
          // the stop lines stay in view: a trip happens near them
          range: (u, min, max) => [0, Math.ceil(Math.max(max || 0, ...lines.map((l) => l.value / GiB)) * 1.08 + 0.5)],
        },
      },
      axes: [{ stroke: "#9aa4b1" }, { stroke: "#9aa4b1", size: 64, values: (u, sp) => sp.map((v) => v + " GiB") }],
      hooks: { draw: [draw] },
    },
    data,
    el,
  );
  new ResizeObserver(() => plot.setSize({ width: el.clientWidth, height: 280 })).observe(el);
  window.sparkdIncident = {
    points: () => data[0].length,
    marks: () => marks.map((m) => m.kind),
    lines: () => drawnLines,
    plot: () => plot,
  };
})();
