// /docs: Swagger UI from the vendored bundle (no CDN: a Spark may be offline), started from this
// file because the page's Content-Security-Policy allows no inline script.
window.addEventListener("DOMContentLoaded", function () {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
