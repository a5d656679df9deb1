"""`wren demo` serves the dashboard: it prints a signed-in link, and the page shows the
demo's board and its runs (headless Chromium, as tests/test_dashboard.py drives it),
and a run started meanwhile from the demo's terminal appears on the page as it goes."""

from __future__ import annotations

import queue
import re
import subprocess
import threading
from typing import Any

import pytest

from tests import dashboard_stack as ds
from tests.test_cli import ROOT, _env, wren

pytestmark = pytest.mark.skipif(ds.missing() is not None, reason=ds.missing() or "")

WAIT_S = 90.0


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put("")

    threading.Thread(target=pump, daemon=True).start()
    return out


def until(lines: queue.Queue[str], pattern: str, seen: list[str]) -> re.Match[str]:
    while True:
        try:
            line = lines.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"no line like {pattern!r}:\n" + "\n".join(seen)) from None
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found


def test_the_demo_prints_its_dashboard_and_the_page_shows_its_runs() -> None:
    from playwright.sync_api import sync_playwright

    proc = subprocess.Popen(
        wren("demo"), cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen: list[str] = []
    try:
        lines = lines_of(proc)
        link = until(lines, r"^dashboard: (http://127\.0\.0\.1:\d+/ui/#token=\S+)$", seen)[1]
        first = until(lines, r"^on the dashboard: \S+#/run/thermo1/(\S+)$", seen)[1]
        with sync_playwright() as p:
            browser = ds.launch(p)
            page: Any = browser.new_page()
            page.set_default_timeout(WAIT_S * 1000)
            page.goto(link)
            # The fleet: the demo's board, online.
            page.locator("#nav:not([hidden])").wait_for()
            page.locator("text=thermo1").first.wait_for()
            page.locator("text=online").first.wait_for()
            # The first run, as the terminal showed it.
            page.evaluate("run => { location.hash = '#/run/thermo1/' + run; }", first)
            page.locator(".k-assistant .text:text('It is 21.5 °C in here.')").wait_for()
            # A follow-up typed in the demo's terminal: the page follows its run.
            assert proc.stdin is not None
            proc.stdin.write("Make it 22 °C, and remember that is my usual.\n")
            proc.stdin.flush()
            second = until(lines, r"^on the dashboard: \S+#/run/thermo1/(\S+)$", seen)[1]
            page.evaluate("run => { location.hash = '#/run/thermo1/' + run; }", second)
            page.locator(".k-assistant .text:text('Done: the thermostat is set to 22 °C, "
                         "and I will remember it.')").wait_for()  # fmt: skip
            browser.close()
        proc.stdin.write("\n")  # an empty line ends the demo
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0, "\n".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
