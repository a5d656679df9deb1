"""The dashboard (server_bridge/http/static/) in headless Chromium, against the real
bridge process, Mosquitto and a board on the MicroPython unix port (tests/stack.py, the
agent of tests/dashboard_stack.py) with tests/model_server.py as its model:

1. SSE event -> row on the page, p50/p99: from the moment a frame of the run's SSE
   stream has arrived in the page (read off the stream and parsed) to the moment the
   render that shows it has finished (the page's own rings, wrenDashboard.stats); for
   streamed answers and for a table run.
2. Frames over 50 ms: Chromium's long-animation-frame entries (and long tasks) while
   a 2,000-character answer streams in 4-character chunks, while a 1,000-row table
   builds, and while the finished table run is opened again (replayed whole).
3. The page's JS heap over many runs: each run started from the page and followed to
   its end, the heap read after a forced garbage collection (DevTools protocol) after
   the warm-up runs and every tenth run after: flat means within ±10 %.
4. A fleet of 1,000 devices: the time to draw it, to filter it by a keystroke and to
   sort it by a column (the device list is a synthetic /v1/devices answer served to the
   page, so the figure is the page's, not the bridge's registry).

    python benchmarks/bench_dashboard.py [--streams 10] [--rows 1000] [--runs 100]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import dashboard_stack as ds  # noqa: E402
from tests.model_server import ModelServer, Turn  # noqa: E402
from tests.stack import Stack  # noqa: E402
from tests.test_http_api import token  # noqa: E402

COMMAND = "python benchmarks/bench_dashboard.py"
ENDED = re.compile("Done|Failed|Cancelled")
LONG = ("The basil wants water at 21 °C; the mint does not. " * 40)[:2000]

# Frames longer than 50 ms and long tasks (Chromium reports only those), and the gaps
# between animation frames over 20 ms (a ring of 2,000), recorded from before the page's
# own scripts run (an init script goes in through the DevTools protocol: the page's CSP
# does not govern it).
OBSERVE = """
window.__frames = [];
window.__gaps = [];
let last = 0;
const tick = (t) => {
  if (last && t - last > 20) {
    window.__gaps.push({start: last, duration: t - last});
    if (window.__gaps.length > 2000) window.__gaps.shift();
  }
  last = t;
  requestAnimationFrame(tick);
};
requestAnimationFrame(tick);
for (const type of ["long-animation-frame", "longtask"]) {
  try {
    new PerformanceObserver((list) => {
      for (const e of list.getEntries()) {
        window.__frames.push({type, start: e.startTime, duration: e.duration});
      }
    }).observe({type, buffered: true});
  } catch (e) {}
}
"""


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def start_run(page: Any, text: str) -> None:
    page.evaluate("() => { location.hash = '#/device/thermo1'; }")
    page.fill("form.request textarea", text)
    page.click("form.request button[type=submit]")
    # A locator's wait: wait_for_selector would hand back an element handle, which
    # keeps the page's old views alive (and the heap figure climbing) until disposed.
    page.locator(".status-box .badge").filter(has_text=ENDED).wait_for(timeout=120_000)


def frames_since(page: Any, t0: float) -> dict[str, Any]:
    got = page.evaluate("t0 => window.__frames.filter(f => f.start >= t0)", t0)
    gaps = page.evaluate("t0 => window.__gaps.filter(f => f.start >= t0)", t0)
    loaf = [f["duration"] for f in got if f["type"] == "long-animation-frame"]
    tasks = [f["duration"] for f in got if f["type"] == "longtask"]
    return {"loaf": loaf, "tasks": tasks, "gap": max((g["duration"] for g in gaps), default=0)}


def scenario(page: Any, name: str, act: Any) -> dict[str, Any]:
    page.evaluate("() => wrenDashboard.stats.reset()")
    t0 = page.evaluate("() => performance.now()")
    act()
    page.wait_for_timeout(300)  # let the last frame be reported
    seen = frames_since(page, t0)
    summary = page.evaluate("() => wrenDashboard.stats.summary()")
    return {"name": name, **seen, **summary}


def figure12(page: Any, server: ModelServer, args: argparse.Namespace) -> None:
    rows = []
    lat_stream: list[float] = []
    for _ in range(args.streams):
        server.override_next(Turn(text=LONG, chunk_chars=4, delay_s=0.002))
        page.evaluate("() => wrenDashboard.stats.reset()")
        start_run(page, "Tell me about the basil.")
        text = page.text_content(".k-assistant .text")
        assert text == LONG, "the page's answer differs from the model's"
        lat_stream += page.evaluate("() => wrenDashboard.stats.latency.list()")
    stream = scenario(page, "a 2,000-character answer, 4-character chunks", lambda: (
        server.override_next(Turn(text=LONG, chunk_chars=4, delay_s=0.002)),
        start_run(page, "Once more, about the basil.")))
    rows.append(stream)
    table = scenario(page, f"a {args.rows:,}-row table building",
                     lambda: start_run(page, f"table {args.rows}"))  # fmt: skip
    lat_table = page.evaluate("() => wrenDashboard.stats.latency.list()")
    shown = page.locator("section.table h3").inner_text()
    assert f"{args.rows} rows" in shown, shown
    rows.append(table)

    def reopen() -> None:
        page.reload()
        page.locator("section.table h3").filter(has_text=f"{args.rows} rows").wait_for()

    rows.append(scenario(page, f"the {args.rows:,}-row table run opened again (replay)", reopen))

    print("\n## Figure 1: SSE event -> row on the page (ms, from the frame's arrival in the page)")
    print("| events of | n | p50 | p99 | max |")
    print("|---|---|---|---|---|")
    for name, lat in ((f"{args.streams} streamed answers", lat_stream),
                      (f"the {args.rows:,}-row table", lat_table)):  # fmt: skip
        print(f"| {name} | {len(lat)} | {pct(lat, .5):.2f} | {pct(lat, .99):.2f} | "
              f"{max(lat, default=float('nan')):.2f} |")  # fmt: skip

    print("\n## Figure 2: frames over 50 ms (Chromium's long animation frames and long tasks)")
    print("| while | frames > 50 ms | long tasks | longest gap between frames ms "
          "| longest render ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        over = [d for d in r["loaf"] if d > 50]
        print(f"| {r['name']} | {len(over)} | {len(r['tasks'])} | {r['gap']:.0f} | "
              f"{r['render']['max'] or 0:.1f} |")  # fmt: skip


def figure3(page: Any, server: ModelServer, args: argparse.Namespace) -> None:
    cdp = page.context.new_cdp_session(page)

    def heap() -> float:
        for _ in range(3):
            cdp.send("HeapProfiler.collectGarbage")
        return float(cdp.send("Runtime.getHeapUsage")["usedSize"])

    answer = ("Watering is on schedule for every bed. " * 12)[:400]
    marks: list[tuple[int, float]] = []
    warm = min(10, args.runs)
    for k in range(1, args.runs + 1):
        server.override_next(Turn(text=answer, chunk_chars=8))
        start_run(page, f"Status, please ({k}).")
        if k == warm or (k > warm and k % 10 == 0):
            marks.append((k, heap()))
    base = marks[0][1]
    print(f"\n## Figure 3: the page's JS heap over {args.runs} runs (after GC)")
    print("| after run | used heap KiB | vs run " + str(marks[0][0]) + " |")
    print("|---|---|---|")
    for k, used in marks:
        print(f"| {k} | {used / 1024:,.0f} | {(used - base) / base * 100:+.1f} % |")
    worst = max(abs(u - base) / base for _, u in marks) * 100
    print(f"\nlargest change: {worst:.1f} % ({'flat' if worst <= 10 else 'NOT flat'}: ±10 %)")


def synthetic_fleet(n: int) -> dict[str, Any]:
    rnd = random.Random(7)
    now = time.time()
    devices = []
    for k in range(n):
        st = rnd.choice(("online", "online", "online", "offline"))
        devices.append({
            "device": f"dev{k:04d}", "agent": rnd.choice(("thermostat", "greenhouse")),
            "presence": {"st": st, "boot": f"{rnd.getrandbits(32):08x}",
                         "heap": rnd.randint(9000, 60000), "ver": "1.0",
                         "fw": "wren-edge 0.1.0", "seen": now - rnd.random() * 3600,
                         "since": now - rnd.random() * 7200},
            "runs": [f"{k:08x}.{j}" for j in range(rnd.choice((0, 0, 0, 1, 2)))],
            "tools": [],
        })  # fmt: skip
    return {"devices": devices}


def figure4(browser: Any, base: str, alice: str, n: int) -> None:
    body = json.dumps(synthetic_fleet(n))
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    fleet_page = context.new_page()
    fleet_page.add_init_script(OBSERVE)
    fleet_page.route("**/v1/devices", lambda route: route.fulfill(
        status=200, content_type="application/json", body=body))
    t0 = time.perf_counter()
    ds.sign_in(fleet_page, base, alice)
    fleet_page.locator(f".fleet-table tbody tr >> nth={min(n, 100) - 1}").wait_for()
    shown = time.perf_counter() - t0
    # From the action to the next frame drawn: the page's own work, then the browser's
    # style, layout and paint of what it changed.
    measure = """([what, arg]) => new Promise((done) => {
        const t = performance.now();
        if (what === 'filter') {
          const box = document.querySelector('input[type=search]');
          box.value = arg;
          box.dispatchEvent(new Event('input'));
        } else {
          document.querySelector(`button.sort[data-key=${arg}]`).click();
        }
        requestAnimationFrame(() => setTimeout(() => done(performance.now() - t), 0));
      })"""
    loaded = fleet_page.evaluate("() => performance.now()")
    times = {
        "filter (one keystroke, `dev0`)": fleet_page.evaluate(measure, ["filter", "dev0"]),
        "filter (`dev012`)": fleet_page.evaluate(measure, ["filter", "dev012"]),
        "clear the filter": fleet_page.evaluate(measure, ["filter", ""]),
        "sort by free heap": fleet_page.evaluate(measure, ["sort", "heap"]),
        "sort by presence": fleet_page.evaluate(measure, ["sort", "presence"]),
    }
    frames = frames_since(fleet_page, loaded)
    print(f"\n## Figure 4: a fleet of {n:,} devices (synthetic /v1/devices; 100 rows a page)")
    print(f"sign-in to the fleet shown: {shown * 1e3:.0f} ms "
          "(page load, module fetches, first draw)")
    print("| action | ms, to the next frame |")
    print("|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.1f} |")
    longest = max(frames["loaf"], default=0)
    print(f"frames > 50 ms on the fleet page (filtering and sorting): "
          f"{sum(1 for d in frames['loaf'] if d > 50)} (longest {longest:.0f} ms); "
          f"longest gap between frames {frames['gap']:.0f} ms")  # fmt: skip
    context.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=10, help="figure 1: streamed answers (10)")
    ap.add_argument("--rows", type=int, default=1000, help="figures 1-2: table rows (1000)")
    ap.add_argument("--runs", type=int, default=100, help="figure 3: runs (100)")
    ap.add_argument("--devices", type=int, default=1000, help="figure 4: devices (1000)")
    args = ap.parse_args()
    why = ds.missing()
    if why:
        sys.exit(f"bench_dashboard: {why}")
    from playwright.sync_api import sync_playwright

    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    port = ds.free_port()
    with (
        tempfile.TemporaryDirectory(prefix="wren-bench-dash-") as tmp,
        ModelServer() as server,
        Stack(Path(tmp), model_url=server.url, main_py=ds.MAIN_PY, heap=ds.HEAP,
              bridge_args=["--http", f"127.0.0.1:{port}"]) as stack,  # fmt: skip
        sync_playwright() as p,
    ):
        browser = ds.launch(p)
        print(f"# Chromium {browser.version} (Debian), headless; {os.cpu_count()} CPUs")
        base, alice = f"http://127.0.0.1:{port}", token(stack, "alice")
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(60_000)
        page.add_init_script(OBSERVE)
        ds.sign_in(page, base, alice)
        figure12(page, server, args)
        figure3(page, server, args)
        figure4(browser, base, alice, args.devices)
        browser.close()


if __name__ == "__main__":
    main()
