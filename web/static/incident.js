/* sparkd incident chart: MemAvailable and MemFree (minimum per second) around the trip, with
 * the event marks (trip drawn last, on top) and drag-to-zoom (double-click resets). */
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
  const data = [s.ts, gib(s.mem_available_min), gib(s.mem_free_min)];
  function draw(u) {
    const ctx = u.ctx;
    const { top, height } = u.bbox;
    ctx.save();
    for (const m of marks) {
      const x = u.valToPos(m.ts, "x", true);
      ctx.strokeStyle = COLORS[m.kind] || "#ff9f43";
      ctx.lineWidth = (m.kind === "trip" ? 3 : 1) * (window.devicePixelRatio || 1);
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }
  const plot = new uPlot(
    {
      width: el.clientWidth || 600,
      height: 280,
      cursor: { drag: { x: true, y: false } },
      series: [
        { label: "time" },
        { label: "MemAvailable (min)", stroke: "#3fb68b", width: 2, value: (u, v) => (v == null ? "–" : v.toFixed(2) + " GiB") },
        { label: "MemFree (min)", stroke: "#6aa8ff", width: 1.5, value: (u, v) => (v == null ? "–" : v.toFixed(2) + " GiB") },
      ],
      axes: [{ stroke: "#9aa4b1" }, { stroke: "#9aa4b1", size: 64, values: (u, sp) => sp.map((v) => v + " GiB") }],
      hooks: { draw: [draw] },
    },
    data,
    el,
  );
  new ResizeObserver(() => plot.setSize({ width: el.clientWidth, height: 280 })).observe(el);
  window.sparkdIncident = { points: () => data[0].length, marks: () => marks.map((m) => m.kind), plot: () => plot };
})();
