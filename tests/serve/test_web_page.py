"""The web page at `/`: the page and its static files are served (without the API key: they hold no
data), with their content types, and reach no other host; unknown paths are still OpenAI-shaped 404s.
In a real headless Chromium (Playwright): a prompt submitted streams its completion token by token,
the text and every token's logprob equal to what the same request answers unstreamed, the
fingerprint shown is the server's, a hovered token shows its alternatives, the metrics panel shows
numbers; on a server with a key the page asks for it and sends it.

The browser tests skip, saying why, without the playwright package or a chromium on PATH (`apt-get
install chromium`; Playwright's own browser download is not used). POCKETLLM_WEB_SCREENSHOT=path
saves the page's screenshot there (docs/web_page.png is one)."""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pocketllm.serve.app import STATIC_DIR

from .conftest import MAX_BATCH, MODEL, running_server

KEY = "sk-page-123"
PARAMS = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.8, "seed": 7}
CONTENT_TYPES = {".html": ("text/html",), ".js": ("text/javascript", "application/javascript"), ".css": ("text/css",)}
SCREENSHOT_ENV = "POCKETLLM_WEB_SCREENSHOT"


def test_the_page_and_its_static_files_are_served(base_url):
    page = httpx.get(f"{base_url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.text == (STATIC_DIR / "index.html").read_text()
    files = sorted(p.name for p in STATIC_DIR.iterdir())
    assert sorted(Path(name).suffix for name in files) == [".css", ".html", ".js"], files
    for name in files:
        served = httpx.get(f"{base_url}/static/{name}", timeout=30)
        assert served.status_code == 200 and served.content == (STATIC_DIR / name).read_bytes()
        assert served.headers["content-type"].split(";")[0] in CONTENT_TYPES[Path(name).suffix], served.headers
        if name != "index.html":
            assert f'"static/{name}"' in page.text, f"index.html does not load {name}"


def test_unknown_paths_are_still_openai_404s(base_url):
    for path in ("/no-such-page", "/static/no-such-file.js", "/static/", "/static/../app.py"):
        response = httpx.get(f"{base_url}{path}", timeout=30)
        assert response.status_code == 404, path
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "not_found_error", error


def test_the_static_files_reach_no_other_host():
    """No URL with a scheme or a host (http://, https://, //host), no @import, no CDN: the page works offline."""
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.findall(r"(?i)\b[a-z][a-z0-9+.-]*://", text), f"{path.name} names a URL with a scheme"
        assert not re.findall(r"""(?i)(?:src|href)\s*=\s*["']?(?://|/[^/"'])""", text), \
            f"{path.name} loads from an absolute path or another host"
        assert "@import" not in text and "url(" not in text, path.name


def test_the_page_is_served_without_the_key_and_the_api_is_not(engine):
    with running_server(engine, api_key=KEY) as url:
        assert httpx.get(f"{url}/", timeout=30).status_code == 200
        assert httpx.get(f"{url}/static/pocketllm.js", timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401


# -- in a real browser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                   "(pip install playwright; its browser download is not needed)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH: install it with `apt-get install -y chromium` to run the browser tests")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True)
        yield browser
        browser.close()


def _reference(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The same request, not streamed."""
    body = {**PARAMS, "model": MODEL, "logprobs": 5}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _generate(page: Any) -> None:
    page.fill("#prompt", PARAMS["prompt"])
    page.fill("#max-tokens", str(PARAMS["max_tokens"]))
    page.fill("#temperature", str(PARAMS["temperature"]))
    page.fill("#seed", str(PARAMS["seed"]))
    page.click("#submit")
    page.wait_for_selector("#completion .tok", timeout=10_000)
    page.wait_for_function("document.getElementById('output').dataset.state !== 'running'", timeout=10_000)
    assert page.get_attribute("#output", "data-state") == "done", page.text_content("#status")


def _shown_logprobs(page: Any) -> list[float]:
    spans = page.eval_on_selector_all("#completion .tok", "spans => spans.map(s => s.dataset.logprobs)")
    return [float(x) for span in spans for x in span.split()]


def test_the_page_streams_a_completion_as_the_server_answers_it(browser, base_url):
    page = browser.new_page(viewport={"width": 1100, "height": 540})
    try:
        page.goto(f"{base_url}/?metrics_ms=200")
        page.wait_for_function(f"document.getElementById('model').textContent === {MODEL!r}", timeout=5_000)
        assert not page.is_visible("#api-key")  # an open server: no key asked for
        _generate(page)
        reference = _reference(base_url)
        choice = reference["choices"][0]
        assert page.text_content("#completion") == choice["text"]
        assert _shown_logprobs(page) == choice["logprobs"]["token_logprobs"]  # every token, bit for bit
        assert page.text_content("#fingerprint") == reference["system_fingerprint"]
        assert page.text_content("#finish") == choice["finish_reason"]
        assert page.text_content("#count") == str(len(choice["logprobs"]["tokens"]))
        # A span is shaded by its probability (a span holds several positions where its tokens do
        # not spell its text: bytes of one character); the one with the fewest positions is hovered.
        counts = [len(lps.split()) for lps in page.eval_on_selector_all(
            "#completion .tok", "spans => spans.map(s => s.dataset.logprobs)")]
        index = counts.index(min(counts))
        span = page.locator("#completion .tok").nth(index)
        shading = float(span.evaluate("span => getComputedStyle(span).getPropertyValue('--p')"))
        span_logprobs = [float(x) for x in span.get_attribute("data-logprobs").split()]
        assert shading == pytest.approx(math.exp(sum(span_logprobs)), abs=1e-4)

        # Metrics: numbers; the counter of generated tokens counts a request once it has ended, so
        # the scrapes after both requests show them, and tokens/s comes from two scrapes.
        generated = 2 * len(choice["logprobs"]["tokens"])
        page.wait_for_function(f"Number(document.getElementById('m-generated').textContent) >= {generated}",
                               timeout=5_000)
        for cell in ("#m-running", "#m-waiting", "#m-generated"):
            assert re.fullmatch(r"\d+", page.text_content(cell)), cell
        assert re.fullmatch(r"\d+\.\d", page.text_content("#m-rate"))
        assert re.fullmatch(rf"\d+ / {MAX_BATCH}", page.text_content("#m-slots"))

        # Hovering a token shows its alternatives, the chosen one marked.
        span.hover()
        page.wait_for_selector("#tooltip", state="visible", timeout=2_000)
        start = sum(counts[:index])
        tops = choice["logprobs"]["top_logprobs"][start:start + counts[index]]
        assert page.locator("#tooltip tr.alt").count() == sum(len(top) for top in tops)
        assert page.locator("#tooltip tr.chosen").count() == len(tops)
        if screenshot := os.environ.get(SCREENSHOT_ENV):
            page.screenshot(path=screenshot)
        page.mouse.move(0, 0)
        page.wait_for_selector("#tooltip", state="hidden", timeout=2_000)
    finally:
        page.close()


def test_the_page_asks_for_the_key_and_sends_it(browser, engine):
    with running_server(engine, api_key=KEY) as url:
        page = browser.new_page()
        try:
            page.goto(f"{url}/")
            page.wait_for_selector("#api-key", state="visible", timeout=5_000)
            assert "API key" in page.text_content("#status")
            page.fill("#api-key", "sk-wrong")
            page.click("#submit")
            page.wait_for_function("document.getElementById('status').textContent.includes('401')", timeout=5_000)
            page.fill("#api-key", KEY)
            _generate(page)
            reference = _reference(url, {"Authorization": f"Bearer {KEY}"})
            assert page.text_content("#completion") == reference["choices"][0]["text"]
            assert page.text_content("#fingerprint") == reference["system_fingerprint"]
        finally:
            page.close()
