/* A stop line on a uPlot chart (the dashboard's and the incident page's): a dashed horizontal line
 * across the plot at the threshold, and its label above it (none when `text` is null: a line that
 * shares its label with one already drawn). Call from a draw hook, canvas already clipped. */
(function () {
  "use strict";
  window.sparkdStopLine = function (ctx, bbox, y, text) {
    const dpr = window.devicePixelRatio || 1;
    ctx.strokeStyle = "rgba(240,97,109,0.85)";
    ctx.lineWidth = dpr;
    ctx.setLineDash([6 * dpr, 4 * dpr]);
    ctx.beginPath();
    ctx.moveTo(bbox.left, y);
    ctx.lineTo(bbox.left + bbox.width, y);
    ctx.stroke();
    ctx.setLineDash([]);
    if (text == null) return;
    ctx.font = `${11 * dpr}px system-ui, sans-serif`;
    ctx.textAlign = "left";
    ctx.textBaseline = "bottom";
    ctx.fillStyle = "rgba(240,97,109,0.95)";
    ctx.fillText(text, bbox.left + 6 * dpr, y - 4 * dpr);
  };
})();
