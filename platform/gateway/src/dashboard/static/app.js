// Hearth dashboard: the little that needs a script. Loaded from /dashboard/static (the
// Content-Security-Policy allows no inline script). Every state change carries the
// session's CSRF token from <meta name="csrf-token">.
"use strict";

function csrfToken() {
  const m = document.querySelector('meta[name="csrf-token"]');
  return m ? m.getAttribute("content") : "";
}

// Forms marked .confirm ask first.
document.addEventListener("submit", (ev) => {
  const f = ev.target;
  if (f.classList && f.classList.contains("confirm") && !window.confirm(f.dataset.confirm || "Are you sure?")) {
    ev.preventDefault();
  }
});

// Processor upload: the component goes as the request body (no multipart).
document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("upload-form");
  if (!form) return;
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const status = document.getElementById("upload-status");
    const file = document.getElementById("processor-file").files[0];
    const name = document.getElementById("processor-name").value;
    const activate = document.getElementById("processor-activate").checked;
    if (!file) { status.textContent = "Choose a .wasm file."; return; }
    status.textContent = "Uploading and compiling…";
    const url = form.dataset.endpoint + "?name=" + encodeURIComponent(name) + "&activate=" + activate;
    try {
      const resp = await fetch(url, {
        method: "POST",
        headers: { "x-csrf-token": csrfToken(), "content-type": "application/wasm" },
        body: file,
        credentials: "same-origin",
      });
      const body = await resp.json();
      if (resp.ok) {
        window.location.assign(form.dataset.endpoint);
      } else {
        status.textContent = (body.error && body.error.message) || ("Upload failed: " + resp.status);
      }
    } catch (e) {
      status.textContent = "Upload failed: " + e;
    }
  });
});
