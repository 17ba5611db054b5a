// WCAG 2.x contrast of every visible text run on the page against the background it is drawn on
// (the first opaque background up the tree, blended over the page's). Returns the failures:
// [{text, selector, ratio, fg, bg}] below the given minimum. Placeholders are measured too
// (::placeholder colour of each input). Used by tests/test_browser_contrast.py.
(minimum) => {
  const parse = (c) => {
    const m = c.match(/rgba?\(([^)]+)\)/);
    if (!m) return null;
    const p = m[1].split(/[ ,/]+/).filter(Boolean).map(Number);
    return { r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1 };
  };
  const over = (top, bottom) => ({
    r: top.r * top.a + bottom.r * (1 - top.a),
    g: top.g * top.a + bottom.g * (1 - top.a),
    b: top.b * top.a + bottom.b * (1 - top.a),
    a: 1,
  });
  const lum = (c) => {
    const ch = [c.r, c.g, c.b].map((v) => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * ch[0] + 0.7152 * ch[1] + 0.0722 * ch[2];
  };
  const ratio = (a, b) => {
    const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p);
    return (x + 0.05) / (y + 0.05);
  };
  const pageBg = () => {
    let c = parse(getComputedStyle(document.body).backgroundColor);
    if (!c || c.a === 0) c = parse(getComputedStyle(document.documentElement).backgroundColor);
    return !c || c.a === 0 ? { r: 255, g: 255, b: 255, a: 1 } : c;
  };
  const bgOf = (el) => {
    const layers = [];
    for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c.a > 0) {
        layers.push(c);
        if (c.a === 1) break;
      }
    }
    let bg = pageBg();
    for (const l of layers.reverse()) bg = over(l, bg);
    return bg;
  };
  const name = (el) => el.id ? `#${el.id}` : `${el.tagName.toLowerCase()}${el.className && typeof el.className === "string" ? "." + el.className.trim().split(/\s+/).join(".") : ""}`;
  const failures = [];
  const seen = new Set();
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const text = n.textContent.trim();
    const el = n.parentElement;
    if (!text || !el || seen.has(el)) continue;
    seen.add(el);
    const st = getComputedStyle(el);
    const r = el.getBoundingClientRect();
    if (st.visibility === "hidden" || st.display === "none" || r.width === 0 || r.height === 0) continue;
    if (el.closest("[hidden], noscript, script, style, canvas, svg")) continue;
    const fg0 = parse(st.color);
    if (!fg0) continue;
    const bg = bgOf(el);
    const fg = over({ ...fg0, a: fg0.a * Number(st.opacity || 1) }, bg);
    const k = ratio(fg, bg);
    if (k < minimum) failures.push({ text: text.slice(0, 40), selector: name(el), ratio: Math.round(k * 100) / 100, fg: st.color, bg: `rgb(${Math.round(bg.r)}, ${Math.round(bg.g)}, ${Math.round(bg.b)})` });
  }
  for (const input of document.querySelectorAll("input[placeholder], textarea[placeholder]")) {
    const r = input.getBoundingClientRect();
    if (r.width === 0 || input.closest("[hidden]")) continue;
    const fg0 = parse(getComputedStyle(input, "::placeholder").color);
    const bg = bgOf(input);
    const k = ratio(over(fg0, bg), bg);
    if (k < minimum) failures.push({ text: `placeholder ${input.placeholder}`, selector: name(input), ratio: Math.round(k * 100) / 100, fg: getComputedStyle(input, "::placeholder").color, bg: "" });
  }
  return failures;
}
