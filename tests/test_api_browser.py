"""The API's browsable docs (/api/docs, Swagger UI served from this server) in real Chromium, under the
pages' Content-Security-Policy."""

from __future__ import annotations

import pytest

from .test_browser import chromium, controller, log_in, new_page, web  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


def test_api_docs_render_every_endpoint_with_no_console_error(web, chromium):  # noqa: F811
    """Covers: Swagger UI's own JavaScript drawing /api/docs in Chromium under the site's Content-Security-Policy; the
    fast API tests read the schema, not the page a browser draws.
    """
    errors: list[str] = []
    page = new_page(chromium, errors)
    log_in(page, web)
    page.goto(web + "/api/docs")
    page.wait_for_selector(".swagger-ui .opblock", timeout=20000)
    paths = page.locator(".opblock-summary-path").all_text_contents()
    for path in ("/api/v1/jobs/", "/api/v1/jobs/{name}/logs", "/api/v1/jobs/{name}/cancel", "/api/v1/health"):
        assert any(p.replace("\u200b", "") == path for p in paths), (path, paths)
    assert errors == []
