/* System metrics panels (GPU utilisation, memory, temperature, power; CPU, RAM) for the section
   #system[data-url]: the job's span on its page, the last 24 h on a node's page. Refreshed each minute
   while the page is live. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const section = document.getElementById("system");
  const box = document.getElementById("system-panels");
  if (!section || !box || !section.dataset.url) return;
  const view = { smoothing: 0, xMode: "wall", log: false, allLines: true };
  const panels = (UGRO.systemPanels = new Map()); // exposed for the console and the browser tests

  function panelFor(metric) {
    let panel = panels.get(metric.name);
    if (!panel) {
      panel = new UGRO.Panel(
        box,
        {
          name: metric.name,
          title: metric.title + " (" + metric.unit + ")",
          timeOnly: true,
          key: (k) => k,
          keyName: "line",
          order: (a, b) => a.localeCompare(b, undefined, { numeric: true }),
          syncKey: "system",
          xLabel: "time",
          filePrefix: (section.dataset.name || "system") + "_",
          height: 180,
        },
        view
      );
      panels.set(metric.name, panel);
    }
    return panel;
  }

  async function load() {
    const json = await UGRO.getJSON(section.dataset.url);
    // the job's energy so far (docs/power.md), refreshed with its power curve; text, never markup
    const energy = document.getElementById("job-energy");
    if (energy && json.energy && energy.firstChild) {
      energy.firstChild.textContent = json.energy.text;
      energy.title = json.energy.detail;
    }
    const metrics = (json.metrics || []).filter((m) => Object.keys(m.lines).length);
    if (!metrics.length && !panels.size) {
      box.replaceChildren(UGRO.el("p", "empty", "No health samples in this window yet."));
      return;
    }
    box.querySelector(":scope > .empty")?.remove();
    for (const metric of metrics) {
      const panel = panelFor(metric);
      const byKey = {};
      for (const [line, ty] of Object.entries(metric.lines)) byKey[line] = { x: ty.t, y: ty.y, t: ty.t };
      panel.load(byKey);
      panel.draw();
    }
    box.dataset.ready = "1";
  }

  load().catch(function () {
    box.replaceChildren(UGRO.el("p", "empty", "Could not load the system metrics."));
  });
  window.addEventListener(
    "resize",
    UGRO.debounce(function () {
      for (const panel of panels.values()) panel.resize();
    }, 150)
  );
  if (section.dataset.live === "1") {
    setInterval(function () {
      if (!document.hidden) load().catch(function () {});
    }, 60000);
  }
})();
