/* Compare: the mean curve of one metric (loss unless the chart names another) of each chosen job on
   one chart; a job marked data-best is drawn thicker and starred (a sweep's best trial). */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const box = document.getElementById("compare-chart");
  const jobs = Array.from(document.querySelectorAll(".compare-jobs li"));
  if (!box || !jobs.length) return;
  const info = document.getElementById("chart-info");
  const metric = box.dataset.metric || "loss";
  const plot = new UGRO.LinePlot(box, { yLabel: metric, height: 380 });

  Promise.all(
    jobs.map(function (li) {
      const url =
        box.dataset.seriesBase +
        encodeURIComponent(li.dataset.job) +
        "/series?name=" +
        encodeURIComponent(metric) +
        "&buckets=1500";
      return UGRO.getJSON(url).catch(function () {
        return null;
      });
    })
  ).then(function (results) {
    const lines = [];
    results.forEach(function (json, i) {
      if (!json) return;
      // One rank: its own curve; several: the mean across ranks.
      const ranks = Object.values(json.ranks || {});
      const xy = ranks.length === 1 ? ranks[0] : json.mean;
      const best = jobs[i].dataset.best === "1";
      const label = (best ? "\u2605 " : "") + jobs[i].dataset.name;
      lines.push({ label: label, color: UGRO.color(i), xs: xy.x, ys: xy.y, width: best ? 4 : 2 });
    });
    if (!plot.set(lines)) {
      box.replaceChildren(UGRO.el("p", "empty", "None of these jobs recorded " + metric + " yet."));
    }
    info.textContent = lines.length + " of " + jobs.length + " jobs have a " + metric + " curve";
  });
})();
