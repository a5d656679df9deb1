"""`wren ask --conv`: an agent whose state is kept per conversation needs one.

Issue 25 left this gap: `wren ask` named no conversation, so to such an agent its
request was refused `no_scope` by the bridge (before that, its run failed `link`), and
the command line offered no way to name one. Real parts (tests/stack.py): Mosquitto, the
bridge process with its scripted demo model, a board on the MicroPython unix port whose
agent declares a session-scoped field, and `wren ask` as the real subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.stack import Stack

ROOT = Path(__file__).resolve().parent.parent
ASK_USER = "host-ask"

# The demo thermostat with one field kept per conversation (`dur: session`).
SESSION_MAIN_PY = """from edge_runtime import board, platform
from edge_runtime.demo import agent
from edge_runtime.fields import Field, check
agent.fields = [Field("topic", vis="public", dur="session", fmt="text")]
check(agent.fields)
board.start(agent, platform.load_settings())
"""


def _ask(s: Stack, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WREN_HOST_USER=ASK_USER,
               WREN_HOST_PASSWORD=s.users[ASK_USER])  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", "ask", "--broker", f"{s.host}:{s.port}",
         "--registry", str(s.registry_path), "--user-id", "alice", "--timeout", "60",
         *extra, "How warm is it in here?"],
        env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def test_ask_names_its_conversation_for_an_agent_with_session_state(tmp_path: Path) -> None:
    with Stack(tmp_path, main_py=SESSION_MAIN_PY, extra_users={ASK_USER: "demo"}) as s:
        refused = _ask(s)
        assert refused.returncode != 0, refused.stdout
        out = refused.stdout + refused.stderr
        assert "no_scope" in out and "--conv" in out, out
        served = _ask(s, "--conv", "kitchen-1")
        assert served.returncode == 0, served.stdout + served.stderr + s.describe()
        assert "status: done" in served.stdout, served.stdout
