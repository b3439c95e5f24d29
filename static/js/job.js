/* Job detail: a panel per metric and per-rank logs, live from /ws/jobs/<id>/; state changes re-render
   the summary, results and checkpoints. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const root = document.getElementById("job-root");
  if (!root) return;
  const MAX_LINES = 5000;

  // ---- metric panels ----
  const DEFAULTS = { smoothing: 0.6, xMode: "step" };
  const RELOAD_AFTER_POINTS = 20000; // a panel fed this many live points is refetched (downsampled)
  const view = UGRO.readView(DEFAULTS);
  const panelsBox = document.getElementById("panels");
  const info = document.getElementById("chart-info");
  const started = Date.parse(root.dataset.started || "");
  const t0 = Number.isFinite(started) ? started / 1000 : null;
  const totals = new Map(); // panel name -> points stored on the server when last loaded
  const loading = new Map(); // panel name -> promise of its load
  const timed = new Set(); // panels loaded with each point's time
  const partial = new Set(); // panels loaded with their first rank only (rank 0 is all a panel shows by default)

  function saveView() {
    UGRO.writeView(view, DEFAULTS);
  }
  const board = new UGRO.PanelBoard(panelsBox, makePanel, view, saveView);
  UGRO.jobBoard = board; // for the console and the browser tests

  // where each later attempt joined the curve (server-rendered JSON, read as data)
  const attemptMarks = JSON.parse(root.dataset.attempts || "[]").map((m) => ({
    x: m.step,
    label: "attempt " + m.attempt,
  }));

  function makePanel(name, parent) {
    const panel = new UGRO.Panel(
      parent,
      {
        name: name,
        primary: (key) => key === "0",
        syncKey: "job-" + root.dataset.job,
        filePrefix: root.dataset.name + "_",
        markers: attemptMarks,
        complete: () => (partial.has(name) ? loadPanel(name) : null),
      },
      view
    );
    panel.t0 = t0;
    return panel;
  }

  function updateInfo() {
    let shown = 0;
    let stored = 0;
    for (const [name, panel] of board.panels) {
      shown += panel.count;
      stored += Math.max(panel.count, totals.get(name) || 0);
    }
    info.textContent = shown + " points shown" + (stored > shown ? " (downsampled from " + stored + ")" : "");
  }
  const updateInfoSoon = UGRO.throttle(updateInfo, 250);

  function bucketsWanted() {
    return Math.max(200, Math.min(2000, Math.floor(panelsBox.clientWidth / 2) || 600));
  }

  // one panel's answer (/series, or its entry in /panels) drawn, with the live points that came meanwhile
  function applySeries(name, json, withTime) {
    const panel = board.panel(name);
    const live = new Map(panel.lines); // points that arrived while loading
    const byKey = {};
    for (const [rank, xy] of Object.entries(json.ranks || {})) {
      byKey[rank] = { x: xy.x, y: xy.y, t: (json.times || {})[rank] };
    }
    panel.byTime = Boolean(json.by_time);
    panel.load(byKey);
    for (const [key, line] of live) {
      const loaded = panel.lines.get(key);
      const last = loaded && loaded.x.length ? loaded.x[loaded.x.length - 1] : -Infinity;
      for (let i = 0; i < line.x.length; i++) if (line.x[i] > last) panel.add(key, line.x[i], line.y[i], line.t[i]);
    }
    totals.set(name, json.total_points);
    if (withTime) timed.add(name);
    else timed.delete(name);
    // only its first rank came (the others are asked for once every rank is shown)
    if (json.only_rank !== undefined) partial.add(name);
    else partial.delete(name);
    document.getElementById("chart-empty")?.remove();
    panel.draw();
  }

  function track(names, promise) {
    for (const name of names) loading.set(name, promise);
    return promise.finally(function () {
      for (const name of names) if (loading.get(name) === promise) loading.delete(name);
    });
  }

  // one panel again (it was fed too many live points): its own, smaller answer
  function loadPanel(name) {
    // each point's time only for a time axis: it costs the query two aggregates and the reply a third array
    const withTime = view.xMode !== "step";
    const url =
      root.dataset.seriesUrl + "?name=" + encodeURIComponent(name) + "&buckets=" + bucketsWanted() + (withTime ? "&time=1" : "");
    return track(
      [name],
      UGRO.getJSON(url).then(function (json) {
        applySeries(name, json, withTime);
        updateInfo();
      })
    );
  }

  let firstPanels = root.dataset.firstPanels || ""; // the URL the page preloaded (the browser answers from it)
  const listed = Array.from(document.querySelectorAll("#metric-names li"), (li) => li.dataset.name);

  function sameAsked(a, b) {
    const skip = (q) => Array.from(q.entries()).filter(([k]) => k !== "buckets").map((e) => e.join("=")).join("&");
    return skip(a) === skip(b);
  }

  // every panel in one request: one answer and one read on the server, instead of one per panel.
  // every: also the metrics this page has not seen yet (after a resync or a reconnect: the server names them)
  function loadPanels(every) {
    const names = new Set(listed);
    for (const name of board.panels.keys()) names.add(name);
    // every panel's place first, in one pass: the answer then only draws the charts
    for (const name of names) board.panel(name, true);
    board.apply();
    const withTime = view.xMode !== "step";
    const query = new URLSearchParams({ buckets: String(bucketsWanted()) });
    if (!every) for (const name of names) query.append("name", name);
    if (!view.allLines) query.set("ranks", "first");
    if (withTime) query.set("time", "1");
    let url = root.dataset.panelsUrl + "?" + query.toString();
    // the first load takes the URL the page preloaded when it asks the same (the browser answers from it)
    const first = firstPanels ? new URLSearchParams(firstPanels.split("?")[1]) : null;
    if (first && sameAsked(first, query)) url = firstPanels;
    firstPanels = ""; // a preload answers once
    const request =
      names.size || every
        ? UGRO.getJSON(url).then(function (json) {
            const series = json.series || {};
            for (const name of Object.keys(series)) if (every || names.has(name)) applySeries(name, series[name], withTime);
            updateInfo();
          })
        : Promise.resolve();
    return track(names, request)
      .catch(function () {})
      .then(function () {
        board.apply();
        panelsBox.dataset.ready = "1";
        if (!window.__ugroPanelsDrawnAt) window.__ugroPanelsDrawnAt = performance.now();
      });
  }

  UGRO.bindControls(view, function (what) {
    saveView();
    const names = Array.from(board.panels.keys());
    if (what === "query") board.apply();
    else if (
      (what === "x" && view.xMode !== "step" && names.some((n) => !timed.has(n))) ||
      (what === "ranks" && view.allLines && names.some((n) => partial.has(n)))
    ) {
      loadPanels().then(function () {
        board.drawAll();
      });
    } else board.drawAll();
  });

  function addPoints(points) {
    const now = Date.now() / 1000;
    let added = false;
    for (const [rank, step, name, value] of points) {
      if (!Number.isFinite(value) || typeof name !== "string") continue;
      const panel = board.panel(name);
      if (step === null) {
        // a value with no step (a Lightning bar's) is drawn by time, unless the series has steps
        if (!panel.count) panel.byTime = true;
        if (!panel.byTime) continue;
        panel.add(String(rank), now, value, now);
      } else if (panel.byTime) {
        // the framework's file now gives this series with its steps: they replace the bar's values
        panel.byTime = false;
        panel.load({});
        panel.add(String(rank), step, value, now);
        if (!loading.has(name)) loadPanel(name).catch(function () {});
      } else panel.add(String(rank), step, value, now);
      added = true;
      if (panel.count > RELOAD_AFTER_POINTS && !loading.has(name)) loadPanel(name).catch(function () {});
    }
    if (added) {
      document.getElementById("chart-empty")?.remove();
      updateInfoSoon();
    }
  }

  // ---- logs ----
  const log = document.getElementById("log");
  const rankSelect = document.getElementById("log-rank");
  const search = document.getElementById("log-search");
  const follow = document.getElementById("log-follow");
  const count = document.getElementById("log-count");

  function matches(line) {
    const rank = rankSelect.value;
    if (rank !== "" && line.dataset.rank !== rank) return false;
    const q = search.value.trim().toLowerCase();
    return !q || line.lastChild.textContent.toLowerCase().includes(q);
  }

  function lineNode(rank, text) {
    const line = UGRO.el("div", "line");
    line.dataset.rank = String(rank);
    line.append(UGRO.el("span", "line-rank r" + (Number(rank) % 8), "r" + rank), UGRO.el("span", "line-text", text));
    line.hidden = !matches(line);
    return line;
  }

  function updateCount() {
    count.textContent = log.childElementCount + " lines";
  }

  /** A job queued when the page loaded gets its ranks later: offer each one as it first speaks. */
  function offerRank(rank) {
    const value = String(rank);
    const options = Array.from(rankSelect.options);
    if (options.some((o) => o.value === value)) return;
    const before = options.find((o) => o.value !== "" && Number(o.value) > Number(rank));
    rankSelect.add(new Option("rank " + value, value), before || null);
  }

  function appendLines(rank, texts) {
    offerRank(rank);
    const frag = document.createDocumentFragment();
    for (const text of texts) frag.append(lineNode(rank, text));
    log.append(frag);
    while (log.childElementCount > MAX_LINES) log.firstElementChild.remove();
    updateCount();
    if (follow.checked) log.scrollTop = log.scrollHeight;
  }

  function applyFilter() {
    for (const line of log.children) line.hidden = !matches(line);
    if (follow.checked) log.scrollTop = log.scrollHeight;
  }

  let loadedUpTo = {}; // rank -> byte offset the last loadLogs() covered

  async function loadLogs() {
    const json = await UGRO.getJSON(root.dataset.logsUrl + "?tail=1000");
    loadedUpTo = json.offsets || {};
    log.replaceChildren();
    const frag = document.createDocumentFragment();
    for (const [, rank, text] of json.lines) {
      offerRank(rank);
      frag.append(lineNode(rank, text));
    }
    log.append(frag);
    updateCount();
    if (follow.checked) log.scrollTop = log.scrollHeight;
  }

  rankSelect.addEventListener("change", applyFilter);
  search.addEventListener("input", UGRO.debounce(applyFilter, 150));
  follow.addEventListener("change", function () {
    if (follow.checked) log.scrollTop = log.scrollHeight;
  });

  // Checkpoints, attempts and the Resume button are server-rendered regions (re-rendered on state changes).

  // The "job queued" banner says nothing once the job has left the queue.
  function dropQueuedBanner() {
    if (root.dataset.state === "queued") return;
    document.querySelectorAll('.msg[data-tag="queued"]').forEach(function (msg) {
      msg.remove();
    });
  }
  dropQueuedBanner();

  // ---- elapsed ----
  function tickElapsed() {
    const el = document.getElementById("elapsed");
    if (!el || !el.dataset.started || el.dataset.finished) return;
    const s = Math.max(0, Math.floor((Date.now() - Date.parse(el.dataset.started)) / 1000));
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    const pad = (n) => String(n).padStart(2, "0");
    el.textContent = (h ? h + "h " + pad(m) : m) + "m " + pad(s % 60) + "s";
  }
  setInterval(tickElapsed, 1000);

  // ---- live events: buffered until the first load, so nothing is lost in between ----
  let ready = false;
  const pending = [];
  const rerender = function () {
    UGRO.refreshRegions().catch(function () {});
  };
  const refreshSoon = UGRO.debounce(rerender, 300);
  const refreshSometimes = UGRO.throttle(rerender, 5000); // progress, ranks' line counts

  function takePart(part) {
    const seen = part.end <= (loadedUpTo[String(part.rank)] ?? -1); // already in the loaded log
    if (!seen && Array.isArray(part.lines) && part.lines.length) appendLines(part.rank, part.lines);
    if (Array.isArray(part.points) && part.points.length) addPoints(part.points);
  }

  function handle(message) {
    if (!ready) {
      pending.push(message);
      return;
    }
    const data = message.data || {};
    if (message.kind === "batch") {
      // a follower's pass: one part per rank's commit, {rank, start, end, lines, points}
      for (const part of Array.isArray(data.parts) ? data.parts : []) takePart(part || {});
      refreshSometimes();
    } else if (message.kind === "points") {
      // from the metric files a job named (metrics.csv, TensorBoard events): points without log lines
      if (Array.isArray(data.points) && data.points.length) addPoints(data.points);
    } else if (message.kind === "resync") {
      // the follower could not send some events: what they held is in the database
      resync();
    } else if (message.kind === "state") {
      root.dataset.state = data.state;
      dropQueuedBanner();
      refreshSoon();
    }
  }

  const resync = UGRO.throttle(function () {
    Promise.allSettled([loadPanels(true), loadLogs()]);
  }, 2000);

  // After a dropped connection, what was missed is rebuilt from the DB (the record), not replayed.
  let connections = 0;
  function onOpen() {
    connections++;
    if (connections > 1 && ready) {
      resync();
      rerender();
    }
  }

  UGRO.socket(root.dataset.ws, handle, onOpen);
  Promise.allSettled([loadPanels(), loadLogs()]).then(function () {
    ready = true;
    pending.splice(0).forEach(handle);
    if (!board.panels.size) {
      const empty = document.getElementById("chart-empty");
      if (empty) empty.textContent = root.dataset.live === "1" ? "Waiting for the first metric points…" : "No points recorded.";
    }
  });
})();
