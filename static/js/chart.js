/* Line charts on uPlot: one series per rank (or per job) plus an optional mean, live-appendable. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2500, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 2e6, 5e6, 1e7];
  const PALETTE = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#0891b2", "#db2777", "#65a30d", "#dc2626"];

  UGRO.color = function (i) {
    return PALETTE[i % PALETTE.length];
  };

  /** A chart in `container`; `set(lines)` draws [{label, xs, ys, color, width, dash}] aligned on x. */
  UGRO.LinePlot = function (container, options) {
    this.container = container;
    this.options = options || {};
    this.plot = null;
    this.labels = "";
    const self = this;
    window.addEventListener(
      "resize",
      UGRO.debounce(function () {
        if (self.plot) self.plot.setSize(self.size());
      }, 150)
    );
  };

  UGRO.LinePlot.prototype.size = function () {
    return { width: Math.max(300, this.container.clientWidth - 8), height: this.options.height || 320 };
  };

  UGRO.LinePlot.prototype.set = function (lines) {
    lines = lines.filter(function (l) {
      return l.xs.length > 0;
    });
    if (!lines.length) return false;
    const data = uPlot.join(
      lines.map(function (l) {
        return [l.xs, l.ys];
      })
    );
    const labels = lines
      .map(function (l) {
        return l.label;
      })
      .join("\u0000");
    if (this.plot && labels === this.labels) {
      this.plot.setData(data);
      return true;
    }
    if (this.plot) this.plot.destroy();
    this.container.replaceChildren();
    this.labels = labels;
    const opts = {
      ...this.size(),
      scales: { x: { time: false } },
      // Steps are integers: no fractional ticks on x.
      axes: [
        { label: this.options.xLabel || "step", incrs: STEP_INCRS },
        { label: this.options.yLabel || "", size: 60 },
      ],
      cursor: { drag: { x: true, y: false } },
      legend: { live: true },
      series: [{ label: "step" }].concat(
        lines.map(function (l) {
          return { label: l.label, stroke: l.color, width: l.width || 1.5, dash: l.dash, spanGaps: true, points: { show: false } };
        })
      ),
    };
    const self = this;
    // Vertical marks where a later attempt of the job joined the curve: options.markers = [{x, label}].
    opts.hooks = {
      draw: [
        function (u) {
          const marks = self.options.markers || [];
          if (!marks.length) return;
          const ctx = u.ctx;
          ctx.save();
          ctx.strokeStyle = "#dc2626";
          ctx.fillStyle = "#dc2626";
          ctx.setLineDash([4, 4]);
          ctx.font = 12 * devicePixelRatio + "px sans-serif";
          for (const m of marks) {
            const x = Math.round(u.valToPos(m.x, "x", true));
            if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
            ctx.beginPath();
            ctx.moveTo(x, u.bbox.top);
            ctx.lineTo(x, u.bbox.top + u.bbox.height);
            ctx.stroke();
            ctx.fillText(m.label, x + 4, u.bbox.top + 14 * devicePixelRatio);
          }
          ctx.restore();
        },
      ],
    };
    this.plot = new uPlot(opts, data, this.container);
    return true;
  };

  /** One metric of one job, per rank and the mean across ranks, fed by the series endpoint and live points. */
  UGRO.MetricSeries = function () {
    this.ranks = new Map(); // rank -> Map(step -> value)
    this.mean = new Map(); // step -> value
    this.count = 0;
  };

  UGRO.MetricSeries.prototype.load = function (json) {
    this.ranks.clear();
    this.mean.clear();
    this.count = 0;
    for (const [rank, xy] of Object.entries(json.ranks || {})) {
      const steps = new Map();
      for (let i = 0; i < xy.x.length; i++) steps.set(xy.x[i], xy.y[i]);
      this.ranks.set(Number(rank), steps);
      this.count += xy.x.length;
    }
    const mean = json.mean || { x: [], y: [] };
    for (let i = 0; i < mean.x.length; i++) this.mean.set(mean.x[i], mean.y[i]);
  };

  UGRO.MetricSeries.prototype.add = function (rank, step, value) {
    if (!this.ranks.has(rank)) this.ranks.set(rank, new Map());
    const steps = this.ranks.get(rank);
    if (!steps.has(step)) this.count++;
    steps.set(step, value);
    let sum = 0;
    let n = 0;
    for (const other of this.ranks.values()) {
      if (other.has(step)) {
        sum += other.get(step);
        n++;
      }
    }
    this.mean.set(step, sum / n);
  };

  function sorted(map) {
    const xs = Array.from(map.keys()).sort(function (a, b) {
      return a - b;
    });
    return {
      xs: xs,
      ys: xs.map(function (x) {
        return map.get(x);
      }),
    };
  }

  UGRO.MetricSeries.prototype.lines = function () {
    const ranks = Array.from(this.ranks.keys()).sort(function (a, b) {
      return a - b;
    });
    const lines = ranks.map(function (rank, i) {
      return { label: "rank " + rank, color: UGRO.color(i), ...sorted(this.ranks.get(rank)) };
    }, this);
    if (ranks.length > 1) lines.push({ label: "mean", color: "#111827", width: 2.5, dash: [6, 4], ...sorted(this.mean) });
    return lines;
  };
})();
