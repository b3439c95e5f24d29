/* Job detail: live curves and per-rank logs from /ws/jobs/<id>/, state changes re-render the summary. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const root = document.getElementById("job-root");
  if (!root) return;
  const MAX_LINES = 5000;
  const RELOAD_AFTER_POINTS = 50000;

  // ---- chart ----
  const chartBox = document.getElementById("chart");
  const select = document.getElementById("metric-select");
  const info = document.getElementById("chart-info");
  const plot = new UGRO.LinePlot(chartBox, { yLabel: select.value });
  let series = new UGRO.MetricSeries();
  let metric = select.value;
  let loading = null;

  function draw() {
    if (plot.set(series.lines())) {
      info.textContent = series.count + " points shown";
    }
  }
  // throttle, not debounce: points stream in faster than 200 ms apart and a debounce would never draw
  const drawSoon = UGRO.throttle(draw, 200);

  async function loadSeries() {
    const name = metric;
    const buckets = Math.max(200, Math.min(2000, Math.floor(chartBox.clientWidth)));
    const url = root.dataset.seriesUrl + "?name=" + encodeURIComponent(name) + "&buckets=" + buckets;
    const json = await UGRO.getJSON(url);
    if (name !== metric) return;
    const fresh = new UGRO.MetricSeries();
    fresh.load(json);
    // Points that arrived while loading are kept (a Map per step: no duplicates).
    for (const [rank, steps] of series.ranks) for (const [step, value] of steps) if (!fresh.ranks.get(rank)?.has(step)) fresh.add(rank, step, value);
    series = fresh;
    plot.options.yLabel = name;
    plot.options.markers = (json.attempts || []).map(function (a) {
      return { x: a.step, label: "attempt " + a.attempt };
    });
    const marks = document.getElementById("chart-attempts");
    if (marks) marks.textContent = plot.options.markers.map((m) => m.label + " from step " + m.x).join(" · ");
    plot.labels = "";
    draw();
    if (json.total_points > series.count) info.textContent += " (downsampled from " + json.total_points + ")";
  }

  select.addEventListener("change", function () {
    metric = select.value;
    series = new UGRO.MetricSeries();
    loading = loadSeries().catch(function () {});
  });

  function addPoints(points) {
    let added = false;
    for (const [rank, step, name, value] of points) {
      if (name === metric && Number.isFinite(value)) {
        series.add(rank, step, value);
        added = true;
      } else if (name !== metric && !Array.from(select.options).some((o) => o.value === name)) {
        select.append(new Option(name, name)); // Option(text, value): text only, never HTML
      }
    }
    if (added) {
      document.getElementById("chart-empty")?.remove();
      if (series.count > RELOAD_AFTER_POINTS) loading = loadSeries().catch(function () {});
      else drawSoon();
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

  function handle(message) {
    if (!ready) {
      pending.push(message);
      return;
    }
    const data = message.data || {};
    if (message.kind === "lines") {
      const seen = data.end <= (loadedUpTo[String(data.rank)] ?? -1); // already in the loaded log
      if (!seen && Array.isArray(data.lines) && data.lines.length) appendLines(data.rank, data.lines);
      if (Array.isArray(data.points) && data.points.length) addPoints(data.points);
      refreshSometimes();
    } else if (message.kind === "points") {
      // from the metric files a job named (metrics.csv, TensorBoard events): points without log lines
      if (Array.isArray(data.points) && data.points.length) addPoints(data.points);
    } else if (message.kind === "state") {
      root.dataset.state = data.state;
      refreshSoon();
    }
  }

  // After a dropped connection, what was missed is rebuilt from the DB (the record), not replayed.
  let connections = 0;
  function onOpen() {
    connections++;
    if (connections > 1 && ready) {
      Promise.allSettled([loadSeries(), loadLogs()]);
      rerender();
    }
  }

  UGRO.socket(root.dataset.ws, handle, onOpen);
  Promise.allSettled([loadSeries(), loadLogs()]).then(function () {
    ready = true;
    pending.splice(0).forEach(handle);
    if (!series.count) {
      const empty = document.getElementById("chart-empty");
      if (empty) empty.textContent = root.dataset.live === "1" ? "Waiting for the first metric points…" : "No points recorded.";
    }
  });
})();
