"""`wren kb ingest` lowers its own CPU priority (tools/kb.py be_polite), so a bridge on
the same machine keeps its latency; `--nice 0` leaves it. Each check runs in a child
process: niceness, once raised, cannot be lowered again without privilege."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools import kb as kb_cli

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not hasattr(os, "nice") or not Path("/proc/self/stat").exists(),
    reason="needs os.nice and /proc (Linux)",
)

# A child that runs `wren kb ingest` in process with the embedder and the ingest itself
# replaced, and prints the niceness and scheduling policy the ingest ran at, read from
# /proc/self/stat (field 19) and os.sched_getscheduler.
_CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from tools import cli
    import server_bridge.knowledge as knowledge

    seen = {}

    class Probe:
        def __init__(self, *a, **kw):
            pass
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return False
        def ingest(self, *a, **kw):
            stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
            seen["nice"] = int(stat[16])
            seen["policy"] = os.sched_getscheduler(0)
            class Summary:
                failed = 0
                def line(self):
                    return "ok"
            return Summary()

    knowledge.KnowledgeBase = Probe
    before = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[16])
    code = cli.main(["kb", "ingest", sys.argv[1], "--tenant", "t", "--collection", "c",
                     "--store", sys.argv[2], *sys.argv[3:]])
    print(code, before, seen["nice"], seen["policy"] == os.SCHED_IDLE)
    """
)


def _ingest_priority(tmp_path: Path, *flags: str) -> tuple[int, int, bool]:
    (tmp_path / "a.txt").write_text("hello")
    got = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "a.txt"), str(tmp_path / "kb.sqlite3"),
         *flags],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=60,
    )
    assert got.returncode == 0, got.stderr
    code, before, during, idle = got.stdout.split()[-4:]
    assert code == "0"
    return int(before), int(during), idle == "True"


def test_ingest_runs_at_a_lowered_priority(tmp_path: Path) -> None:
    before, during, idle = _ingest_priority(tmp_path)
    assert during == min(19, before + kb_cli.NICE)
    assert not idle


def test_nice_0_leaves_the_priority(tmp_path: Path) -> None:
    before, during, idle = _ingest_priority(tmp_path, "--nice", "0")
    assert during == before
    assert not idle


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_idle_runs_in_the_idle_class(tmp_path: Path) -> None:
    _, _, idle = _ingest_priority(tmp_path, "--idle")
    assert idle


def test_be_polite_says_what_it_did() -> None:
    # Nothing lowered: safe in the test process itself.
    assert kb_cli.be_polite(0) == "normal priority"


def test_ingest_defaults_are_polite() -> None:
    from tools.cli import build_parser

    args = build_parser().parse_args(["kb", "ingest", "x", "--tenant", "t", "--collection", "c"])
    assert args.nice == kb_cli.NICE > 0
    assert args.threads == kb_cli.THREADS == 2
    assert not args.idle
