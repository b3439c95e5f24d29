/* Compare: the mean loss curve of each chosen job on one chart. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const box = document.getElementById("compare-chart");
  const jobs = Array.from(document.querySelectorAll(".compare-jobs li"));
  if (!box || !jobs.length) return;
  const info = document.getElementById("chart-info");
  const plot = new UGRO.LinePlot(box, { yLabel: "loss", height: 380 });

  Promise.all(
    jobs.map(function (li) {
      const url = box.dataset.seriesBase + encodeURIComponent(li.dataset.job) + "/series?name=loss&buckets=1500";
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
      lines.push({ label: jobs[i].dataset.name, color: UGRO.color(i), xs: xy.x, ys: xy.y, width: 2 });
    });
    if (!plot.set(lines)) {
      box.replaceChildren(UGRO.el("p", "empty", "None of these jobs recorded a loss."));
    }
    info.textContent = lines.length + " of " + jobs.length + " jobs have a loss curve";
  });
})();
