"""What the dashboard's browser tests and its benchmark share: the board's agent they run,
where Chromium and axe-core are, and a page signed in to the bridge's dashboard.

Chromium is Debian's (`apt-get install chromium`, tools/setup.sh), driven by Playwright's
Python package pointed at that executable: Playwright's own browser downloads are never
used. axe-core comes from the npm registry (tests/js/package.json, `npm ci`), injected
into the page by the test through the DevTools protocol, which the page's CSP does not
govern: the page itself loads nothing but its own files.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AXE = ROOT / "tests" / "js" / "node_modules" / "axe-core" / "axe.min.js"

# The board's agent: the model loop with a client tool and a tool that needs approval
# (their JSON schemas are what the dashboard's forms read), and, for a request that
# begins "table N", a handler of its own that fills a public streamed table with N
# rows, gives a Markdown output and a citation, inside a node of its own, then takes
# an edge to a second node that gives a JSON output and reports a budget near its limit.
MAIN_PY = """\
from edge_runtime import board, nodes, platform
from edge_runtime.agent import Agent
from edge_runtime.fields import Field
from edge_runtime.toolloop import model_loop


async def handle(run):
    words = run.input.split()
    if not words or words[0] != "table":
        return await model_loop(run)
    n = int(words[1]) if len(words) > 1 else 10
    async with nodes.Node(run, "/fill", "table") as fill:
        await run.event("output", {"name": "summary", "status": "final", "format": "markdown",
                                   "value": "## Beds\\n\\n- **basil**: 3 pots\\n- mint"})
        for k in range(n):
            near = {"label": "grows_near", "to_field": "plants", "to_key": "p1"}
            links = [near] if k == 0 else []
            await run.event("row", {"field": "plants", "row": "p%d" % k, "status": "final",
                                    "value": {"name": "plant %d" % k, "water": k % 7}, "ver": 1,
                                    "links": links})
        await run.event("citation", {"n": 1, "col": "manuals", "src": "greenhouse.md",
                                     "h": "Watering > Basil", "score": 0.5})
        fill.port = "done"
    await nodes.edge(run, "/fill", "done", "/report")
    async with nodes.Node(run, "/report", "internal"):
        await run.event("output", {"name": "totals", "status": "final", "format": "json",
                                   "value": {"rows": n, "beds": ["basil", "mint"]}})
        await run.event("budget", {"kind": "reads", "used": 4, "limit": 5, "level": "warn"})
    await run.event("msg.start", {"m": 1, "role": "assistant"})
    await run.event("msg.delta", {"m": 1, "text": "Filled %d rows." % n})
    await run.event("msg.end", {"m": 1})
    return {}


agent = Agent("helper", "2.1", "You help in the greenhouse.", handler=handle,
              fields=[Field("plants", vis="public", kind="collection", stream=True),
                      Field("summary", vis="public", fmt="markdown"),
                      Field("totals", vis="public", fmt="json")])


@agent.tool("open_valve", "Open a valve of the water line", {"type": "object", "properties": {
    "valve": {"type": "integer", "title": "Valve", "description": "which valve, 1-8"}},
    "required": ["valve"]}, approval=True)
def open_valve(args):
    platform.log("tool open_valve ran", args.get("valve"))
    return "valve %s is open" % args.get("valve")


agent.tool("ask_user", "Ask the gardener a question", {"type": "object", "properties": {
    "q": {"type": "string", "title": "Question"}}, "required": ["q"]})(None)
board.start(agent)
"""

# The board's heap: the demo's 128K plus room for the fields and two tools.
HEAP = "160K"


def chromium() -> str | None:
    """Debian's Chromium, where it is installed."""
    for candidate in ("/usr/bin/chromium", shutil.which("chromium") or ""):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if chromium() is None:
        return "Chromium is not installed (tools/setup.sh installs Debian's chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright's Python package is not installed (pip install -e '.[dev]')"
    return None


def axe_absent() -> tuple[bool, str] | None:
    """None where axe-core is installed; else (expected, why): `expected` where node and
    npm run, so `sh tools/setup.sh` would have installed it (its absence is then a
    failure, not a reason to check nothing)."""
    if AXE.is_file():
        return None
    if shutil.which("node") is None or shutil.which("npm") is None:
        return False, "axe-core is not installed, nor node and npm to install it: no a11y check"
    where = AXE.relative_to(ROOT)
    return True, (
        f"axe-core is not installed ({where} is missing) though node and npm are: "
        "run `sh tools/setup.sh` (or `npm ci --prefix tests/js`)"
    )


def free_port() -> int:
    """A loopback port free now: the bridge's HTTP side is given one, so the page finds
    a restarted bridge where the old one was."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(playwright: Any) -> Any:
    """Headless Chromium from Debian's package."""
    return playwright.chromium.launch(
        executable_path=chromium(),
        args=["--no-sandbox", "--disable-dev-shm-usage", "--js-flags=--expose-gc"],
    )


def sign_in(page: Any, base: str, token: str, where: str = "#/") -> None:
    """Open the dashboard signed in by a `#token=` link (what `wren token` prints),
    then go to `where`."""
    page.goto(f"{base}/ui/#token={token}")
    page.locator("#nav:not([hidden])").wait_for()
    if where != "#/":
        page.evaluate("where => { location.hash = where; }", where)


def axe_violations(
    page: Any, impacts: tuple[str, ...] = ("serious", "critical")
) -> list[str] | None:
    """axe-core's violations of the page as it stands, of those impacts: one line each
    (rule, impact, the first offending element). None when axe-core is not installed."""
    if not AXE.is_file():
        return None
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(AXE.read_text())
    found = page.evaluate(
        """async () => {
            const r = await axe.run(document, {resultTypes: ["violations"]});
            return r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
                                           nodes: v.nodes.map(n => n.target.join(" "))}));
        }"""
    )
    return [
        f"{v['id']} ({v['impact']}): {v['help']} at {json.dumps(v['nodes'][:3])}"
        for v in found
        if v["impact"] in impacts
    ]
