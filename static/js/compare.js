/* Compare: one metric of each chosen job (its rank 0) on one panel, with smoothing, x axis and log y
   in the URL; the metric can be switched without reloading the page. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const box = document.getElementById("compare-chart");
  const jobs = Array.from(document.querySelectorAll(".compare-jobs li"));
  if (!box || !jobs.length) return;
  const info = document.getElementById("chart-info");
  const select = document.getElementById("compare-metric");
  const field = document.getElementById("compare-metric-field");
  const DEFAULTS = { smoothing: 0.6, xMode: "step", metric: "" }; // the metric always goes in the URL
  const view = UGRO.readView(DEFAULTS);
  view.allLines = true;
  const names = new Map(jobs.map((li) => [li.dataset.job, li.dataset.name]));
  const order = jobs.map((li) => li.dataset.job);
  const starts = new Map(jobs.map((li) => [li.dataset.job, Date.parse(li.dataset.started || "") / 1000 || null]));
  let metric = box.dataset.metric;

  const panel = (UGRO.comparePanel = new UGRO.Panel(
    box,
    {
      name: metric,
      key: (k) => names.get(k) || "job " + k,
      keyName: "job",
      order: (a, b) => order.indexOf(a) - order.indexOf(b),
      t0Of: (k) => starts.get(k),
      filePrefix: "compare_",
      height: 380,
    },
    view
  ));

  async function load() {
    const name = metric;
    box.removeAttribute("data-ready");
    const results = await Promise.all(
      jobs.map(function (li) {
        const url = box.dataset.seriesBase + encodeURIComponent(li.dataset.job) + "/series?name=" + encodeURIComponent(name) + "&buckets=1500&time=1";
        return UGRO.getJSON(url).catch(function () {
          return null;
        });
      })
    );
    if (name !== metric) return;
    const byKey = {};
    results.forEach(function (json, i) {
      if (!json) return;
      // the same rank as the final value: rank 0, else the lowest rank that logged it
      const rank = Object.keys(json.ranks || {}).sort((a, b) => Number(a) - Number(b))[0];
      if (rank === undefined) return;
      const xy = json.ranks[rank];
      byKey[jobs[i].dataset.job] = { x: xy.x, y: xy.y, t: (json.times || {})[rank] };
    });
    panel.options.name = panel.options.title = name;
    panel.toggle.textContent = name;
    panel.load(byKey);
    const n = Object.keys(byKey).length;
    info.textContent = n + " of " + jobs.length + " jobs logged " + name;
    if (!panel.draw()) panel.box.replaceChildren(UGRO.el("p", "empty", "None of these jobs logged " + name + "."));
    box.dataset.ready = "1";
  }

  UGRO.bindControls(view, function () {
    panel.shape = "";
    panel.draw();
    UGRO.writeView(view, DEFAULTS);
  });
  if (select) {
    select.addEventListener("change", function () {
      metric = view.metric = select.value;
      if (field) field.value = metric;
      UGRO.writeView(view, DEFAULTS);
      // the table of final and best values is the server's: fetch the page for the new metric
      load().then(function () {
        return UGRO.refreshRegions();
      });
    });
  }
  window.addEventListener(
    "resize",
    UGRO.debounce(function () {
      panel.resize();
    }, 150)
  );
  load();
})();
