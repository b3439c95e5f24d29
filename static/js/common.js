/* UGRO: small helpers shared by every page. Data from the server is only ever set as text. */
(function () {
  "use strict";
  const UGRO = (window.UGRO = window.UGRO || {});

  /** A new element with an optional class and text (textContent: never parsed as HTML). */
  UGRO.el = function (tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  };

  UGRO.debounce = function (fn, ms) {
    let timer = null;
    return function () {
      clearTimeout(timer);
      timer = setTimeout(fn, ms);
    };
  };

  /** Call fn at most once per `ms` (the last call in a burst still runs). */
  UGRO.throttle = function (fn, ms) {
    let timer = null;
    let last = 0;
    return function () {
      if (timer) return;
      const wait = Math.max(0, last + ms - Date.now());
      timer = setTimeout(function () {
        timer = null;
        last = Date.now();
        fn();
      }, wait);
    };
  };

  /** GET JSON from our own endpoints; a redirect to the login page is an error, not data. */
  UGRO.getJSON = async function (url) {
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    const type = response.headers.get("content-type") || "";
    if (!response.ok || response.redirected || !type.includes("application/json")) {
      throw new Error("request failed: " + response.status + " " + url);
    }
    return response.json();
  };

  function setLive(on) {
    const dot = document.getElementById("live-dot");
    if (dot) {
      dot.classList.toggle("on", on);
      dot.title = on ? "live updates connected" : "live updates disconnected";
    }
  }

  /** A websocket to `path` that reconnects with backoff; onMessage gets each parsed JSON event. */
  UGRO.socket = function (path, onMessage, onOpen) {
    let ws = null;
    let delay = 500;
    let closed = false;
    function connect() {
      const scheme = location.protocol === "https:" ? "wss://" : "ws://";
      ws = new WebSocket(scheme + location.host + path);
      ws.onopen = function () {
        delay = 500;
        setLive(true);
        if (onOpen) onOpen();
      };
      ws.onmessage = function (event) {
        let message;
        try {
          message = JSON.parse(event.data);
        } catch (err) {
          return;
        }
        onMessage(message);
      };
      ws.onclose = function () {
        setLive(false);
        if (closed) return;
        setTimeout(connect, delay);
        delay = Math.min(delay * 2, 15000);
      };
    }
    connect();
    return {
      close: function () {
        closed = true;
        if (ws) ws.close();
      },
    };
  };

  /** Swap every [data-region] of this page for the same region of a freshly rendered copy. */
  UGRO.refreshRegions = async function (url) {
    const response = await fetch(url || location.href, { credentials: "same-origin" });
    if (!response.ok || response.redirected) return;
    // DOMParser documents run no scripts; their content is the server's escaped rendering.
    const doc = new DOMParser().parseFromString(await response.text(), "text/html");
    document.querySelectorAll("[data-region]").forEach(function (old) {
      const fresh = doc.querySelector('[data-region="' + CSS.escape(old.dataset.region) + '"]');
      if (fresh) old.replaceWith(document.importNode(fresh, true));
    });
    document.dispatchEvent(new CustomEvent("ugro:regions"));
  };

  // Forms marked .confirm ask first (cancel buttons).
  document.addEventListener("submit", function (event) {
    const form = event.target;
    if (form.matches && form.matches("form.confirm") && !window.confirm(form.dataset.confirm || "Are you sure?")) {
      event.preventDefault();
    }
  });
})();
