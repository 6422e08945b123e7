"""Debian's Chromium, headless, driven by Playwright (no browser is downloaded): the console's
browser tests and ``bench/console_browser.py`` use it. ``make install-browser`` installs it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from playwright.sync_api import Browser, sync_playwright


def chromium_path() -> str:
    """``TOKENGATE_CHROMIUM``, else Debian's ``chromium`` on the PATH."""
    found = os.environ.get("TOKENGATE_CHROMIUM") or shutil.which("chromium")
    if not found:
        raise RuntimeError("no Chromium: `make install-browser` installs Debian's chromium package "
                           "(or set TOKENGATE_CHROMIUM to a Chromium binary)")
    return found


@contextmanager
def chromium() -> Iterator[Browser]:
    # as root (CI's containers) Chromium's sandbox cannot start: it runs without, on pages of our own
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=args)
        try:
            yield browser
        finally:
            browser.close()
