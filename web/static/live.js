/* sparkd live updates: one small request (/ui/live.json) every 2 s carrying only what changed
 * (parts whose data hash differs, events newer than the last one shown, chart buckets since the
 * last one). When the daemon does not answer: a banner (role=alert) with the time of its last
 * answer, controls disabled with the reason, polling backs off (2 → 4 → 8 s) and resumes by
 * itself. The sample's age ticks every second. No inline script (CSP: 'self' only). */
(function () {
  "use strict";
  const root = document.getElementById("live");
  if (!root) return;
  const POLL_MS = 2000;
  const HIDDEN_MS = 10000;
  const TIMEOUT_MS = 2500;
  const MAX_BACKOFF_MS = 8000;
  const REFRESH_ON = new Set(["launched", "ready", "stopped", "killed", "adopted", "launch_failed"]);

  const have = {};
  for (const p of (root.dataset.have || "").split(",")) {
    const i = p.indexOf(":");
    if (i > 0) have[p.slice(0, i)] = p.slice(i + 1);
  }
  let lastEv = Number(root.dataset.ev || 0);
  const wasLoggedIn = root.dataset.loggedIn === "1";
  let lastOk = Date.now();
  let failing = false;
  let backoff = POLL_MS;
  let timer = null;
  let sample = { ts: null, serverTs: null, at: Date.now() };
  const banner = document.getElementById("conn-banner");

  const pad = (n) => String(n).padStart(2, "0");
  // UTC, as every other time sparkd shows (the chart's axis, /events, the incident page)
  const hms = (d) => `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())} UTC`;

  function readSampleAge() {
    const el = document.getElementById("sample-age");
    if (el && el.dataset.sampleTs) {
      sample = { ts: Number(el.dataset.sampleTs), serverTs: Number(el.dataset.serverTs), at: Date.now() };
    }
  }

  function tickAge() {
    const el = document.getElementById("sample-age");
    if (!el || !sample.ts) return;
    const age = sample.serverTs - sample.ts + (Date.now() - sample.at) / 1000;
    const taken = hms(new Date(sample.ts * 1000));
    el.textContent = `${age < 10 ? age.toFixed(1) : Math.round(age)} s old (taken ${taken})`;
    el.classList.toggle("warn-text", age > 5);
  }

  function setControls(disabledWhy) {
    document.querySelectorAll("[data-control]").forEach((b) => {
      if (disabledWhy) {
        if (!b.dataset.liveDisabled) {
          b.dataset.liveDisabled = b.disabled ? "was" : "now";
          b.dataset.liveTitle = b.title || "";
        }
        b.disabled = true;
        b.title = disabledWhy;
      } else if (b.dataset.liveDisabled) {
        b.disabled = b.dataset.liveDisabled === "was";
        b.title = b.dataset.liveTitle || "";
        delete b.dataset.liveDisabled;
      }
    });
  }

  function showBanner(text) {
    if (!banner) return;
    banner.textContent = text;
    banner.hidden = false;
  }
  function hideBanner() {
    if (banner) banner.hidden = true;
  }

  function swapPart(name, html) {
    const old = document.getElementById(`part-${name}`);
    if (!old) return;
    const tpl = document.createElement("template");
    tpl.innerHTML = html.trim();
    const el = tpl.content.firstElementChild;
    if (!el) return;
    old.replaceWith(el);
    if (window.htmx) window.htmx.process(el);
    if (name === "buttons") syncResize(el);
  }

  function syncResize(part) {
    // the resize form is not re-rendered (it may hold what the operator typed): follow the state here
    const b = document.querySelector("#resize-form button[type=submit]");
    if (!b || b.dataset.liveDisabled) return;
    b.disabled = !part.dataset.resize;
    b.title = part.dataset.resize ? "" : part.dataset.resizeWhy || "";
  }

  function addEvents(html, replaces) {
    const list = document.getElementById("event-list");
    if (!list) return;
    const none = document.getElementById("no-events");
    if (none) none.remove();
    const before = list.scrollHeight;
    const keep = list.scrollTop;
    // the new rows' last one goes on the run the top row shows ("12 × in 2 min"): it takes its place
    const top = list.firstElementChild;
    if (replaces != null && top && top.dataset.id === String(replaces)) top.remove();
    list.insertAdjacentHTML("afterbegin", html);
    // a reader scrolled down keeps the rows in view: only what was added above moves
    if (keep > 0) list.scrollTop = keep + (list.scrollHeight - before);
    while (list.children.length > 300) list.lastElementChild.remove();
  }

  function refreshPart(name) {
    if (window.htmx && document.getElementById(`part-${name}`)) {
      window.htmx.ajax("GET", `/ui/${name}`, { target: `#part-${name}`, swap: "outerHTML" });
    }
  }

  function apply(r) {
    for (const [name, html] of Object.entries(r.parts || {})) swapPart(name, html);
    Object.assign(have, r.hashes || {});
    if (r.parts && r.parts.headline) readSampleAge();
    sample = { ts: r.sample_ts, serverTs: r.server_ts, at: Date.now() };
    const pill = document.getElementById("overall");
    if (pill) {
      pill.className = `pill ${r.level}`;
      pill.textContent = r.label;
    }
    if (r.title) document.title = r.title;
    if (r.event_rows) addEvents(r.event_rows, r.event_rows_replace);
    if (r.last_event_id) lastEv = Math.max(lastEv, r.last_event_id);
    if (window.sparkdChart && (r.samples || r.markers)) window.sparkdChart.append(r.samples, r.markers || []);
    if ((r.markers || []).some((m) => REFRESH_ON.has(m.kind))) {
      refreshPart("launches");
      refreshPart("archives");
    }
    if (wasLoggedIn && !r.logged_in) {
      // monitor-only: no container to act on, so no control a login would give back; the buttons keep saying why
      const buttons = document.getElementById("part-buttons");
      if (buttons && buttons.dataset.monitorOnly) {
        showBanner("Your session expired: log in again.");
      } else {
        showBanner("Your session expired: log in again to use the controls.");
        setControls("session expired: log in again");
      }
    }
    tickAge();
  }

  function url() {
    const q = new URLSearchParams();
    q.set("have", Object.entries(have).map(([k, v]) => `${k}:${v}`).join(","));
    q.set("ev", String(lastEv));
    const c = window.sparkdChart && window.sparkdChart.cursor && window.sparkdChart.cursor();
    if (c) {
      q.set("since", String(c.since));
      q.set("step", String(c.step));
    }
    return `/ui/live.json?${q}`;
  }

  async function poll() {
    const ctl = new AbortController();
    const t = setTimeout(() => ctl.abort(), TIMEOUT_MS);
    try {
      const r = await fetch(url(), {
        credentials: "same-origin",
        headers: { Accept: "application/json" },
        signal: ctl.signal,
      });
      if (!r.ok) throw new Error(String(r.status));
      const body = await r.json();
      if (failing) {
        failing = false;
        hideBanner();
        setControls(null);
        have.buttons = "stale"; // fresh controls from the daemon's state now
        have.stopped = "stale";
      }
      lastOk = Date.now();
      backoff = POLL_MS;
      apply(body);
    } catch (e) {
      failing = true;
      backoff = Math.min(MAX_BACKOFF_MS, backoff * 2);
      showBanner(
        `sparkd is not responding since ${hms(new Date(lastOk))} (its last answer); ` +
          `the figures below are from then. Retrying every ${Math.round(backoff / 1000)} s.`,
      );
      setControls("sparkd is not responding");
    } finally {
      clearTimeout(t);
    }
  }

  function schedule(ms) {
    clearTimeout(timer);
    timer = setTimeout(async () => {
      await poll();
      schedule(failing ? backoff : document.hidden ? HIDDEN_MS : POLL_MS);
    }, ms);
  }

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) schedule(0);
  });
  readSampleAge();
  tickAge();
  setInterval(tickAge, 1000);
  schedule(POLL_MS);
  window.sparkdLive = { have: () => ({ ...have }), lastEvent: () => lastEv, failing: () => failing };
})();
