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

  // What a node stands for across refreshes: a row's data-key (an execution, a dead letter,
  // a timer...), or an id; null for a node known by its place among the unkeyed ones.
  function key(node) {
    if (node.nodeType !== 1) return null;
    var k = node.getAttribute("data-key");
    return k !== null ? k : node.id ? "#" + node.id : null;
  }

  function same(old, fresh) {
    return old.nodeType === fresh.nodeType && old.nodeName === fresh.nodeName &&
      (old.nodeType !== 1 || old.getAttribute("name") === fresh.getAttribute("name"));
  }

  // Makes `old` show what `fresh` shows, changing only what differs: a keyed node is the one
  // with its key (a row stays the same node when rows come and go around it), the others are
  // paired in order; a node whose text did not change stays the same node, so a selection in
  // it, the focus and a field's input stay with what they were on.
  function merge(old, fresh) {
    var i, j, attribute, child;
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
    var keyed = Object.create(null), loose = [];
    for (child = old.firstChild; child; child = child.nextSibling) {
      var k = key(child);
      if (k !== null && !(k in keyed)) keyed[k] = child;
      else if (k === null) loose.push(child);
    }
    var wanted = [], next = 0, freshes = Array.prototype.slice.call(fresh.childNodes);
    for (i = 0; i < freshes.length; i++) {
      var b = freshes[i], kb = key(b), a = null;
      if (kb !== null) {
        if (kb in keyed && same(keyed[kb], b)) { a = keyed[kb]; delete keyed[kb]; }
      } else {
        for (j = next; j < loose.length; j++) {
          if (same(loose[j], b)) { a = loose[j]; next = j + 1; break; }
        }
      }
      if (a === null) wanted.push(b);
      else {
        if (a.nodeType === 1) merge(a, b);
        else if (a.nodeValue !== b.nodeValue) a.nodeValue = b.nodeValue;
        wanted.push(a);
      }
    }
    // What is no longer there goes first, so that the nodes kept mostly stand in place
    // already (a node moved loses the focus and any selection in it).
    var kept = new Set(wanted);
    Array.prototype.slice.call(old.childNodes).forEach(function (node) {
      if (!kept.has(node)) old.removeChild(node);
    });
    for (i = 0; i < wanted.length; i++) {
      if (old.childNodes[i] !== wanted[i]) old.insertBefore(wanted[i], old.childNodes[i] || null);
    }
  }

  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(location.href, { credentials: "same-origin", headers: { "X-Harel-Live": "1" } })
      // An answer that is not a success is shown too (an execution purged: "not found"; a
      // database failing: its error), as a fresh load would show it.
      .then(function (r) { return r.text(); })
      .then(function (html) {
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
