/* A stop line on a uPlot chart (the dashboard's and the incident page's): a dashed horizontal line
 * across the plot at the threshold, and its label above it (none when `text` is null: a line that
 * shares its label with one already drawn). An event mark: a vertical line; a trip that asked for a
 * stop (severity critical) thick, a trip that stopped nothing (a warn rule, a demotion, the model
 * already down: severity warning) thin and dashed, every other kind thin. Call from a draw hook,
 * canvas already clipped. */
(function () {
  "use strict";
  window.sparkdMarkStyle = function (m) {
    // {width in css px, dash pattern in css px}
    if (m.kind !== "trip") return { width: 1, dash: [] };
    return m.severity === "warning" ? { width: 1.5, dash: [3, 3] } : { width: 3, dash: [] };
  };
  window.sparkdMark = function (ctx, bbox, x, m, color) {
    const dpr = window.devicePixelRatio || 1;
    const style = window.sparkdMarkStyle(m);
    ctx.strokeStyle = color;
    ctx.lineWidth = style.width * dpr;
    ctx.setLineDash(style.dash.map((d) => d * dpr));
    ctx.beginPath();
    ctx.moveTo(x, bbox.top);
    ctx.lineTo(x, bbox.top + bbox.height);
    ctx.stroke();
    ctx.setLineDash([]);
  };
  window.sparkdStopLine = function (ctx, bbox, y, text, color, labelX, dash) {
    // color: a warn rule's line (amber), a gated one's; default the stop lines' red. labelX: where its label starts
    // (canvas px; default the plot's left edge + 6 px). dash: the pattern in css px (default [6, 4]; a gated
    // line's is dotted). Returns where the label ends (labelX when there is none)
    const dpr = window.devicePixelRatio || 1;
    ctx.strokeStyle = color || "rgba(240,97,109,0.85)";
    ctx.lineWidth = dpr;
    ctx.setLineDash((dash || [6, 4]).map((d) => d * dpr));
    ctx.beginPath();
    ctx.moveTo(bbox.left, y);
    ctx.lineTo(bbox.left + bbox.width, y);
    ctx.stroke();
    ctx.setLineDash([]);
    const x = labelX == null ? bbox.left + 6 * dpr : labelX;
    if (text == null) return x;
    ctx.font = `${11 * dpr}px system-ui, sans-serif`;
    ctx.textAlign = "left";
    ctx.textBaseline = "bottom";
    ctx.fillStyle = color || "rgba(240,97,109,0.95)";
    ctx.fillText(text, x, y - 4 * dpr);
    return x + ctx.measureText(text).width;
  };
})();
