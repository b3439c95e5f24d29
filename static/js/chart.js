/* Metric panels on uPlot: one panel per metric, lines per rank (or job, or GPU), TensorBoard-style
   smoothing with the raw line faint behind, log y, step / wall / relative x, synced crosshair, CSV and
   PNG download, live appends without refetching. Server data only ever becomes text or numbers. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2500, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 2e6, 5e6, 1e7];
  const PALETTE = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#0891b2", "#db2777", "#65a30d", "#dc2626"];
  // Past this many points in view per pixel pair, markers would be noise: draw them only for sparse lines.
  const MARKER_PX = 20;

  UGRO.color = function (i) {
    return PALETTE[i % PALETTE.length];
  };

  function faint(hex) {
    return hex + "40"; // #rrggbb + alpha 0x40
  }

  /** TensorBoard's smoothing: an exponential moving average, debiased for its zero start; non-finite
      values pass through untouched and do not feed the average. */
  UGRO.smooth = function (ys, weight) {
    const out = new Array(ys.length);
    if (!(weight > 0)) {
      for (let i = 0; i < ys.length; i++) out[i] = ys[i];
      return out;
    }
    let last = 0;
    let n = 0;
    for (let i = 0; i < ys.length; i++) {
      const y = ys[i];
      if (y === null || !Number.isFinite(y)) {
        out[i] = y;
        continue;
      }
      last = last * weight + (1 - weight) * y;
      n++;
      out[i] = last / (1 - Math.pow(weight, n));
    }
    return out;
  };

  /** Seconds as 1h02m, 3m05s, 12s (relative time axis). */
  UGRO.shortDuration = function (s) {
    s = Math.round(s);
    const sign = s < 0 ? "-" : "";
    s = Math.abs(s);
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    const pad = (n) => String(n).padStart(2, "0");
    if (h) return sign + h + "h" + pad(m);
    if (m) return sign + m + "m" + pad(s % 60) + "s";
    return sign + (s % 60) + "s";
  };

  function download(name, href) {
    const a = document.createElement("a");
    a.href = href;
    a.download = name;
    document.body.append(a);
    a.click();
    a.remove();
  }

  function csvCell(value) {
    const text = String(value);
    return /[",\n\r]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text;
  }

  /** Keep a line's x strictly increasing (uPlot needs it; equal times from one poll would collapse). */
  function increasing(xs) {
    const out = new Array(xs.length);
    let prev = -Infinity;
    for (let i = 0; i < xs.length; i++) {
      let x = xs[i];
      if (!(x > prev)) x = prev + 1e-6 * Math.max(1, Math.abs(prev));
      out[i] = prev = x;
    }
    return out;
  }

  /**
   * One metric's panel. Lines are keyed (a rank, a job, a GPU) and hold x (step), y and t (unix s).
   * options: {name, title, key (line key -> label), primary (keys shown by default), complete (a promise
   *   that every line is loaded, before a CSV), xModes (allowed),
   *           syncKey, height, timeOnly (x is always t, wall clock)}; panel.byTime: its points have no
   *           step (x is t, as in timeOnly, while the page shows steps)
   * view (shared by every panel of a page): {smoothing, xMode, log, allLines}
   */
  UGRO.Panel = function (parent, options, view) {
    this.options = options;
    this.view = view;
    this.lines = new Map();
    this.count = 0;
    this.plot = null;
    this.shape = "";
    this.collapsed = false;
    this.t0 = null; // relative time's zero (set by the page: the run's start)

    const root = (this.root = UGRO.el("section", "panel"));
    root.dataset.name = options.name;
    const head = UGRO.el("header", "panel-head");
    this.toggle = UGRO.el("button", "panel-toggle link", options.title || options.name);
    this.toggle.type = "button";
    this.toggle.setAttribute("aria-expanded", "true");
    this.toggle.title = "collapse / expand";
    const actions = UGRO.el("span", "panel-actions");
    this.csvButton = UGRO.el("button", "btn small panel-csv", "CSV");
    this.pngButton = UGRO.el("button", "btn small panel-png", "PNG");
    this.csvButton.type = this.pngButton.type = "button";
    actions.append(this.csvButton, this.pngButton);
    head.append(this.toggle, actions);
    this.box = UGRO.el("div", "panel-chart");
    this.empty = UGRO.el("p", "empty small", "No points yet.");
    this.box.append(this.empty);
    root.append(head, this.box);
    parent.append(root);

    const self = this;
    this.csvButton.addEventListener("click", function () {
      // options.complete(): a promise of every line's points, where the panel holds only those it shows
      Promise.resolve(self.options.complete ? self.options.complete() : null)
        .catch(function () {})
        .then(function () {
          self.downloadCSV();
        });
    });
    this.pngButton.addEventListener("click", function () {
      self.downloadPNG();
    });
    this.drawSoon = UGRO.throttle(function () {
      self.draw();
    }, 200);
  };

  UGRO.Panel.prototype.setCollapsed = function (collapsed) {
    this.collapsed = collapsed;
    this.root.classList.toggle("collapsed", collapsed);
    this.box.hidden = collapsed;
    this.toggle.setAttribute("aria-expanded", String(!collapsed));
    if (!collapsed) this.draw();
  };

  UGRO.Panel.prototype.line = function (key) {
    let line = this.lines.get(key);
    if (!line) {
      line = { x: [], y: [], t: [] };
      this.lines.set(key, line);
    }
    return line;
  };

  /** Replace every line: {key: {x, y, t}}. */
  UGRO.Panel.prototype.load = function (byKey) {
    this.lines.clear();
    this.count = 0;
    for (const [key, xyt] of Object.entries(byKey)) {
      const line = this.line(key);
      line.x = xyt.x.slice();
      line.y = xyt.y.slice();
      line.t = xyt.t ? xyt.t.slice() : xyt.x.map(() => null);
      this.count += line.x.length;
    }
    this.shape = "";
  };

  /** One live point; kept in step order (a late point is inserted, a repeated step replaced). */
  UGRO.Panel.prototype.add = function (key, x, y, t) {
    const line = this.line(String(key));
    const n = line.x.length;
    if (!n || x > line.x[n - 1]) {
      line.x.push(x);
      line.y.push(y);
      line.t.push(t);
      this.count++;
    } else {
      let i = n - 1;
      while (i >= 0 && line.x[i] > x) i--;
      if (i >= 0 && line.x[i] === x) {
        line.y[i] = y;
      } else {
        line.x.splice(i + 1, 0, x);
        line.y.splice(i + 1, 0, y);
        line.t.splice(i + 1, 0, t);
        this.count++;
      }
    }
    if (this.lines.size !== this._drawnLines) this.shape = "";
    this.drawSoon();
  };

  UGRO.Panel.prototype.keys = function () {
    const keys = Array.from(this.lines.keys());
    const order = this.options.order || ((a, b) => Number(a) - Number(b) || String(a).localeCompare(String(b)));
    return keys.sort(order);
  };

  /** The keys drawn: all, or the primary ones (rank 0) unless the page asks for every line. */
  UGRO.Panel.prototype.shownKeys = function () {
    const keys = this.keys();
    if (this.view.allLines || !this.options.primary) return keys;
    const primary = keys.filter((k) => this.options.primary(k));
    return primary.length ? primary : keys.slice(0, 1);
  };

  UGRO.Panel.prototype.xMode = function () {
    if (this.options.timeOnly) return "wall";
    // a series whose points have no step (a Lightning bar's values) is placed by time on a step axis
    if (this.byTime && this.view.xMode === "step") return "wall";
    return this.view.xMode;
  };

  UGRO.Panel.prototype.xsOf = function (line, key) {
    const mode = this.xMode();
    if (mode === "step") return line.x;
    const start = this.options.t0Of ? this.options.t0Of(key) : this.t0;
    const t0 = mode === "relative" ? (start ?? line.t[0] ?? 0) : 0;
    return increasing(line.t.map((t) => (t === null ? null : t - t0)));
  };

  UGRO.Panel.prototype.size = function () {
    return { width: Math.max(260, this.box.clientWidth || this.root.clientWidth || 400), height: this.options.height || 220 };
  };

  /** Draw (or update) the chart: the data is rebuilt from the lines; the plot only when its shape changed. */
  UGRO.Panel.prototype.draw = function () {
    // Not drawn while it cannot be seen (collapsed, filtered out, its group folded): it would be sized
    // for no width. Drawn when shown again.
    const keys = this.shownKeys().filter((k) => this.lines.get(k).x.length);
    if (!keys.length) return false; // checked first: asking whether it is visible costs a layout
    if (this.collapsed || !this.root.isConnected || this.root.offsetParent === null) {
      this.stale = true;
      return false;
    }
    this.stale = false;
    const smoothing = this.options.timeOnly ? 0 : this.view.smoothing;
    const smoothed = smoothing > 0;
    const log = this.view.log;
    const tables = keys.map((k) => {
      const line = this.lines.get(k);
      let ys = line.y;
      if (log) ys = ys.map((v) => (v > 0 ? v : null));
      const table = [this.xsOf(line, k), ys];
      if (smoothed) table.push(UGRO.smooth(ys, smoothing));
      return table;
    });
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const shape = [keys.join(","), this.xMode(), log, smoothed].join("|");
    this._drawnLines = this.lines.size;
    if (this.plot && shape === this.shape) {
      const size = this.size();
      if (this.plot.width !== size.width) this.plot.setSize(size); // the window changed while it was hidden
      this.plot.setData(data);
      return true;
    }
    this.build(keys, data, smoothed, log);
    this.shape = shape;
    return true;
  };

  UGRO.Panel.prototype.build = function (keys, data, smoothed, log) {
    if (this.plot) this.plot.destroy();
    this.empty.remove();
    this.box.replaceChildren();
    const mode = this.xMode();
    const label = this.options.key || ((k) => "rank " + k);
    const allKeys = this.keys();
    const series = [{ label: mode === "step" ? "step" : mode === "wall" ? "time" : "elapsed" }];
    keys.forEach((k) => {
      const color = UGRO.color(allKeys.indexOf(k));
      const points = { show: sparsePoints, size: 6, fill: color };
      if (smoothed) {
        series.push({ label: label(k) + " raw", stroke: faint(color), width: 1, spanGaps: true, points: points });
        series.push({ label: label(k), stroke: color, width: 1.75, spanGaps: true, points: points });
      } else {
        series.push({ label: label(k), stroke: color, width: 1.5, spanGaps: true, points: points });
      }
    });
    const xAxis = { label: this.options.xLabel || series[0].label };
    if (mode === "step") xAxis.incrs = STEP_INCRS;
    if (mode === "relative") {
      xAxis.values = (u, splits) => splits.map((s) => UGRO.shortDuration(s));
    }
    const opts = {
      ...this.size(),
      scales: { x: { time: mode === "wall" }, y: log ? { distr: 3 } : {} },
      axes: [xAxis, { size: 60, values: (u, splits) => splits.map(formatTick) }],
      cursor: { drag: { x: true, y: false }, sync: this.options.syncKey ? { key: this.options.syncKey } : undefined },
      legend: { live: true },
      series: series,
    };
    if (mode === "relative") {
      opts.series[0].value = (u, v) => (v === null ? "—" : UGRO.shortDuration(v));
    }
    // Where a later attempt of the job joined the curve: options.markers = [{x (step), label}].
    const marks = mode === "step" ? this.options.markers || [] : [];
    if (marks.length) opts.hooks = { draw: [(u) => drawMarks(u, marks)] };
    this.plot = new uPlot(opts, data, this.box);
    this.box.dataset.keys = keys.join(",");
  };

  function drawMarks(u, marks) {
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = ctx.fillStyle = "#dc2626";
    ctx.setLineDash([4, 4]);
    ctx.font = 11 * devicePixelRatio + "px sans-serif";
    for (const m of marks) {
      const x = Math.round(u.valToPos(m.x, "x", true));
      if (!Number.isFinite(x) || x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
      ctx.fillText(m.label, x + 3, u.bbox.top + 12 * devicePixelRatio);
    }
    ctx.restore();
  }

  function formatTick(v) {
    if (v === null) return "";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(1);
    return String(Number(v.toPrecision(4)));
  }

  /** Markers for a line sparse enough to show them (a single point would otherwise be invisible). */
  function sparsePoints(u, si, i0, i1) {
    const ys = u.data[si];
    let n = 0;
    for (let i = i0; i <= i1 && n * MARKER_PX < u.bbox.width / devicePixelRatio; i++) if (ys[i] !== null && ys[i] !== undefined) n++;
    return n * MARKER_PX < u.bbox.width / devicePixelRatio;
  }

  UGRO.Panel.prototype.resize = function () {
    if (this.plot && !this.collapsed) this.plot.setSize(this.size());
  };

  /** Every point of every line (not only those shown): key, step, unix time, ISO time, value. */
  UGRO.Panel.prototype.csv = function () {
    const keyName = this.options.keyName || "rank";
    const rows = [[keyName, "step", "time", "value"].join(",")];
    for (const key of this.keys()) {
      const line = this.lines.get(key);
      for (let i = 0; i < line.x.length; i++) {
        const t = line.t[i];
        rows.push([csvCell(key), line.x[i], t === null ? "" : new Date(t * 1000).toISOString(), line.y[i]].join(","));
      }
    }
    return rows.join("\n") + "\n";
  };

  UGRO.Panel.prototype.fileName = function (ext) {
    return (this.options.filePrefix || "") + this.options.name.replace(/[^A-Za-z0-9._-]+/g, "_") + "." + ext;
  };

  UGRO.Panel.prototype.downloadCSV = function () {
    const url = URL.createObjectURL(new Blob([this.csv()], { type: "text/csv" }));
    download(this.fileName("csv"), url);
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  };

  /** The chart canvas on white with the panel's title above it. */
  UGRO.Panel.prototype.png = function () {
    if (!this.plot) return null;
    const src = this.plot.ctx.canvas;
    const out = document.createElement("canvas");
    const pad = Math.round(28 * devicePixelRatio);
    out.width = src.width;
    out.height = src.height + pad;
    const ctx = out.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, out.width, out.height);
    ctx.fillStyle = "#111827";
    ctx.font = Math.round(14 * devicePixelRatio) + "px sans-serif";
    ctx.fillText(this.options.title || this.options.name, 8 * devicePixelRatio, 19 * devicePixelRatio);
    ctx.drawImage(src, 0, pad);
    return out.toDataURL("image/png");
  };

  UGRO.Panel.prototype.downloadPNG = function () {
    const url = this.png();
    if (url) download(this.fileName("png"), url);
  };

  // ---- a page of panels, grouped by prefix ---------------------------------------------------

  /** "train/loss" -> "train"; "loss" -> "" (the ungrouped metrics come first). */
  UGRO.groupOf = function (name) {
    const i = name.indexOf("/");
    return i > 0 ? name.slice(0, i) : "";
  };

  function isLoss(name) {
    const leaf = name.slice(name.lastIndexOf("/") + 1);
    return leaf === "loss" || leaf === "train_loss";
  }

  /** Loss first, then losses of any kind, then by name. */
  UGRO.panelOrder = function (a, b) {
    const rank = (n) => (isLoss(n) ? 0 : /loss/.test(n) ? 1 : 2);
    return rank(a) - rank(b) || a.localeCompare(b);
  };

  /** The group holding the loss first, then the ungrouped ones, then by name. */
  function groupOrder(a, b, names) {
    const hasLoss = (g) => names.some((n) => UGRO.groupOf(n) === g && isLoss(n));
    return Number(hasLoss(b)) - Number(hasLoss(a)) || (a === "" ? -1 : b === "" ? 1 : a.localeCompare(b));
  }

  /**
   * Panels for named metrics in collapsible groups, with a search box; `make(name, parent)` makes one Panel.
   * state: {hidden: Set of collapsed panel names, folded: Set of collapsed groups, query}
   */
  UGRO.PanelBoard = function (container, make, state, onChange) {
    this.container = container;
    this.make = make;
    this.state = state;
    this.onChange = onChange || function () {};
    this.panels = new Map();
    this.groups = new Map();
    const self = this;
    window.addEventListener(
      "resize",
      UGRO.debounce(function () {
        for (const panel of self.panels.values()) panel.resize();
      }, 150)
    );
  };

  UGRO.PanelBoard.prototype.group = function (name) {
    let group = this.groups.get(name);
    if (group) return group;
    const root = UGRO.el("section", "panel-group");
    root.dataset.group = name;
    const head = UGRO.el("header", "group-head");
    const toggle = UGRO.el("button", "group-toggle link", name || "metrics");
    toggle.type = "button";
    const count = UGRO.el("span", "muted small group-count");
    head.append(toggle, count);
    const grid = UGRO.el("div", "panel-grid");
    root.append(head, grid);
    group = { name: name, root: root, grid: grid, toggle: toggle, count: count };
    this.groups.set(name, group);
    this.container.append(root);
    const self = this;
    toggle.addEventListener("click", function () {
      if (self.state.folded.has(name)) self.state.folded.delete(name);
      else self.state.folded.add(name);
      self.apply();
      self.onChange();
    });
    return group;
  };

  /** Groups in order: the one holding the loss, the ungrouped, then by name (moves only what is out of place). */
  UGRO.PanelBoard.prototype.orderGroups = function () {
    const names = Array.from(this.panels.keys());
    const order = Array.from(this.groups.keys()).sort((a, b) => groupOrder(a, b, names));
    let expected = this.container.firstElementChild;
    for (const key of order) {
      const root = this.groups.get(key).root;
      if (root !== expected) this.container.insertBefore(root, expected);
      else expected = expected.nextElementSibling;
    }
  };

  /** The panel of metric `name`, made (in order within its group) the first time it is asked for;
      `later`: the caller applies the board's state once for a batch of new panels. */
  UGRO.PanelBoard.prototype.panel = function (name, later) {
    let panel = this.panels.get(name);
    if (panel) return panel;
    const group = this.group(UGRO.groupOf(name));
    const holder = document.createDocumentFragment();
    panel = this.make(name, holder);
    const siblings = Array.from(this.panels.keys()).filter((n) => UGRO.groupOf(n) === group.name);
    const next = siblings.sort(UGRO.panelOrder).find((n) => UGRO.panelOrder(name, n) < 0);
    group.grid.insertBefore(holder, next ? this.panels.get(next).root : null);
    this.panels.set(name, panel);
    this.orderGroups();
    const self = this;
    panel.toggle.addEventListener("click", function () {
      if (self.state.hidden.has(name)) self.state.hidden.delete(name);
      else self.state.hidden.add(name);
      self.apply();
      self.onChange();
    });
    if (!later) this.apply();
    return panel;
  };

  /** Apply search, collapsed panels and folded groups to the DOM. */
  UGRO.PanelBoard.prototype.apply = function () {
    const query = (this.state.query || "").trim().toLowerCase();
    // Write only what changes (each write would make the next size reading lay the page out again),
    // first what is shown, then draw what became visible.
    const set = (node, key, value) => {
      if (node[key] !== value) node[key] = value;
    };
    for (const group of this.groups.values()) {
      let shown = 0;
      const folded = this.state.folded.has(group.name);
      if (group.root.classList.contains("folded") !== folded) group.root.classList.toggle("folded", folded);
      set(group.grid, "hidden", folded);
      if (group.toggle.getAttribute("aria-expanded") !== String(!folded)) group.toggle.setAttribute("aria-expanded", String(!folded));
      for (const [name, panel] of this.panels) {
        if (UGRO.groupOf(name) !== group.name) continue;
        const match = !query || name.toLowerCase().includes(query);
        set(panel.root, "hidden", !match);
        if (match) shown++;
      }
      set(group.root, "hidden", shown === 0);
      set(group.count, "textContent", shown + (shown === 1 ? " panel" : " panels"));
    }
    for (const [name, panel] of this.panels) {
      const collapsed = this.state.hidden.has(name);
      if (collapsed !== panel.collapsed) panel.setCollapsed(collapsed);
      else if (panel.count && (panel.stale || !panel.plot)) panel.draw();
    }
  };

  UGRO.PanelBoard.prototype.drawAll = function () {
    for (const panel of this.panels.values()) {
      panel.shape = "";
      panel.draw();
    }
  };

  // ---- chart state in the URL ----------------------------------------------------------------

  /** Read {smoothing, xMode, log, allLines, query, hidden, folded} from the URL (defaults otherwise). */
  UGRO.readView = function (defaults) {
    const q = new URLSearchParams(location.search);
    const smoothing = q.has("smooth") ? Number(q.get("smooth")) : defaults.smoothing;
    const list = (key) => new Set((q.get(key) || "").split(",").filter(Boolean));
    return {
      smoothing: Number.isFinite(smoothing) ? Math.min(0.99, Math.max(0, smoothing)) : defaults.smoothing,
      xMode: ["step", "wall", "relative"].includes(q.get("x")) ? q.get("x") : defaults.xMode,
      log: q.get("log") === "1",
      allLines: q.get("ranks") === "all",
      query: q.get("q") || "",
      hidden: list("hide"),
      folded: list("fold"),
      metric: q.get("metric") || defaults.metric || "",
    };
  };

  /** Write the view into the URL (replaceState: no history entry per slider move); defaults are left out. */
  UGRO.writeView = function (view, defaults) {
    const q = new URLSearchParams(location.search);
    const set = (key, value, dflt) => (value === dflt || value === "" ? q.delete(key) : q.set(key, value));
    set("smooth", String(view.smoothing), String(defaults.smoothing));
    set("x", view.xMode, defaults.xMode);
    set("log", view.log ? "1" : "0", "0");
    set("ranks", view.allLines ? "all" : "0", "0");
    set("q", view.query || "", "");
    set("hide", Array.from(view.hidden || []).join(","), "");
    set("fold", Array.from(view.folded || []).join(","), "");
    if ("metric" in defaults) set("metric", view.metric || "", defaults.metric);
    const search = q.toString();
    history.replaceState(history.state, "", location.pathname + (search ? "?" + search : "") + location.hash);
  };

  /** Wire the shared controls (any may be missing from a page) to the view; `changed(what)` redraws. */
  UGRO.bindControls = function (view, changed) {
    const slider = document.getElementById("smoothing");
    const shown = document.getElementById("smoothing-value");
    const xSelect = document.getElementById("x-axis");
    const logBox = document.getElementById("log-y");
    const allBox = document.getElementById("all-ranks");
    const search = document.getElementById("panel-search");
    if (slider) {
      slider.value = String(view.smoothing);
      if (shown) shown.textContent = view.smoothing.toFixed(2);
      slider.addEventListener("input", function () {
        view.smoothing = Number(slider.value);
        if (shown) shown.textContent = view.smoothing.toFixed(2);
        changed("smoothing");
      });
    }
    if (xSelect) {
      xSelect.value = view.xMode;
      xSelect.addEventListener("change", function () {
        view.xMode = xSelect.value;
        changed("x");
      });
    }
    if (logBox) {
      logBox.checked = view.log;
      logBox.addEventListener("change", function () {
        view.log = logBox.checked;
        changed("log");
      });
    }
    if (allBox) {
      allBox.checked = view.allLines;
      allBox.addEventListener("change", function () {
        view.allLines = allBox.checked;
        changed("ranks");
      });
    }
    if (search) {
      search.value = view.query;
      search.addEventListener(
        "input",
        UGRO.debounce(function () {
          view.query = search.value;
          changed("query");
        }, 120)
      );
    }
  };
})();
