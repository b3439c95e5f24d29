/* Sortable tables: click a header to sort its rows by that column (again: the other way). */
(function () {
  "use strict";
  document.querySelectorAll("table.sortable").forEach(function (table) {
    const body = table.tBodies[0];
    table.querySelectorAll("th[data-sort]").forEach(function (th, col) {
      th.classList.add("sort-head");
      th.setAttribute("role", "button");
      th.tabIndex = 0;
      const sort = function () {
        const up = th.getAttribute("aria-sort") !== "ascending";
        table.querySelectorAll("th[aria-sort]").forEach(function (h) {
          h.removeAttribute("aria-sort");
        });
        th.setAttribute("aria-sort", up ? "ascending" : "descending");
        const numeric = th.dataset.sort === "num";
        const key = function (row) {
          const cell = row.cells[col];
          const raw = cell.dataset.value !== undefined ? cell.dataset.value : cell.textContent.trim();
          if (!numeric) return raw;
          const n = parseFloat(raw);
          return Number.isNaN(n) ? null : n;
        };
        const rows = Array.from(body.rows);
        rows.sort(function (a, b) {
          const x = key(a);
          const y = key(b);
          if (x === y) return 0;
          if (x === null) return 1; // blanks last either way
          if (y === null) return -1;
          return (x < y ? -1 : 1) * (up ? 1 : -1);
        });
        rows.forEach(function (row) {
          body.appendChild(row);
        });
      };
      th.addEventListener("click", sort);
      th.addEventListener("keydown", function (e) {
        if (e.key === "Enter" || e.key === " ") {
          e.preventDefault();
          sort();
        }
      });
    });
  });
})();
