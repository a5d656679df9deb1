"""The README's AG-UI example ("Hosts over HTTP": an `HttpAgent` of the official
@ag-ui/client, installed in tests/js by tools/setup.sh) run as written, by node, against
the real bridge process, Mosquitto and a board on the MicroPython unix port, as
tests/test_agui.py runs its own client. Only what the README tells the reader to fill
in is replaced: the bridge's address (`wren bridge --http 127.0.0.1:8080`) and the
token, which the example reads from the environment as TOKEN."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.stack import DEVICE, Stack
from tests.test_agui import JS
from tests.test_http_api import HTTP, http_url, token

README = Path(__file__).resolve().parent.parent / "README.md"
# Where the README's bridge serves HTTP; the reader's own HOST:PORT stands for it.
README_BASE = "http://127.0.0.1:8080"


def readme_example() -> str:
    """The README's one JavaScript block that makes an HttpAgent."""
    blocks = re.findall(r"^```js\n(.*?)^```", README.read_text(), re.M | re.S)
    found = [b for b in blocks if "new HttpAgent(" in b]
    assert len(found) == 1, f"{len(found)} js blocks of README.md make an HttpAgent"
    return found[0]


def test_the_readme_agui_example_runs_as_written_and_prints_the_answer(
    tmp_path: Path,
) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the README's JavaScript example needs it")
    assert (JS / "node_modules" / "@ag-ui" / "client").is_dir(), (
        "tests/js/node_modules lacks @ag-ui/client: run `npm ci --prefix tests/js` "
        "(tools/setup.sh does)"
    )
    code = readme_example()
    # What the reader fills in, there exactly once each as the README writes them.
    assert code.count(README_BASE) == 1, code
    assert code.count("process.env.TOKEN") == 1, code
    assert f"/v1/devices/{DEVICE}/agui" in code, code
    with Stack(tmp_path, bridge_args=HTTP) as s:
        script = code.replace(README_BASE, http_url(s))
        # A module from stdin, run in tests/js: `import "@ag-ui/client"` resolves to
        # its node_modules, and top-level await is allowed, as in the reader's .mjs.
        done = subprocess.run(
            ["node", "--input-type=module"], input=script, capture_output=True, text=True,
            timeout=120, cwd=JS, env={**os.environ, "TOKEN": token(s, "alice")},
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr + s.describe()
    # No warning or error from the client or node.
    assert done.stderr == "", done.stderr
    # The deltas as they streamed (every text message's: the one before the tool call
    # too), then console.log("\n", the last message's content): the answer, twice.
    streamed, sep, last = done.stdout.rpartition("\n ")
    assert sep and last.endswith("\n"), repr(done.stdout)
    answer = last[:-1]
    assert "°C" in answer and streamed.endswith(answer), repr(done.stdout)
