// harel-store console: keeps the open page live. The server pushes a "change" event over
// server-sent events when the database changes (the store's wake-up); the page then fetches
// itself again and swaps its content in place. Without JavaScript every page still works.
(function () {
  "use strict";
  var body = document.body;
  if (!window.EventSource || !window.fetch || body.dataset.live !== "on") return;
  var mark = document.getElementById("live");
  var busy = false, again = false, seen = 0;

  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(location.href, { credentials: "same-origin", headers: { "X-Harel-Live": "1" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("content");
        var now = document.getElementById("content");
        var active = document.activeElement;
        // A form being filled in is left alone until it is done with.
        if (fresh && now && !(active && now.contains(active) && /INPUT|SELECT|TEXTAREA/.test(active.tagName))) {
          now.replaceWith(fresh);
          seen += 1;
          body.dataset.refreshed = String(seen);
        }
      })
      .catch(function () {})
      .then(function () {
        busy = false;
        if (again) { again = false; refresh(); }
      });
  }

  // The version the page was rendered at: a change since then (before the stream opened) is
  // told at once; on a reconnection the browser says the last one it was told.
  var since = encodeURIComponent(body.dataset.version || "");
  var source = new EventSource(body.dataset.root + "/live?since=" + since);
  source.addEventListener("open", function () { if (mark) mark.classList.add("on"); });
  source.addEventListener("error", function () { if (mark) mark.classList.remove("on"); });
  source.addEventListener("change", refresh);
})();
