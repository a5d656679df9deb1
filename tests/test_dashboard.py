"""The dashboard (issue "The dashboard"; server_bridge/http/static/) in a real browser:
headless Chromium (Debian's) driven by Playwright, against the real `wren bridge
--http` process, Mosquitto and a board on the MicroPython unix port running
tests/dashboard_stack.py's agent, with tests/model_server.py as its model.

The tests share one stack and one signed-in page and run in order, as a person would
use the page: sign in, start runs from it, answer what they ask, reload, live through a
bridge restart, and then another tenant looks. axe-core checks each view it reaches
(no serious or critical violations), at a laptop's width and a phone's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_bridge.registry import Registry
from server_bridge.tokens import sign
from tests import dashboard_stack as ds
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import TENANT, Stack
from tests.test_http_api import bearer, token

pytestmark = pytest.mark.skipif(ds.missing() is not None, reason=ds.missing() or "")

DOCS = Path(__file__).resolve().parent.parent / "docs"
# The README's screenshots are made by the tests that reach those views, written to
# docs/ only when asked (WREN_SCREENSHOTS=1): a test run leaves the tree as it found it.
SHOTS = DOCS if os.environ.get("WREN_SCREENSHOTS") == "1" else None
# What a test waits for the page, at most (ms).
WAIT_MS = 30_000
# 2,000 characters, non-ASCII among them, streamed 4 characters to a chunk.
LONG = "".join(f"Line {k:03d}: the basil wants water, 21 °C — ok.\n" for k in range(50))[:2000]
assert len(LONG) == 2000
# How much of the (first) answer the page shows.
ANSWER_LENGTH = (
    "() => (document.querySelector('.k-assistant .text') || {textContent: ''}).textContent.length"
)
ENDED = ".status-box .badge:text-matches('Done|Failed|Cancelled')"


@dataclass
class Dash:
    server: ModelServer
    stack: Stack
    base: str
    alice: str
    page: Any
    browser: Any
    console: list[str] = field(default_factory=list)
    # Every URL the pages asked for, across the tests (test_the_page_loads_nothing_...).
    requests: list[str] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)
    convs: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dash]:
    from playwright.sync_api import sync_playwright

    port = ds.free_port()
    with (
        ModelServer() as server,
        Stack(
            tmp_path_factory.mktemp("dashboard"),
            model_url=server.url,
            main_py=ds.MAIN_PY,
            heap=ds.HEAP,
            bridge_args=["--http", f"127.0.0.1:{port}"],
        ) as stack,
        sync_playwright() as p,
    ):
        browser = ds.launch(p)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(WAIT_MS)
        d = Dash(server, stack, f"http://127.0.0.1:{port}", token(stack, "alice"), page, browser)
        page.on("console", lambda m: d.console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: d.console.append(f"pageerror: {e}"))
        page.on("request", lambda r: d.requests.append(r.url))
        try:
            yield d
        finally:
            browser.close()


def test_axe_core_is_installed() -> None:
    # Without it the views' accessibility checks below check nothing: skipped where it
    # cannot be installed (no node or npm), a failure where it could and was not.
    absent = ds.axe_absent()
    if absent is not None:
        expected, why = absent
        if expected:
            pytest.fail(why, pytrace=False)
        pytest.skip(why)


def check_axe(page: Any, what: str) -> None:
    found = ds.axe_violations(page)
    if found is None:
        # Passed only where axe-core cannot be had (test_axe_core_is_installed says so).
        absent = ds.axe_absent()
        if absent is not None and absent[0]:
            pytest.fail(f"no accessibility check of {what}: {absent[1]}", pytrace=False)
        return
    assert not found, f"axe-core on {what}:\n" + "\n".join(found)


def start_run(d: Dash, text: str) -> str:
    """Ask the device from its page's request box; the run's id, once the page shows it."""
    page = d.page
    page.evaluate("() => { location.hash = '#/device/thermo1'; }")
    page.fill("form.request textarea", text)
    page.click("form.request button[type=submit]")
    page.wait_for_url(re.compile(r"#/run/thermo1/"))
    return page.url.rsplit("/", 1)[1]


def status(page: Any) -> str:
    return str(page.inner_text(".status-box dd >> nth=0"))


def facts(page: Any) -> dict[str, str]:
    """The run's status box as {term: what it says}."""
    pairs = page.eval_on_selector_all(
        ".status-box dt", "els => els.map(e => [e.textContent, e.nextElementSibling.textContent])"
    )
    return {str(k): str(v) for k, v in pairs}


def wait_status(page: Any, word: str) -> None:
    page.wait_for_selector(f".status-box .badge:text-is('{word}')")


def transcript(page: Any) -> list[tuple[str, str]]:
    """(kind, text) of each row shown, in order: a message's text, a tool result's
    output, the first line of anything else."""
    rows = page.eval_on_selector_all(
        ".transcript > li.row:not([hidden])",
        "els => els.map(e => [e.className.split(' ').find(c => c.startsWith('k-')).slice(2),"
        " (e.querySelector(':scope > .text, :scope > pre, :scope > .md, :scope > dl')"
        " || {textContent: ''}).textContent])",
    )
    return [(k, t if k in ("user", "assistant", "tool_result", "missing") else "") for k, t in rows]


def api_rows(d: Dash, run: str) -> list[tuple[str, str]]:
    """The run's rows as the bridge's own snapshot has them, as transcript() reads the
    page's (model turns that said nothing left out, as the page leaves them out)."""
    snap = httpx.get(f"{d.base}/v1/devices/thermo1/runs/{run}", headers=bearer(d.alice)).json()
    out = []
    for r in snap["rows"]:
        kind = r["kind"]
        if kind == "assistant" and not r.get("text") and not r.get("reasoning"):
            continue
        text = r.get("output", "") if kind == "tool_result" else r.get("text", "")
        out.append((kind, text if kind in ("user", "assistant", "tool_result", "missing") else ""))
    return out


def test_sign_in_and_see_the_fleet(dash: Dash) -> None:
    page = dash.page
    # A few devices registered that never connected, beside the board.
    registry = Registry(dash.stack.registry_path)
    try:
        for k in range(1, 5):
            registry.add_device(f"bed{k}", TENANT, "helper")
    finally:
        registry.close()
    page.goto(dash.base + "/")
    assert page.url.endswith("/ui/")
    page.wait_for_selector("#login:not([hidden])")
    check_axe(page, "the sign-in form")
    # A token that proves nothing is refused on the form, in words.
    page.fill("#token", "not.a-token")
    page.press("#token", "Enter")
    page.wait_for_selector("#login-error:text('not valid')")
    page.fill("#token", dash.alice)
    page.press("#token", "Enter")
    page.wait_for_selector(".fleet-table tbody tr >> nth=4")
    assert "never seen" in page.inner_text(".fleet-table tbody")
    # Sorted by presence, the board that is online comes first.
    page.click("button.sort[data-key=presence]")
    row = page.inner_text(".fleet-table tbody tr")
    assert "thermo1" in row and "online" in row and "helper" in row and "2.1" in row, row
    assert re.search(r"\b[0-9a-f]{8}\b", row) and "KiB" in row, row  # boot id, free heap
    assert "alice" in page.inner_text("#who")
    # The token is the tab's, never in the address bar.
    assert dash.alice not in page.url
    # Filtering to nothing says so; clearing brings the device back.
    page.fill("input[type=search]", "no-such-device")
    page.wait_for_selector("text=Showing 0 of 0 devices")
    page.fill("input[type=search]", "")
    page.select_option("select", "online")
    page.wait_for_selector("text=Showing 1 of 1 devices (5 in all)")
    page.select_option("select", "all")
    page.wait_for_selector(".fleet-table tbody tr >> nth=4")
    check_axe(page, "the fleet")
    page.focus("button.sort[data-key=presence]")
    shot = page.screenshot(path=str(SHOTS / "dashboard-fleet.png") if SHOTS else None)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_long_answer_streams_onto_the_page(dash: Dash) -> None:
    page = dash.page
    dash.server.override_next(Turn(text=LONG, chunk_chars=4, delay_s=0.002))
    run = start_run(dash, "Tell me about the basil, at length.")
    dash.runs["long"] = run
    # Seen growing before the run ended: it streams, not lands whole.
    lengths = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        n = page.evaluate(ANSWER_LENGTH)
        lengths.append(n)
        if n >= len(LONG):
            break
        time.sleep(0.02)
    wait_status(page, "Done")
    text = page.text_content(".k-assistant .text")
    assert text == LONG
    assert any(0 < n < len(LONG) for n in lengths), lengths
    assert transcript(page) == api_rows(dash, run)
    assert "in," in page.inner_text(".status-box")  # token usage


def test_an_approval_is_clicked_and_the_run_completes(dash: Dash) -> None:
    page = dash.page
    dash.server.override_next(
        Turn(tool_calls=[ToolCall("open_valve", json.dumps({"valve": 3}))]),
        Turn(text="Valve 3 is open."),
    )
    run = start_run(dash, "Open valve 3, please.")
    dash.runs["approval"] = run
    ask = page.wait_for_selector("section.ask")
    about = ask.inner_text()
    # Read by the tool's JSON schema: its title and description, and the value asked for.
    assert "open_valve" in about and "Valve" in about and "which valve, 1-8" in about, about
    wait_status(page, "Paused")
    # The fleet's runs in flight (GET /v1/devices) hold it while it waits; and the tools
    # the forms read, with their schemas.
    listed = httpx.get(f"{dash.base}/v1/devices", headers=bearer(dash.alice)).json()["devices"]
    board = next(x for x in listed if x["device"] == "thermo1")
    assert board["runs"] == [run]
    assert {t["name"]: t.get("approval", False) for t in board["tools"]} == {
        "open_valve": True,
        "ask_user": False,
    }
    check_axe(page, "a run waiting for an approval")
    shot = page.screenshot(path=str(SHOTS / "dashboard-run.png") if SHOTS else None,
                           full_page=True)  # fmt: skip
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    page.click("section.ask button:text('Approve')")
    wait_status(page, "Done")
    assert page.query_selector("section.ask") is None
    rows = transcript(page)
    assert ("assistant", "Valve 3 is open.") in rows
    assert ("tool_result", "valve 3 is open") in rows
    assert "approved by alice" in page.inner_text(".k-tool_call")
    assert rows == api_rows(dash, run)
    assert "/tool/open_valve" in page.inner_text(".nodes")


def test_a_client_tool_is_answered_from_its_form_by_keyboard(dash: Dash) -> None:
    page = dash.page
    dash.server.override_next(
        Turn(tool_calls=[ToolCall("ask_user", json.dumps({"q": "Vent the tank as well?"}))]),
        Turn(text="You said: {last_tool_output}"),
    )
    run = start_run(dash, "Check the line.")
    dash.runs["tool"] = run
    ask = page.wait_for_selector("section.ask")
    assert "Vent the tank as well?" in ask.inner_text() and "Question" in ask.inner_text()
    # The keyboard alone: focus the answer, type, Enter sends the form.
    page.focus("section.ask input[name=answer]")
    page.keyboard.type("yes, vent it")
    page.keyboard.press("Enter")
    wait_status(page, "Done")
    rows = transcript(page)
    assert ("assistant", "You said: yes, vent it") in rows, rows
    assert ("tool_result", "yes, vent it") in rows
    assert rows == api_rows(dash, run)


def test_a_reload_shows_the_same_transcript(dash: Dash) -> None:
    page = dash.page
    before = transcript(page)
    log_before = page.inner_text(".status-box")
    page.reload()
    wait_status(page, "Done")
    page.wait_for_function(
        "n => document.querySelectorAll('.transcript > li.row').length >= n",
        arg=len(before),
    )
    assert transcript(page) == before
    assert page.inner_text(".status-box") == log_before


def test_a_table_an_output_and_citations_render(dash: Dash) -> None:
    page = dash.page
    run = start_run(dash, "table 200")
    dash.runs["table"] = run
    wait_status(page, "Done")
    # A page of the table at a time: the most recent 100, then the rest on asking.
    page.wait_for_selector("section.table >> text=200 rows, the 100 most recent shown")
    assert page.locator("section.table tbody tr").count() == 100
    page.click("section.table button:text('Show more rows')")
    page.wait_for_function(
        "() => document.querySelector('section.table h3').textContent === 'Table plants 200 rows'"
    )
    assert page.locator("section.table tbody tr").count() == 200
    # Most recent first; the Markdown output as a list; the source cited.
    assert page.inner_text("section.table tbody tr >> nth=0").startswith("p199")
    # The oldest row carries a forward link, shown on it.
    assert "grows_near → plants/p1" in page.inner_text("section.table tbody tr >> nth=199")
    assert page.inner_text(".k-output .md li >> nth=0") == "basil: 3 pots"
    assert "greenhouse.md" in page.inner_text(".citations")
    # The JSON output as JSON; the node panel: both nodes, the edge taken, the budget.
    assert json.loads(page.inner_text(".k-output pre.json")) == {
        "rows": 200,
        "beds": ["basil", "mint"],
    }
    nodes = page.eval_on_selector_all(
        ".nodes-table tbody th code", "els => els.map(e => e.textContent)"
    )
    assert nodes == ["/fill", "/report"], nodes
    assert page.inner_text(".nodes .edges") == "/fill —done→ /report"
    assert page.inner_text(".nodes .budgets") == "warn reads: 4 of 5"
    dash.convs["table"] = page.inner_text(".status-box a[href^='#/conv/']")
    check_axe(page, "a run with a table")


def test_a_conversation_reopens_with_its_history(dash: Dash) -> None:
    page = dash.page
    page.evaluate("run => { location.hash = '#/run/thermo1/' + run; }", dash.runs["tool"])
    wait_status(page, "Done")
    conv = page.inner_text(".status-box a[href^='#/conv/']")
    page.evaluate("() => { location.hash = '#/conversations'; }")
    page.wait_for_selector(f"text={conv}")
    check_axe(page, "the conversations")
    page.click(f"a:text('{conv}')")
    page.wait_for_selector(".conversation .k-assistant:not([hidden])")
    text = page.inner_text(".conversation .transcript")
    assert "Check the line." in text and "You said: yes, vent it" in text
    assert page.is_visible("form.request")  # go on with it
    check_axe(page, "a conversation")
    # The table run's conversation, reopened: its table as the run left it.
    page.evaluate("conv => { location.hash = '#/conv/' + conv; }", dash.convs["table"])
    page.wait_for_selector(
        ".conversation section.table >> text=200 rows, the 100 most recent shown"
    )
    assert page.inner_text(".conversation section.table tbody tr >> nth=0").startswith("p199")
    assert "grows_near → plants/p1" not in page.inner_text(".conversation section.table tbody")
    page.click(".conversation section.table button:text('Show more rows')")
    page.wait_for_selector(".conversation section.table tbody tr >> nth=199")
    assert "grows_near → plants/p1" in page.inner_text(
        ".conversation section.table tbody tr >> nth=199"
    )
    assert "Filled 200 rows." in page.inner_text(".conversation .transcript")


def test_a_denied_call_ends_the_run_and_reasoning_folds_away(dash: Dash) -> None:
    page = dash.page
    thought = "The gardener said no: the valve stays as it is, and I say so."
    dash.server.override_next(
        Turn(tool_calls=[ToolCall("open_valve", json.dumps({"valve": 5}))]),
        Turn(reasoning=thought, text="Valve 5 stays shut."),
    )
    run = start_run(dash, "Open valve 5, please.")
    page.wait_for_selector("section.ask")
    page.click("section.ask button:text('Deny')")
    wait_status(page, "Done")
    assert page.query_selector("section.ask") is None
    rows = transcript(page)
    # The tool never ran: its result is the denial, and the model went on from it.
    assert ("tool_result", "denied by alice") in rows, rows
    assert page.locator(".k-tool_result pre.out.failed").count() == 1
    assert "denied by alice" in page.inner_text(".k-tool_call")
    assert "valve 5 is open" not in page.inner_text(".transcript")
    assert ("assistant", "Valve 5 stays shut.") in rows
    assert rows == api_rows(dash, run)
    # The model's reasoning: on its row, folded away until opened.
    reasoning = page.locator(".k-assistant details.reasoning")
    assert reasoning.count() == 1
    assert reasoning.evaluate("d => d.open") is False
    assert not page.is_visible(".k-assistant details.reasoning > .text")
    assert page.inner_text(".k-assistant:has(details.reasoning) > .text") == "Valve 5 stays shut."
    page.click(".k-assistant details.reasoning summary")
    assert reasoning.evaluate("d => d.open") is True
    assert page.inner_text(".k-assistant details.reasoning > .text") == thought
    assert "reasoning" in facts(page)["Tokens"]


def test_a_failed_run_says_why_and_whether_asking_again_may_work(dash: Dash) -> None:
    page = dash.page
    secret = "sk-upstream-0123456789"
    asked = len(dash.server.requests)
    # The model server overloaded, in words the customer must not see (a key, its pool).
    error = {"message": f"pool gpu-7 exhausted for key {secret}", "type": "server_error"}
    dash.server.override_next(Turn(status=503, body=json.dumps({"error": error})))
    run = start_run(dash, "Is the tank full?")
    page.wait_for_selector(ENDED)
    assert status(page) == "Failed"
    said = facts(page)
    overloaded = "the model server is overloaded or restarting (HTTP 503)"
    assert said["Error"] == f"llm (overloaded): {overloaded}"
    assert said["Retryable"] == "yes: asking again may work"
    body = page.inner_text("body")
    assert secret not in body and "gpu-7" not in body and dash.server.url not in body
    # One call: the bridge leaves asking again to the person, who is offered it.
    assert len(dash.server.requests) == asked + 1
    snap = httpx.get(f"{dash.base}/v1/devices/thermo1/runs/{run}", headers=bearer(dash.alice))
    assert (snap.json()["status"], snap.json()["retryable"]) == ("failed", True)
    assert transcript(page) == api_rows(dash, run)
    # Asked again, in the same conversation, the model refuses the bridge's key: a
    # failure no asking again mends, and not offered.
    conv = said["Conversation"]
    dash.server.override_next(Turn(status=401))
    page.click(".controls button:text('Ask again')")
    page.wait_for_url(lambda url: "#/run/thermo1/" in url and not url.endswith("/" + run))
    again = page.url.rsplit("/", 1)[1]
    page.wait_for_selector(ENDED)
    assert status(page) == "Failed"
    said = facts(page)
    assert said["Error"].startswith("llm (auth): the model server refused the credentials"), said
    assert said["Retryable"] == "no"
    assert said["Conversation"] == conv
    assert page.locator(".controls button").count() == 0
    assert transcript(page)[0] == ("user", "Is the tank full?")
    assert transcript(page) == api_rows(dash, again)
    assert len(dash.server.requests) == asked + 2


def test_a_run_is_cancelled_from_its_page(dash: Dash) -> None:
    page = dash.page
    slow = "".join(f"bed{k} " for k in range(300))
    dash.server.override_next(Turn(text=slow, chunk_chars=4, delay_s=0.02))
    run = start_run(dash, "Water every bed, slowly.")
    page.wait_for_function(f"() => ({ANSWER_LENGTH})() > 20")
    page.click(".controls button:text('Cancel run')")
    page.wait_for_selector(ENDED)
    assert status(page) == "Cancelled"
    assert len(page.text_content(".k-assistant .text") or "") < len(slow)
    assert page.locator(".controls button").count() == 0  # nothing to cancel, nor ask again
    snap = httpx.get(f"{dash.base}/v1/devices/thermo1/runs/{run}", headers=bearer(dash.alice))
    assert snap.json()["status"] == "cancelled"
    assert transcript(page) == api_rows(dash, run)


def test_a_hole_the_bridge_declares_lost_shows_where_it_is(dash: Dash) -> None:
    # The bridge's own frames (server_bridge/http/views.py, app.py) of a run whose ids
    # 4..6 it no longer holds, served in place of the bridge's stream.
    from server_bridge.http.app import _gap
    from server_bridge.http.views import sse_frame

    page = dash.page
    run = "0badc0de.7"

    def frame(i: int, t: str, **d: Any) -> bytes:
        return sse_frame(run, {"r": run, "i": i, "t": t, "ts": 1_700_000_000_000 + i, "d": d})

    body = b"".join([
        frame(1, "run.started", input="Tell me about the hole.", agent="helper", ver="2.1"),
        frame(2, "msg.start", m=1, role="assistant"),
        frame(3, "msg.delta", m=1, text="Before the hole."),
        _gap(run, 4, 6),
        frame(7, "msg.delta", m=1, text="After the hole."),
        frame(8, "run.done", usage={"in": 3, "out": 5}),
    ])  # fmt: skip
    events = f"**/v1/devices/thermo1/runs/{run}/events"
    page.route(events, lambda route: route.fulfill(
        status=200, body=body, headers={"Content-Type": "text/event-stream"}))  # fmt: skip
    try:
        page.evaluate("run => { location.hash = '#/run/thermo1/' + run; }", run)
        wait_status(page, "Done")
        assert transcript(page) == [
            ("user", "Tell me about the hole."),
            ("assistant", "Before the hole."),
            ("missing", "[missing: events 4..6]"),
            ("assistant", "After the hole."),
        ]
        assert facts(page)["Missing"] == "4..6"
        # The raw log says it where it happened.
        page.click(".log-box summary")
        page.wait_for_selector(".log li.note")
        log = page.eval_on_selector_all(
            ".log > li", "els => els.map(e => e.classList.contains('note') ? e.textContent"
            " : e.querySelector('.id').textContent)")  # fmt: skip
        assert log == [
            f"{run}:1",
            f"{run}:2",
            f"{run}:3",
            "events 4..6 are no longer held by the bridge",
            f"{run}:7",
            f"{run}:8",
        ]
    finally:
        page.unroute(events)


def test_the_page_lives_through_a_bridge_restart_mid_run(dash: Dash) -> None:
    page, s = dash.page, dash.stack
    slow = "".join(f"word{k} " for k in range(150))
    dash.server.override_next(Turn(text=slow, chunk_chars=4, delay_s=0.02))
    run = start_run(dash, "Count slowly.")
    page.wait_for_function(f"() => ({ANSWER_LENGTH})() > 40")
    resumed: list[str] = []
    page.on("request", lambda r: resumed.append(r.headers.get("last-event-id", ""))
            if r.url.endswith(f"/runs/{run}/events") else None)  # fmt: skip
    s.kill_bridge()
    # The page says the bridge is gone, and keeps trying.
    page.wait_for_selector("text=Reconnecting to the bridge")
    page.wait_for_selector("#bridge:has-text('bridge offline')")
    s.start_bridge()
    page.wait_for_selector(ENDED, timeout=60_000)
    page.wait_for_selector("#bridge:has-text('bridge online')")
    rows = transcript(page)
    assert rows == api_rows(dash, run), (rows, dash.stack.describe())
    assert [k for k, _ in rows].count("user") == 1
    # It went on from the last event it had, not from the start.
    assert resumed and all(re.fullmatch(rf"{re.escape(run)}:\d+", h) for h in resumed), resumed
    assert int(resumed[-1].rsplit(":", 1)[1]) > 1
    # The raw log holds each event once, in order, every id from 1 to the last.
    snap = httpx.get(f"{dash.base}/v1/devices/thermo1/runs/{run}", headers=bearer(dash.alice))
    last = snap.json()["lastId"]
    assert status(page).lower() == snap.json()["status"]
    page.click(".log-box summary")
    page.wait_for_function("n => document.querySelectorAll('.log .id').length >= n", arg=last)
    ids = page.eval_on_selector_all(".log .id", "els => els.map(e => e.textContent)")
    assert ids == [f"{run}:{i}" for i in range(1, last + 1)], ids


def test_a_phone_reads_the_run_and_the_fleet(dash: Dash) -> None:
    page = dash.page
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page.evaluate("run => { location.hash = '#/run/thermo1/' + run; }", dash.runs["approval"])
        wait_status(page, "Done")
        wide = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
        assert wide <= 0, f"the run view is {wide}px wider than a phone"
        check_axe(page, "the run view on a phone")
        page.evaluate("() => { location.hash = '#/'; }")
        page.wait_for_selector(".fleet-table tbody tr")
        assert page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0
        check_axe(page, "the fleet on a phone")
    finally:
        page.set_viewport_size({"width": 1280, "height": 800})


def test_a_long_conversation_loads_its_earlier_rows(dash: Dash) -> None:
    # More rows than one window (30): the page shows the tail, and "Load earlier" the
    # rows before it, in order, each once.
    from tests.test_http_api import start, stream

    asked = [f"Question {k:02d} about the basil." for k in range(18)]
    for text in asked:
        dash.server.override_next(Turn(text=f"Answer to {text[:11]}."))
        _, run = start(dash.base, dash.alice, text, conv="long-chat")
        stream(f"{dash.base}/v1/devices/thermo1/runs/{run}/events", dash.alice)
    page = dash.page
    page.evaluate("() => { location.hash = '#/conv/long-chat'; }")
    page.wait_for_selector(".conversation .k-user:has-text('Question 17')")
    shown = page.inner_text(".conversation .transcript")
    assert "Question 00" not in shown
    earlier = page.locator(".conversation button:text('Load earlier')")
    while earlier.is_visible():
        earlier.click()
        page.wait_for_timeout(100)
    page.wait_for_selector(".conversation .k-user:has-text('Question 00')")
    users = page.eval_on_selector_all(
        ".conversation .transcript .k-user",
        "els => els.map(e => (e.querySelector('.text') || e).textContent.trim())",
    )
    assert [u for u in users if u.startswith("Question")] == asked
    check_axe(page, "a long conversation")


def test_a_device_that_goes_offline_is_said_on_its_run(dash: Dash) -> None:
    page, s = dash.page, dash.stack
    page.evaluate("run => { location.hash = '#/run/thermo1/' + run; }", dash.runs["approval"])
    wait_status(page, "Done")
    s.kill_board()
    try:
        # The board's will, the bridge's grace (5 s), the page's next look at the fleet.
        page.wait_for_selector("text=Device thermo1 is offline", timeout=60_000)
        page.evaluate("() => { location.hash = '#/'; }")
        page.wait_for_selector(".fleet-table tbody tr:has-text('thermo1'):has-text('offline')")
    finally:
        s.start_board()
    page.wait_for_selector(".fleet-table tbody tr:has-text('thermo1'):has-text('online')",
                           timeout=60_000)  # fmt: skip


def test_another_tenants_token_sees_nothing_of_the_first(dash: Dash) -> None:
    registry = Registry(dash.stack.registry_path)
    secret = secrets.token_bytes(32)
    try:
        registry.add_tenant("globex", secret)
        registry.add_device("kiosk9", "globex", "kiosk")
    finally:
        registry.close()
    theirs = sign(secret, "globex", "alice")  # the same user name, another tenant
    context = dash.browser.new_context()
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.on("request", lambda r: dash.requests.append(r.url))
    try:
        ds.sign_in(page, dash.base, theirs)
        page.wait_for_selector(".fleet-table tbody tr")
        fleet = page.inner_text(".fleet-table tbody")
        assert "kiosk9" in fleet and "thermo1" not in fleet
        # The first tenant's run, by its address: nothing of it.
        page.evaluate("run => { location.hash = '#/run/thermo1/' + run; }", dash.runs["approval"])
        page.wait_for_selector("text=No such run on this device")
        assert page.locator(".transcript > li").count() == 0
        page.evaluate("() => { location.hash = '#/conversations'; }")
        page.wait_for_selector("text=No conversations yet")
        page.evaluate("() => { location.hash = '#/device/thermo1'; }")
        page.wait_for_selector("text=No such device")
        body = page.inner_text("body")
        for word in ("Valve 3", "vent it", "basil", "helper"):
            assert word not in body
    finally:
        context.close()


def test_the_page_broke_no_rule_of_its_own(dash: Dash) -> None:
    # No script error, and nothing refused by the page's CSP (inline script or style, a
    # load from elsewhere), across everything the tests above did. Failed loads are the
    # API's answers the tests asked for (a bad token, another tenant's run) or the
    # bridge while it was down.
    errors = [m for m in dash.console if m.startswith("pageerror") or "Content Security" in m]
    assert not errors, errors


def test_the_page_loads_nothing_but_the_bridges_own(dash: Dash) -> None:
    # No CDN, works offline: everything the pages asked for, across the tests above,
    # came from the bridge (what they loaded and what they asked the API).
    assert {
        f"{dash.base}/ui/{name}" for name in ("", "app.mjs", "reducer.mjs", "dashboard.css")
    } <= set(dash.requests), dash.requests[:20]
    elsewhere = sorted({u for u in dash.requests
                        if not u.startswith((dash.base + "/", "data:"))})  # fmt: skip
    assert not elsewhere, elsewhere
    # And the page may load nothing else: its policy, as the bridge sends it.
    ui = httpx.get(f"{dash.base}/ui/")
    assert ui.status_code == 200 and ui.headers["content-type"].startswith("text/html")
    policy = {d.split()[0]: d.split()[1:]
              for d in ui.headers["content-security-policy"].split(";") if d.strip()}  # fmt: skip
    assert policy == {
        "default-src": ["'self'"],
        "img-src": ["'self'", "data:"],
        "style-src": ["'self'"],
        "script-src": ["'self'"],
        "connect-src": ["'self'"],
        "frame-ancestors": ["'none'"],
        "base-uri": ["'none'"],
        "form-action": ["'self'"],
    }, policy
    assert ui.headers["x-content-type-options"] == "nosniff"
