/* Pages fed by the cluster group (overview, jobs board): re-render their regions on every event. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  if (!document.querySelector('[data-source="cluster"]')) return;
  const refresh = UGRO.throttle(function () {
    UGRO.refreshRegions().catch(function () {});
  }, 300);
  UGRO.socket("/ws/cluster/", refresh, refresh);
  // Readings that arrive without an event (or while the socket was down) still show within 30 s.
  setInterval(function () {
    if (!document.hidden) refresh();
  }, 30000);
})();
