/* sparkd live memory chart (uPlot). Fetches /api/samples and the marks once per range; after
 * that live.js hands it only the new buckets and events (append). Stop thresholds are dashed
 * horizontal lines, labelled once per value; events are vertical marks (trip drawn last, on
 * top); a gap of more than max(3 buckets, 10 s) breaks the lines. Pointing at a mark shows what it
 * was (tooltip); clicking a trip or stop mark opens its incident (a trip: the stop that followed it).
 * Dragging across the chart zooms into that stretch (live updates go on underneath); double-click or
 * "Back to live" returns. No inline script: the page's CSP allows only 'self' scripts. */
(function () {
  "use strict";
  const GiB = 1073741824;
  const el = document.getElementById("chart");
  if (!el || !window.uPlot) return;
  const cfg = JSON.parse(el.dataset.config || "{}");
  const SERIES = [
    ["mem_available", "avg", "MemAvailable", "#3fb68b", 2],
    ["mem_available", "min", "MemAvailable (min)", "rgba(63,182,139,0.45)", 1],
    // usable = MemAvailable − CmaFree, the default rules' field: a line of its own only where the host
    // has CMA (cfg.cma); elsewhere it is MemAvailable, and its stop lines sit against that line
    ...(cfg.cma ? [["mem_available_minus_cma", "avg", "usable (MemAvailable − CmaFree)", "#2ec4d6", 2]] : []),
    ["mem_free", "avg", "MemFree", "#6aa8ff", 1.5],
    ["cached", "avg", "Cached (page cache)", "#e0b341", 1.5],
    ["anon_pages", "avg", "AnonPages", "#b48cf0", 1.5],
    ["slab", "avg", "Slab", "#e08a5b", 1.5],
  ];
  const FIELDS = [...new Set(SERIES.map((s) => s[0]))].join(",");
  const MARK_COLORS = {
    trip: "#f0616d",
    stopping: "#f0616d",
    stopped: "#e05cc4",
    killed: "#ff4d4d",
    hard_floor_kill: "#ff4d4d",
    launched: "#6aa8ff",
    ready: "#3fb68b",
    oom_kill: "#ff4d4d",
    resize: "#b48cf0",
    nvrm_no_memory: "#ff9f43",
  };
  const MARK_ORDER = ["nvrm_no_memory", "nvrm_other", "launched", "ready", "resize", "stopping", "stopped", "killed", "hard_floor_kill", "oom_kill", "trip"];
  const GAP_MIN_S = 10;
  const WARN_LINE = "rgba(184,128,16,0.95)"; // a line only warn rules hold: amber (dark enough on the light theme)
  // a line whose stop rules all need more than it (other conditions, evidence): magenta (the theme's), dotted
  const GATED_LINE = css("--gated", "#d873b8");
  const GATED_DASH = [2, 4];
  const thresholds = cfg.thresholds || [];
  const markerKinds = (cfg.markers || ["trip", "nvrm_no_memory"]).join(",");

  let range = 300;
  let step = null;
  let data = null; // [ts[], series...]
  let markers = [];
  let plot = null;
  let timer = null;
  let generation = 0;
  let zoom = null; // [min, max] epoch s while zoomed in; null: the live range
  let drawnLines = []; // the stop lines' labels drawn last time (within the plot)
  let lastPlaced = []; // where they were drawn (``sparkdChart.labels``)
  const tip = document.getElementById("chart-tip");
  const zoomReset = document.getElementById("zoom-reset");
  const INCIDENT_KINDS = ["stopped", "killed"];
  const TRIP_TO_STOP_S = 120; // a trip's incident is the stop that followed within this

  const fmtGiB = (u, v) => (v == null ? "–" : v.toFixed(2) + " GiB");
  const pad = (n) => String(n).padStart(2, "0");
  function fmtTick(ts) {
    const d = new Date(ts * 1000);
    const hm = `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}`;
    if (range <= 3600) return `${hm}:${pad(d.getUTCSeconds())}`;
    if (range <= 86400) return hm;
    return `${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ${hm}`;
  }
  function showLatest(u) {
    // with the cursor off the chart, the legend shows the newest values instead of dashes
    if (u.cursor.idx == null && u.data[0].length) u.setLegend({ idx: u.data[0].length - 1 });
  }

  function height() {
    return window.innerWidth < 760 ? 240 : 300;
  }

  function draw(u) {
    const ctx = u.ctx;
    const { left, top, width, height: h } = u.bbox;
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, width, h);
    ctx.clip();
    const labelled = new Set();
    const placed = []; // labels drawn: {y, x1}; one within a line's height of another starts after it
    const dpr = window.devicePixelRatio || 1;
    drawnLines = [];
    // the lines a rule acts on alone are labelled first: where labels of close lines chain side by side (a 128 GiB
    // axis), a gated line's longer label goes last, and the one that runs past the plot's edge is not a stop line's
    for (const t of [...thresholds].sort((a, b) => Boolean(a.needs) - Boolean(b.needs))) {
      const y = u.valToPos(t.value / GiB, "y", true);
      if (y < top || y > top + h) continue;
      const key = `${t.label}${t.value}`;
      let text = null;
      if (!labelled.has(key)) {
        // one label per line: rules sharing a threshold do not pile up
        labelled.add(key);
        // a warn rule's line says so: "Dashed lines: stop thresholds" read every line as a stop (note 21)
        const group = thresholds.filter((x) => x.label === t.label && x.value === t.value);
        const same = group.map((x) => (x.action === "warn" ? `${x.rule} (warn)` : x.rule));
        text = `${same.join(", ")}: ${t.label} < ${(t.value / GiB).toFixed(1)} GiB`;
        // a rule that needs more than the line says what: "stops at 10 GiB" was read for a rule that stops only
        // with MemFree low and evidence as well
        for (const x of group) {
          if (!x.needs) continue;
          const verb = x.action === "warn" ? "warns" : "stops";
          text += group.length === 1 ? `, ${verb} only with ${x.needs}` : `; ${x.rule} ${verb} only with ${x.needs}`;
        }
        drawnLines.push(text);
      }
      const warnOnly = thresholds.every((x) => x.label !== t.label || x.value !== t.value || x.action === "warn");
      // no stop rule acts on this line alone: drawn dotted and paler, not as a stop line
      const gated = !warnOnly && thresholds.every((x) => x.label !== t.label || x.value !== t.value || x.action === "warn" || x.needs);
      // lines 1 GiB apart on a 128 GiB axis printed their labels on top of each other, unreadable (helper-56)
      let labelX = left + 6 * dpr;
      if (text != null) {
        for (const p of placed) if (Math.abs(p.y - y) < 13 * dpr) labelX = Math.max(labelX, p.x1 + 14 * dpr);
      }
      const color = warnOnly ? WARN_LINE : gated ? GATED_LINE : null;
      const x1 = window.sparkdStopLine(ctx, u.bbox, y, text, color, labelX, gated ? GATED_DASH : null);
      if (text != null) placed.push({ y, x1, x: labelX, text, style: warnOnly ? "warn" : gated ? "gated" : "stop" });
    }
    lastPlaced = placed;
    const sorted = [...markers].sort((a, b) => MARK_ORDER.indexOf(a.kind) - MARK_ORDER.indexOf(b.kind));
    for (const m of sorted) {
      const x = u.valToPos(m.ts, "x", true);
      if (x < left || x > left + width) continue;
      window.sparkdMark(ctx, u.bbox, x, m, MARK_COLORS[m.kind] || "#f0616d");
    }
    ctx.restore();
  }

  function css(name, fallback) {
    const v = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
    return v || fallback;
  }

  function makePlot() {
    const axis = css("--muted", "#9aa4b1");
    const grid = css("--line", "#1f2731");
    const opts = {
      width: el.clientWidth || 600,
      height: height(),
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"),
      cursor: { drag: { x: true, y: false, setScale: false } },
      legend: { live: true },
      scales: {
        x: { time: true, auto: false, range: () => zoom || [Date.now() / 1000 - range, Date.now() / 1000] },
        y: {
          range: (u, min, max) => {
            const top = Math.max(max || 0, ...thresholds.map((t) => t.value / GiB));
            return [0, Math.ceil(top * 1.08 + 0.5)];
          },
        },
      },
      axes: [
        {
          stroke: axis,
          space: 80,
          grid: { stroke: grid, width: 1 },
          ticks: { stroke: grid, width: 1 },
          values: (u, splits) => splits.map(fmtTick),
        },
        {
          stroke: axis,
          size: 64,
          grid: { stroke: grid, width: 1 },
          ticks: { stroke: grid, width: 1 },
          values: (u, splits) => splits.map((v) => v + " GiB"),
        },
      ],
      series: [
        { label: "time (UTC)", value: "{YYYY}-{MM}-{DD} {HH}:{mm}:{ss}" },
        ...SERIES.map(([, , label, color, w]) => ({ label, stroke: color, width: w, value: fmtGiB, spanGaps: false })),
      ],
      hooks: { draw: [draw], setData: [showLatest], setCursor: [showLatest, pointAt], setSelect: [zoomTo] },
    };
    plot = new uPlot(opts, data, el);
    showLatest(plot);
  }

  function columns(resp) {
    const cols = [resp.ts];
    for (const [f, agg] of SERIES) {
      cols.push((resp[`${f}_${agg}`] || []).map((v) => (v == null ? null : v / GiB)));
    }
    return cols;
  }

  async function fetchJSON(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!r.ok) throw new Error(`${url}: ${r.status}`);
    return r.json();
  }

  async function refresh(full) {
    const gen = generation;
    const now = Date.now() / 1000;
    let url;
    if (full || !data || !data[0].length) {
      url = `/api/samples?since=${(now - range).toFixed(3)}&fields=${FIELDS}`;
    } else {
      const last = data[0][data[0].length - 1];
      url = `/api/samples?since=${last}&step=${step}&fields=${FIELDS}`;
    }
    const [resp, ev] = await Promise.all([
      fetchJSON(url),
      fetchJSON(`/api/events?since=${(now - range).toFixed(3)}&kind=${markerKinds}&limit=500`),
    ]);
    if (gen !== generation) return; // the range changed meanwhile
    markers = ev.events || [];
    const cols = columns(resp);
    step = resp.step;
    data = withGaps(cols);
    const cutoff = now - range;
    const drop = data[0].findIndex((t) => t >= cutoff);
    if (drop > 0) data = data.map((arr) => arr.slice(drop));
    if (!plot) makePlot();
    else plot.setData(data);
    el.dataset.points = String(data[0].length);
  }

  function withGaps(cols) {
    // a missing stretch (daemon down, host frozen) is a break in the lines, not a straight line
    // ... and no break between samples taken as far apart as the daemon takes them (interval_s = 40: helper-44)
    const limit = Math.max(3 * (step || 1), GAP_MIN_S, 3 * (cfg.interval_s || 0));
    const out = cols.map(() => []);
    for (let i = 0; i < cols[0].length; i++) {
      if (i > 0 && cols[0][i] - cols[0][i - 1] > limit) {
        out[0].push(cols[0][i - 1] + limit / 2);
        for (let k = 1; k < cols.length; k++) out[k].push(null);
      }
      for (let k = 0; k < cols.length; k++) out[k].push(cols[k][i]);
    }
    return out;
  }

  function append(resp, newMarkers) {
    if (!data || !plot) return;
    if (newMarkers && newMarkers.length) {
      const seen = new Set(markers.map((m) => m.id));
      markers = markers.concat(newMarkers.filter((m) => !seen.has(m.id)));
    }
    if (resp && resp.ts && resp.ts.length && resp.step === step) {
      const cols = columns(resp);
      const first = cols[0][0];
      let keep = data[0].findIndex((t) => t >= first);
      if (keep < 0) keep = data[0].length;
      data = withGaps(data.map((arr, i) => arr.slice(0, keep).concat(cols[i])));
    }
    // the live range slides on; a zoomed stretch keeps its data until the reader goes back to live
    const cutoff = Math.min(Date.now() / 1000 - range, zoom ? zoom[0] : Infinity);
    const drop = data[0].findIndex((t) => t >= cutoff);
    if (drop > 0) data = data.map((arr) => arr.slice(drop));
    markers = markers.filter((m) => m.ts >= cutoff);
    plot.setData(data);
    el.dataset.points = String(data[0].length);
  }

  function cursorPos() {
    if (!data || !data[0].length || !step) return null;
    return { since: data[0][data[0].length - 1], step };
  }

  function markAt(x) {
    // the mark within 4 px of x (css px over the plot); a trip wins over what it sits on
    let best = null;
    for (const m of markers) {
      const d = Math.abs(plot.valToPos(m.ts, "x") - x);
      if (d > 4) continue;
      if (!best || (m.kind === "trip") > (best.m.kind === "trip") || d < best.d) best = { m, d };
    }
    return best && best.m;
  }

  function incidentOf(m) {
    // a stop mark is its incident; a trip's incident is the stop that followed it
    if (INCIDENT_KINDS.includes(m.kind)) return m.id;
    if (m.kind !== "trip") return null;
    const next = markers
      .filter((x) => INCIDENT_KINDS.includes(x.kind) && x.ts >= m.ts && x.ts - m.ts <= TRIP_TO_STOP_S)
      .sort((a, b) => a.ts - b.ts)[0];
    return next ? next.id : null;
  }

  function pointAt(u) {
    if (!tip) return;
    const x = u.cursor.left;
    const m = x != null && x >= 0 ? markAt(x) : null;
    u.over.classList.toggle("on-mark", !!(m && incidentOf(m)));
    if (!m) {
      tip.hidden = true;
      return;
    }
    const when = new Date(m.ts * 1000).toISOString().slice(11, 19);
    tip.replaceChildren();
    const head = document.createElement("strong");
    head.textContent = `${when} UTC · ${m.kind}`;
    const body = document.createElement("span");
    const msg = m.message || "";
    body.textContent = (msg.length > 240 ? `${msg.slice(0, 239)}…` : msg) + (incidentOf(m) ? " — click to open the incident" : "");
    tip.append(head, body);
    tip.hidden = false;
    const left = u.over.offsetLeft + x + 12;
    tip.style.left = `${Math.min(left, el.clientWidth - tip.offsetWidth - 4)}px`;
    tip.style.top = `${u.over.offsetTop + 8}px`;
  }

  function zoomTo(u) {
    // a drag across the chart: show that stretch; a plain click (no width) is not a zoom
    if (u.select.width < 6) return;
    const min = u.posToVal(u.select.left, "x");
    const max = u.posToVal(u.select.left + u.select.width, "x");
    u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
    setZoom([min, max]);
  }

  function setZoom(z) {
    zoom = z;
    if (zoomReset) zoomReset.hidden = !zoom;
    el.dataset.zoom = zoom ? `${zoom[0].toFixed(3)},${zoom[1].toFixed(3)}` : "";
    if (plot) plot.setScale("x", zoom ? { min: zoom[0], max: zoom[1] } : { min: Date.now() / 1000 - range, max: Date.now() / 1000 });
  }

  el.addEventListener("click", (ev) => {
    // a click on (or within 4 px of) a trip or stop mark opens its incident
    if (!plot) return;
    const m = markAt(ev.clientX - plot.over.getBoundingClientRect().left);
    const id = m && incidentOf(m);
    if (id) window.location.href = `/incidents/${id}`;
  });
  el.addEventListener("dblclick", () => setZoom(null));
  el.addEventListener("mouseleave", () => {
    if (tip) tip.hidden = true;
  });
  if (zoomReset) zoomReset.addEventListener("click", () => setZoom(null));

  document.querySelectorAll("button.range[data-range]").forEach((b) => {
    b.addEventListener("click", async () => {
      setZoom(null);
      document.querySelectorAll("button.range[data-range]").forEach((x) => x.classList.toggle("active", x === b));
      range = Number(b.dataset.range);
      generation += 1;
      data = null;
      try {
        await refresh(true);
      } catch (e) {
        /* shown as an empty chart */
      }
    });
  });

  new ResizeObserver(() => {
    if (plot) plot.setSize({ width: el.clientWidth, height: height() });
  }).observe(el);

  window.sparkdChart = {
    points: () => (data ? data[0].length : 0),
    plot: () => plot,
    markers: () => markers,
    lines: () => drawnLines,
    labels: () => lastPlaced, // [{y, x, x1, text}] in canvas px: where each label was drawn
    append,
    cursor: cursorPos,
    zoom: () => zoom,
  };
  refresh(true).catch(() => {});
})();
