"""Knowledge in runs (issue 26, "From the board and in runs"; PROTOCOL.md "Knowledge in
runs").

End to end, every part real: manuals ingested with `wren kb ingest` (the CLI, the
default embedder), `wren bridge --knowledge` as a process, a board on the MicroPython
unix port (.mpy, 128 KiB) whose agent declares its knowledge rule, Mosquitto with
Wren's ACL, the OpenAI-compatible test server (which records what the model was sent)
and the host client.

- `before`: the bridge adds the passages for the latest user text to the model call, in
  a message of their own after the system prompt, marked as retrieved data; the host
  gets a `citation` event per passage; the board never holds the passages.
- `tool`: the model calls kb.search, a server tool that does not pause the run; the
  passages come back as the tool's output, marked, with a citation each.
- A board offloads a reading with docs.add (kb.add), and it is found.
- The agent's on_error rule: without a knowledge store, `fail` ends the run `kb`, and
  `skip` answers without passages while a `guard` event named "knowledge" says why.

The context rule is tested at its limit on the Augmenter itself, with a real store and
registry: the passages' message (marking, labels and text) gets what the call's messages
leave, and the whole call, counted as the bridge counts it, stays within the limit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from server_bridge.host.reducer import RunSnapshot
from server_bridge.host.terminal import render
from server_bridge.knowledge import KnowledgeBase
from server_bridge.knowledge.augment import MIN_ROOM, RETRIEVED, Augmenter, context_chars
from server_bridge.knowledge.sources import Record, Records
from server_bridge.memory.grants import READ, WRITE
from server_bridge.registry import RECHECK_S, DeviceRecord, Registry
from server_bridge.rpc import RpcError
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import Stack, assistant_text
from tools.demo import AGENT, TENANT

ROOT = Path(__file__).resolve().parent.parent

# The README's example: the kiosk app and its manuals (examples/kiosk/).
KIOSK = ROOT / "examples" / "kiosk"
BEFORE = (KIOSK / "main.py").read_text()
INSTRUCTIONS = (
    "You answer customers at a shop kiosk. Answer from the passages you are given and "
    "cite them by number; say so when they do not answer the question."
)

TOOL = """\
from edge_runtime import board, docs
from edge_runtime.agent import Agent

agent = Agent("kiosk", "1.0", "You answer questions about the kiosk.",
              docs={"mode": "tool", "collections": ["manuals"], "k": 2})


@agent.tool("log_reading", "Store a reading in the kiosk's notes")
async def log_reading(args):
    got = await docs.add(agent, "notes", "reading-1", args.get("text", ""))
    return got["status"]

board.start(agent)
"""


def ingest(store: Path, docs: Path) -> str:
    """`wren kb ingest` as a user runs it; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.cli", "kb", "ingest", str(docs), "--tenant", TENANT,
         "--collection", "manuals", "--store", str(store), "--nice", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kb") / "knowledge.sqlite3"
    ingest(path, KIOSK / "manuals")
    return path


def grant(s: Stack, field: str, access: str) -> None:
    """A grant to the board's agent (the registry's, `thermostat`), as `wren grant add`
    writes it, and time for the running bridge to read the file again (it does at most
    every RECHECK_S)."""
    with Registry(s.registry_path) as reg:
        reg.add_grant(TENANT, AGENT, field, access)
    time.sleep(2 * RECHECK_S)


def events(s: Stack, snap: RunSnapshot, t: str) -> list[dict[str, Any]]:
    assert s.client is not None
    return [e["d"] for e in s.client.events if e["r"] == snap.run and e["t"] == t]


def test_before_the_bridge_adds_passages_after_the_system_prompt_and_cites_them(
    tmp_path: Path, store: Path
) -> None:
    with (
        ModelServer([Turn(text="Hold the reset button for five seconds [1].")]) as server,
        Stack(tmp_path, model_url=server.url, main_py=BEFORE,
              bridge_args=["--knowledge", str(store)]) as s,
    ):  # fmt: skip
        grant(s, "kb:manuals", READ)
        snap = s.ask("How do I reset the printer?")
        assert snap.status == "done", f"{snap.error}\n{s.describe()}"
        assert assistant_text(snap) == "Hold the reset button for five seconds [1]."
        (body,) = server.requests
        roles = [m["role"] for m in body["messages"]]
        # The system prompt first and as the board wrote it; the passages next, in a
        # user message marked as data; the question last.
        assert roles == ["system", "user", "user"], roles
        assert body["messages"][0]["content"] == INSTRUCTIONS
        assert "kiosk" in BEFORE and '"mode": "before"' in BEFORE
        passages = body["messages"][1]["content"]
        assert passages.startswith(RETRIEVED)
        assert "round reset button" in passages and "[1] printer.md" in passages
        assert body["messages"][2]["content"] == "How do I reset the printer?"
        cites = events(s, snap, "citation")
        assert cites and cites[0]["src"] == "printer.md" and cites[0]["n"] == 1
        assert cites[0]["col"] == "manuals" and len(cites[0]["ver"]) == 16
        assert isinstance(cites[0]["chunk"], int) and cites[0]["score"] > 0
        assert "Resetting the printer" in cites[0].get("h", "")
        # Each passage the call used, once, and the host renders them.
        assert len(cites) == passages.count("\n\n[") == 3
        assert [c["src"] for c in snap.citations] == [c["src"] for c in cites]
        assert any(line.startswith("source [1] printer.md") for line in render(snap))


def test_tool_mode_kb_search_answers_without_pausing_and_a_board_offloads_a_reading(
    tmp_path: Path, store: Path
) -> None:
    script = [
        # On the wire as OpenAI's names allow (the provider maps kb.search both ways).
        Turn(tool_calls=[ToolCall("kb_search", '{"query": "printer paper jam"}')]),
        Turn(text="Open the hatch with the green lever [1]."),
    ]
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url, main_py=TOOL,
              bridge_args=["--knowledge", str(store)]) as s,
    ):  # fmt: skip
        grant(s, "kb:manuals", READ)
        snap = s.ask("The printer is jammed, what do I do?")
        assert snap.status == "done", f"{snap.error}\n{s.describe()}"
        (call,) = events(s, snap, "tool.call")
        assert (call["name"], call["client"]) == ("kb.search", False)
        (result,) = events(s, snap, "tool.result")
        assert result["failed"] is False
        assert result["output"].startswith(RETRIEVED) and "green lever" in result["output"]
        assert not events(s, snap, "run.paused")
        cites = events(s, snap, "citation")
        assert [c["src"] for c in cites][:1] == ["printer.md"]
        # The model's second call carries the passages as the tool's result, marked.
        tool_msgs = [m for m in server.requests[1]["messages"] if m["role"] == "tool"]
        assert tool_msgs and tool_msgs[0]["content"].startswith(RETRIEVED)
        # kb.search is offered as a tool; nothing was added before the call.
        names = [t["function"]["name"] for t in server.requests[0]["tools"]]
        assert "kb_search" in names and "log_reading" in names
        assert not any(
            RETRIEVED in (m.get("content") or "") for m in server.requests[0]["messages"]
        )

        # The board offloads a reading: refused without a write grant, then stored.
        server.override_next(
            Turn(tool_calls=[ToolCall("log_reading", '{"text": "Printer head at 61 C"}')]),
            Turn(text="Noted."),
        )
        snap = s.ask("Log the printer head temperature.")
        (result,) = events(s, snap, "tool.result")
        assert result["failed"] is True and "forbidden" in result["output"], result
        grant(s, "kb:notes", WRITE)
        server.override_next(
            Turn(tool_calls=[ToolCall("log_reading", '{"text": "Printer head at 61 C"}')]),
            Turn(text="Noted."),
        )
        snap = s.ask("Log the printer head temperature.")
        (result,) = events(s, snap, "tool.result")
        assert (result["failed"], result["output"]) == (False, "new"), result
        with KnowledgeBase(store, embedder=None) as kb:
            hits = kb.retrieve(TENANT, "printer head temperature", collections=["notes"],
                               mode="keyword").hits  # fmt: skip
        assert hits and hits[0].source == f"{s.device}/reading-1"
        assert "61 C" in hits[0].text


def test_before_without_a_store_fails_the_run_by_name(tmp_path: Path) -> None:
    with (
        ModelServer([Turn(text="never asked")]) as server,
        Stack(tmp_path, model_url=server.url, main_py=BEFORE) as s,
    ):
        snap = s.ask("How do I reset the printer?")
        assert snap.status == "failed", s.describe()
        assert snap.error is not None and snap.error["kind"] == "kb", snap.error
        assert "no knowledge store" in snap.error["msg"]
        assert server.requests == []


def test_before_skip_without_a_store_answers_and_the_host_hears_why(tmp_path: Path) -> None:
    # The kiosk's agent with on_error "skip", on a bridge without --knowledge: the run
    # goes on without passages, and a `guard` event named "knowledge" tells the host.
    skip = BEFORE.replace('"k": 3}', '"k": 3, "on_error": "skip"}')
    assert skip != BEFORE
    with (
        ModelServer([Turn(text="I cannot see the manual; try the reset button.")]) as server,
        Stack(tmp_path, model_url=server.url, main_py=skip) as s,
    ):
        snap = s.ask("How do I reset the printer?")
        assert snap.status == "done", f"{snap.error}\n{s.describe()}"
        assert assistant_text(snap) == "I cannot see the manual; try the reset button."
        (guard,) = [g for g in events(s, snap, "guard") if g.get("name") == "knowledge"]
        assert guard["action"] == "noted", guard
        assert "no knowledge store" in guard["detail"], guard
        assert "answered without it" in guard["detail"], guard
        assert not events(s, snap, "citation")
        # The model was asked once, with the board's messages only.
        (body,) = server.requests
        assert [m["role"] for m in body["messages"]] == ["system", "user"]
        assert not any(RETRIEVED in (m.get("content") or "") for m in body["messages"])


# ---------------------------------------------------------------- the context rule


class _Count:
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, name: str, n: int) -> None:
        self.seen[name] = self.seen.get(name, 0) + n


@pytest.fixture
def rule(tmp_path: Path, store: Path) -> tuple[Registry, DeviceRecord, KnowledgeBase]:
    reg = Registry(tmp_path / "registry.json")
    reg.add_tenant(TENANT, "ab" * 32)
    reg.add_device("dev1", TENANT, "kiosk")
    reg.add_grant(TENANT, "kiosk", "kb:manuals", READ)
    device = reg.device("dev1")
    assert device is not None
    return reg, device, KnowledgeBase(store, embedder=None)


def _args() -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "You answer questions about the kiosk."},
            {"role": "user", "content": "How do I reset the printer?"},
        ],
        "tools": [{"name": "t", "description": "d", "args": {"type": "object"}}],
        "kb": {"collections": ["manuals"], "k": 3, "max_chars": 4000},
    }


def test_the_passages_get_what_the_calls_messages_leave_of_the_models_context(
    rule: tuple[Registry, DeviceRecord, KnowledgeBase],
) -> None:
    reg, device, kb = rule
    args = _args()
    base = context_chars(args["messages"], args["tools"])
    # The passages' message as it is with all the room it wants: its marking (the
    # first paragraph) and its first passage's label, the fixed costs of any passage.
    messages, cite = Augmenter(kb, reg, 32_000, _Count())(device, dict(args))
    header, first = messages[1]["content"].split("\n\n")[:2]
    header_cost = len(header) + 2  # and the blank line after it
    label, text = first.split("\n", 1)
    label_cost = len(label) + 1  # and the newline after it
    # The least room that takes a passage: MIN_ROOM after the marking, and the first
    # passage's label and MIN_ROOM characters of its text, or all of a shorter one (the
    # kiosk's are).
    edge = header_cost + max(MIN_ROOM, label_cost + min(len(text), MIN_ROOM))
    # The whole call (what the bridge counts, conversations/ included) within the
    # model's context at every room, right at the edges: the marking and the labels
    # are counted, not only the passages' text.
    for room in (
        0, MIN_ROOM - 1, MIN_ROOM, MIN_ROOM + 1, 300,
        header_cost, header_cost + label_cost, header_cost + label_cost + 1,
        edge - 1, edge, edge + 1, 1000, 1001, 3999, 4000, 4001,
    ):  # fmt: skip
        limit = base + room
        messages, cite = Augmenter(kb, reg, limit, _Count())(device, dict(args))
        used = context_chars(messages, args["tools"])
        assert used <= limit, (room, used - limit, cite)
        if room < edge:
            # No room for a passage: the call goes as the board sent it, and the note
            # says why.
            assert messages == args["messages"] and cite["cite"] == [], (room, cite)
            assert "no room" in cite["note"], (room, cite)
            continue
        # Room for one: it is there, marked, after the system prompt, and cited.
        assert [m["role"] for m in messages] == ["system", "user", "user"], room
        added = messages[1]["content"]
        assert added.startswith(RETRIEVED) and "\n\n[1] " in added, room
        assert cite["cite"] and len(cite["cite"]) == added.count("\n\n["), (room, cite)
        if room < 4000:  # the agent's max_chars
            assert "cut to" in cite["note"], cite
    # The agent's max_chars bounds the whole message the passages take.
    small = {**args, "kb": {**args["kb"], "max_chars": 600}}
    messages, cite = Augmenter(kb, reg, 32_000, _Count())(device, small)
    assert cite["cite"] and len(messages[1]["content"]) <= 600, cite


def test_long_passages_are_cut_to_the_room_left_with_their_labels_counted(
    tmp_path: Path, rule: tuple[Registry, DeviceRecord, KnowledgeBase]
) -> None:
    # The kiosk's passages are shorter than MIN_ROOM; a manual of long sections (chunks
    # of the default 1,000 characters) makes the rule cut. Every room from none to past
    # max_chars, in steps no label is a multiple of.
    reg, device, _ = rule
    para = "Hold the reset button of the printer for five seconds, then wait. " * 14
    doc = "".join(f"# Printer, part {i}\n\n{para}\n\n" for i in range(4))
    with KnowledgeBase(tmp_path / "long.sqlite3", embedder=None) as kb:
        kb.ingest(Records([Record("long.md", doc, ".md")]), tenant=TENANT, collection="manuals")
        args = _args()
        base = context_chars(args["messages"], args["tools"])
        seen = set()
        for room in range(0, 4200, 13):
            limit = base + room
            messages, cite = Augmenter(kb, reg, limit, _Count())(device, dict(args))
            assert context_chars(messages, args["tools"]) <= limit, room
            if not cite["cite"]:
                assert messages == args["messages"] and "no room" in cite["note"], cite
                continue
            blocks = messages[1]["content"].split("\n\n")[1:]
            texts = [b.split("\n", 1)[1] for b in blocks]
            assert len(texts) == len(cite["cite"]) and len(texts[0]) > 0
            # Every passage whole but the last, which keeps at least MIN_ROOM characters.
            assert all(len(t) > 900 for t in texts[:-1]), (room, [len(t) for t in texts])
            assert len(texts[-1]) >= MIN_ROOM, (room, len(texts[-1]))
            seen.add(len(texts))
        assert seen == {1, 2, 3}, seen  # k is 3: the sweep crossed every passage's edge


def test_the_agents_on_error_and_its_rights_decide_what_a_failure_is(
    rule: tuple[Registry, DeviceRecord, KnowledgeBase],
) -> None:
    reg, device, kb = rule
    count = _Count()
    args = _args()
    # No store: `fail` ends the call by name (retryable), `skip` goes on and says why.
    with pytest.raises(RpcError) as e:
        Augmenter(None, reg, 32_000, count)(device, dict(args))
    assert e.value.kind == "kb"
    skip = {**args, "kb": {**args["kb"], "on_error": "skip"}}
    messages, cite = Augmenter(None, reg, 32_000, count)(device, skip)
    assert messages == args["messages"] and "answered without it" in cite["note"]
    # A store that fails under the call (closed) is an outage too.
    broken = KnowledgeBase(kb.path, embedder=None)
    broken.close()
    messages, cite = Augmenter(broken, reg, 32_000, count)(device, skip)
    assert cite["cite"] == [] and "unavailable" in cite["note"]
    # A collection the agent may not read: refused whatever its on_error.
    other = {**skip, "kb": {**skip["kb"], "collections": ["secrets"]}}
    with pytest.raises(RpcError) as e:
        Augmenter(kb, reg, 32_000, count)(device, other)
    assert e.value.kind == "forbidden"
    bad = {**args, "kb": {"k": 0}}
    with pytest.raises(RpcError) as e:
        Augmenter(kb, reg, 32_000, count)(device, bad)
    assert e.value.kind == "bad_envelope"
