/* The services page: its list re-rendered every 5 s from the server (the request stats are written every few
   seconds and no event announces them); the start form is outside the region, so what is typed there stays. */
(function () {
  "use strict";
  const UGRO = window.UGRO;
  const region = document.querySelector('[data-region="services"]');
  if (!region) return;
  const url = region.dataset.url;  // the page's own address, also after a refused form was posted elsewhere
  setInterval(function () {
    if (!document.hidden) UGRO.refreshRegions(url).catch(function () {});
  }, 5000);
})();
