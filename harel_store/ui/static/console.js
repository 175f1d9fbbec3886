// harel-store console: keeps the open page live. The server pushes a "change" event over
// server-sent events when the database changes (the store's wake-up); the page then fetches
// itself again and merges the new content into the page in place. Without JavaScript every
// page still works.
(function () {
  "use strict";
  var body = document.body;
  if (!window.EventSource || !window.fetch || body.dataset.live !== "on") return;
  var mark = document.getElementById("live");
  var busy = false, again = false, seen = 0;

  // The reader's own state, which a refresh leaves as it is: a <details> opened or closed,
  // and what a form field holds (a value typed or a box ticked is the field's "dirty" state,
  // which the markup's attributes no longer change).
  function own(element, name) {
    return name === "open" && element.nodeName === "DETAILS";
  }

  function same(old, fresh) {
    return old.nodeType === fresh.nodeType && old.nodeName === fresh.nodeName &&
      (old.nodeType !== 1 || (old.id === fresh.id && old.getAttribute("name") === fresh.getAttribute("name")));
  }

  // Makes `old` show what `fresh` shows, changing only what differs: a node whose text did
  // not change stays the same node, so a selection in it, the focus and a field's input stay.
  function merge(old, fresh) {
    var i, attribute;
    for (i = old.attributes.length - 1; i >= 0; i--) {
      attribute = old.attributes[i];
      if (!fresh.hasAttribute(attribute.name) && !own(old, attribute.name)) old.removeAttribute(attribute.name);
    }
    for (i = 0; i < fresh.attributes.length; i++) {
      attribute = fresh.attributes[i];
      if (old.getAttribute(attribute.name) !== attribute.value && !own(old, attribute.name)) {
        old.setAttribute(attribute.name, attribute.value);
      }
    }
    var olds = Array.prototype.slice.call(old.childNodes);
    var freshes = Array.prototype.slice.call(fresh.childNodes);
    for (i = 0; i < freshes.length; i++) {
      var a = olds[i], b = freshes[i];
      if (!a) old.appendChild(b);
      else if (!same(a, b)) old.replaceChild(b, a);
      else if (a.nodeType === 1) merge(a, b);
      else if (a.nodeValue !== b.nodeValue) a.nodeValue = b.nodeValue;
    }
    for (i = freshes.length; i < olds.length; i++) old.removeChild(olds[i]);
  }

  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(location.href, { credentials: "same-origin", headers: { "X-Harel-Live": "1" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("content");
        var now = document.getElementById("content");
        if (fresh && now) {
          merge(now, document.adoptNode(fresh));
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
