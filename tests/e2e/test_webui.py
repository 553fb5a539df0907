"""The chat page at /: served (GET, HEAD), self-contained, public under --api-key, off with --no-webui;
and driven in a real headless Chromium on the default model (the API key prompt, typing, streaming,
Stop, markup kept as text, localStorage, conversations, closing the tab), with a screenshot kept as a
test artifact (build/test-artifacts/webui.png; `make test-ui` runs it with the desktop window's test).

The browser is Debian's `chromium` driven by Playwright's Python package (`make test` installs the
browser where it can; without it the browser test skips, saying why).
"""
from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest

from ..artifacts import artifact_dir, image_spread
from .conftest import ServerProc, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "webui-test-key"


def test_page_is_served_whole_and_self_contained(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    page = r.text
    assert "<title>fastserve chat</title>" in page and "/v1/chat/completions" in page
    # Offline: nothing is loaded from elsewhere, and the browser is told so.
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "@import" not in page and "url(" not in page
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    # Model and user text only ever goes in as text.
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page and "document.write" not in page
    head = httpx.head(server.url + "/")
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(r.content)


def test_no_webui_is_404_and_the_page_is_public_under_an_api_key(make_server):
    off = make_server("--no-webui", "--api-key", KEY)
    r = httpx.get(off.url + "/")
    assert r.status_code == 404 and "--no-webui" in r.json()["error"]["message"]
    assert httpx.get(off.url + "/props").status_code == 401              # the key still guards the API


def _metrics(url: str) -> dict:
    """The unlabelled samples of /metrics: name (without _total) -> value."""
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(fastserve_[a-z_]+?)(?:_total)? ([0-9.e+-]+)$", text, re.M)}


def _slot_freed(url: str, abandon) -> None:
    """Call abandon() (Stop, or closing the tab) while one reply streams; the slot must be free soon after,
    and within one step of the server seeing the connection go (DESIGN.md contract 7): a scrape that counts
    the disconnect comes after the cancel was queued, so at most the step in flight computes one more token
    for it (the only request running)."""
    before = _metrics(url)
    assert before["fastserve_slots_busy"] == 1
    abandon()
    t0 = time.monotonic()
    scrapes = []
    while time.monotonic() < t0 + 5 and (not scrapes or scrapes[-1]["fastserve_slots_busy"]):
        scrapes.append(_metrics(url))
    freed_ms = (time.monotonic() - t0) * 1e3
    assert scrapes[-1]["fastserve_slots_busy"] == 0, "the slot is still busy 5 s after the page let go"
    gone = next(m for m in scrapes if m["fastserve_client_disconnects"] > before["fastserve_client_disconnects"])
    late = scrapes[-1]["fastserve_generated_tokens"] - gone["fastserve_generated_tokens"]
    steps = scrapes[-1]["fastserve_decode_steps"] - gone["fastserve_decode_steps"]
    assert late <= 1, f"{late:.0f} tokens ({steps:.0f} steps) came after the server saw the page go"
    assert freed_ms < 2000, f"the slot was freed {freed_ms:.0f} ms after the page let go"


def _wait_streaming(page) -> None:
    """Until the last reply has grown three times while still running (streamed, not all at once)."""
    text = page.locator(".msg.assistant .text").last
    seen = set()
    deadline = time.monotonic() + 20
    while len(seen) < 3 and time.monotonic() < deadline:
        n = len(text.text_content())
        if n:
            seen.add(n)
        time.sleep(0.03)
    assert len(seen) >= 3, f"the reply did not stream: lengths seen {sorted(seen)}"
    assert page.locator(".msg.assistant").last.get_attribute("data-done") is None   # still running


@pytest.mark.model
def test_chat_in_a_real_browser(default_model_file, tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH: `apt-get install chromium` (make test does it where it can)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    srv = ServerProc(default_model_file, tmp_path / "server.log", "-np", "2", "-c", "4096", "--api-key", KEY)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1100, "height": 720})
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(srv.url + "/")

            # The server has a key: the page asks for it (its first call got a 401), then shows the model.
            page.wait_for_selector("#key-dialog[open]", timeout=10_000)
            page.fill("#api-key", KEY)
            page.click("#key-save")
            page.locator("#model", has_text="SmolLM2").wait_for(timeout=10_000)

            page.fill("#system", "You are a storyteller who writes long stories.")
            page.fill("#max_tokens", "-1")
            page.fill("#temperature", "0")
            page.type("#prompt", "Tell me a long story about a lighthouse keeper.")
            page.keyboard.press("Enter")

            _wait_streaming(page)
            text = page.locator(".msg.assistant .text").last

            # Stop mid-reply: the fetch is aborted, the server sees the connection go and frees the slot.
            _slot_freed(srv.url, lambda: page.click("#stop"))
            page.wait_for_selector(".msg.assistant[data-done='stopped']", timeout=5_000)
            stopped_text = text.text_content()
            stats = page.locator(".msg.assistant .stats").last.text_content()
            assert "stopped" in stats and "tokens/s" in stats and "first token" in stats, stats
            time.sleep(0.2)
            assert text.text_content() == stopped_text                   # nothing arrives after Stop
            assert page.is_enabled("#send") and not page.is_enabled("#stop")

            # A second turn that runs to its end; markup in the user's text stays text.
            page.fill("#max_tokens", "12")
            page.type("#prompt", "Say <b>hello</b> & <img src=x onerror=alert(1)>")
            page.keyboard.press("Enter")
            page.locator(".msg.assistant[data-done]").nth(1).wait_for(timeout=20_000)
            assert page.locator("#messages b, #messages img").count() == 0
            assert "<b>hello</b>" in page.locator(".msg.user").last.text_content()
            last_stats = page.locator(".msg.assistant .stats").last.text_content()
            assert re.search(r"\d+ tokens · [0-9.]+ tokens/s · first token \d+ ms", last_stats), last_stats

            shot = artifact_dir() / "webui.png"
            page.screenshot(path=str(shot))
            spread, colours = image_spread(shot)
            assert spread > 10 and colours > 50, f"the screenshot looks blank ({spread=:.1f}, {colours=})"

            # (Playwright's wait_for_function would need eval, which the page's CSP forbids: locators wait.)
            # Kept in localStorage: a reload shows the same conversation, key remembered (no dialog).
            page.reload()
            page.locator(".msg").nth(3).wait_for(timeout=10_000)
            assert page.locator(".msg").count() == 4
            assert page.locator(".msg.assistant .text").first.text_content() == stopped_text
            assert page.locator("#key-dialog[open]").count() == 0
            assert page.input_value("#system").startswith("You are a storyteller")

            # Conversations: a new one starts empty, the old one is a click away; then close the tab mid-reply.
            page.click("#new-chat")
            assert page.locator(".msg").count() == 0 and page.locator("#conversations li").count() == 2
            page.locator("#conversations li button.open").nth(1).click()
            assert page.locator(".msg").count() == 4
            page.click("#new-chat")
            page.fill("#max_tokens", "-1")
            page.type("#prompt", "Tell me about the moon.")
            page.keyboard.press("Enter")
            _wait_streaming(page)
            _slot_freed(srv.url, page.close)
            assert not errors, errors
            browser.close()
    finally:
        srv.stop()
