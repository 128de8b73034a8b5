"""A real headless Chromium for the web page's tests, driven by Playwright: the Debian
``chromium`` package (``.ci/run`` installs it) or the binary ``$CHROMIUM`` names. Where neither
Playwright nor a browser can be had, the tests that need one skip, saying why."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


def launch_chromium():
    """Generator for a fixture: yields a Playwright ``Browser``, closes it afterwards.
    Playwright gives every launch a fresh temporary profile (its own --user-data-dir)."""
    playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium binary (apt-get install chromium, or set CHROMIUM)")
    with playwright_api.sync_playwright() as p:
        try:
            instance = p.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS)
        except Exception as exc:  # a browser that cannot start here is an environment problem
            pytest.skip(f"Chromium at {path} does not start: {exc}")
        yield instance
        instance.close()


class Console:
    """The console errors and uncaught exceptions of one page."""

    def __init__(self, page) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))


def wait_idle(page) -> None:
    """Until the chat's reply has finished (Send is enabled again)."""
    page.wait_for_function("!document.querySelector('#send').disabled", timeout=90_000)
