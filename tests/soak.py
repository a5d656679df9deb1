"""The soak (issue 24, "The board never wedges"): a realistic memory agent served
request after request on real processes, faults mixed in, and a record of the board's
heap after every run. tests/test_board_soak.py asserts on it, benchmarks/bench_soak.py
prints its figures.

    with Soak() as soak:
        records = soak.run(1000)

What runs: tests/stack.py's Stack (Mosquitto, `wren bridge` with its memory, the board
as .mpy on the MicroPython unix port at 128K, a host client), with
- **the agent** (`AGENT_PY`, the board's main.py): the issue's four declared fields, a
  user slot (`nickname`), a user `sum` slot (`visits`), a user collection (`notes`) and
  a tenant collection (`house_notes`, granted to the agent in the bridge's registry as
  an operator grants it), and one local tool;
- **the model**: the OpenAI-compatible test server (tests/model_server.py), answering
  request k by a plan made from k alone (`plan`): a long answer (1,000-2,000 characters
  in 3-6-character chunks, hundreds of them), every fifth request a memory tool call
  first and every seventh the local tool, arguments in 3-character pieces. The bridge
  sends each chunk on as it comes (`--merge-ms 0`): a hosted model's tokens come slower
  than the bridge's merge time, so a board meets an answer as hundreds of small chunks;
  at the test server's full speed the bridge would merge them into a few;
- **a relay** (`Relay`): the board reaches the broker only through a TCP relay in this
  process (loopback), so the board's link can be cut mid-run with nothing else touched.

Faults, by request number (`plan`): one request in ten has its model stream cut
mid-answer (the server closes the connection half way through the answer's events);
one in twenty has the board's link cut mid-run (the answer pauses after its first
words, and the relay closes both ends of the board's connection once the host has seen
them). `Soak.run(n, force=...)` can also force a MemoryError (`BALLAST_PY`).

Per request (`RunRecord`): how it ended at the host (done with the exact text, failed
with its kind, refused by its req id, or lost), and from the board's console the free
heap after its run (the runtime's own `run <id> ended; heap free N` line), the largest
free block and the interned names right after it (`PROBE_PY`), every MemoryError the
console reported with its place (`memory_errors`), and whether the board reset itself.

The Stack's directory is a short one of its own (`/tmp/wren-soak-XXXXXXXX`), not a
test's tmp_path: the board interns the path of every module it loads, so a longer
directory is heap the board loses (pytest's are about 30 characters longer, for each of
the 20-odd modules a run loads: most of a KiB).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from server_bridge.host.client import RequestRefused
from server_bridge.host.reducer import RunSnapshot
from server_bridge.registry import Registry
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import TENANT, Stack, StackError, assistant_text
from tools.demo import AGENT
from tools.virtual_board import gc_block_bytes

__all__ = [
    "AGENT_PY",
    "BALLAST_PY",
    "PROBE_PY",
    "Fault",
    "MemoryErrorLine",
    "Plan",
    "Relay",
    "RunRecord",
    "Soak",
    "gc_block",
    "main_py",
    "memory_errors",
    "plan",
]

# --------------------------------------------------------------------------- the board

# The board's main.py: the agent as an app writes it (compiled on the board, as
# any main.py is), four declared fields and one local tool. The name is the one the
# Stack registers the device's agent under, so the tenant grant below is the agent's.
AGENT_PY = """\
from edge_runtime import board
from edge_runtime.agent import Agent
from edge_runtime.fields import Field

agent = Agent("thermostat", "0.1.0",
              "You are the assistant of a room thermostat. Remember what users tell you "
              "about themselves and the house, and answer at length.", fields=[
    Field("nickname", vis="public", dur="user"),
    Field("visits", vis="public", dur="user", merge="sum", fmt="number"),
    Field("notes", vis="public", dur="user", kind="collection", key="topic"),
    Field("house_notes", vis="public", dur="tenant", kind="collection", key="topic"),
])


@agent.tool("read_temperature", "Read the room temperature in degrees Celsius")
def read_temperature(args):
    return 21.5


"""
# The soak's probe, kept out of edge_runtime/: main.py code after the agent. After each
# run's "ended; heap free" line it calls micropython.mem_info() (its "max free sz" is
# the largest free block, in GC blocks) and micropython.qstr_info(): both print without
# allocating. Every name and short literal in it is one the board interns anyway (a
# builtin's, or the runtime's: `held`, `emit`, `args`; a literal is interned only up to
# 10 characters), which test_board_soak checks: after a run the four-field agent's board
# holds 586-603 names of the 620 its qstr pools have room for (64-bit unix port; the next
# pool is 640 entries, about 7 KiB at once). When it held 616, a probe with 8 names of
# its own made every run fail there, in the import of memstart.
PROBE_PY = """\
import gc, micropython
from edge_runtime import platform, runs

held = []
emit = platform.log


def log(*args):
    emit(*args)
    if held:
        held.clear()
        gc.collect()
        emit("soak: ballast let go; heap free", gc.mem_free())
    if len(args) > 2 and args[2] == "ended; heap free":
        micropython.mem_info()
        micropython.qstr_info()


platform.log = log
"""
# The ballast, for a forced MemoryError (after PROBE_PY, whose `held` it fills): a
# request whose text starts "[soak ballast NNNNN]" finds the board's heap full but for
# about NNNNN bytes, taken before the runtime reads the request, in pieces of 1 KiB and
# then of 64 bytes for the smaller holes, each for as long as a block of its size is
# free (the ballast itself must not raise). It is let go at the board's next log line:
# the run failed or ended, the request was refused, or the link could not hand it over.
BALLAST_MARK = "[soak ballast "
BALLAST_PY = f"""\
_on_req = runs.Runtime._on_req


def fault(self, msg):
    text = msg.get("input")
    if isinstance(text, str) and text.startswith("{BALLAST_MARK}"):
        limit = int(text[{len(BALLAST_MARK)}:{len(BALLAST_MARK) + 5}])
        gc.collect()
        try:
            while gc.mem_free() > limit + 2048:
                held.append(bytearray(1024))
        except MemoryError:
            pass
        try:
            while gc.mem_free() > limit + 64:
                held.append(bytearray(64))
        except MemoryError:
            pass
        emit("soak: ballast held; heap free", gc.mem_free())
    _on_req(self, msg)


runs.Runtime._on_req = fault
"""
START_PY = "board.start(agent)\n"


def main_py(probe: bool = True, ballast: bool = True) -> str:
    """The board's main.py: the agent, with the probe and the ballast if asked."""
    return AGENT_PY + (PROBE_PY if probe else "") + (BALLAST_PY if ballast else "") + START_PY


def gc_block(exe: str) -> int:
    """Bytes per GC block of a MicroPython binary (tools/virtual_board.py)."""
    return gc_block_bytes(exe)


# The four fields and the local tool, as AGENT_PY declares them.
NICKNAME = "nickname"
VISITS = "visits"
NOTES = "notes"
HOUSE_NOTES = "house_notes"
LOCAL_TOOL = "read_temperature"

# The console lines read (edge_runtime/runs.py and platform.py, PROBE_PY, tests/stack.py).
_ENDED = re.compile(r"^wren: run (\S+) ended; heap free (\d+)$")
# The runtime's heap line once idle, collected and with nothing in flight (runs.py
# _check_heap): the level a leak or fragmentation would move.
_IDLE = re.compile(r"^wren: idle; heap free (\d+)$")
# How long after a run's end the idle line may take: the runtime waits up to 2 s for
# the link to let go of the run's last events (runs.py _DRAIN_MS).
IDLE_TIMEOUT_S = 3.0
_MAX_FREE = re.compile(r"max free sz: (\d+)")
_QSTRS = re.compile(r"^qstr pool: n_pool=(\d+), n_qstr=(\d+)")
# A board that reset itself: its own last line (edge_runtime/presence.py; older
# runtimes said "reset:"), and the Stack's as it starts it again.
_RESET = re.compile(r"^wren: (the board resets|reset):|^\[stack\] the board reset itself")
_RESTARTED = re.compile(r"^\[stack\] the board reset itself")
_LINK_UP = re.compile(r"^wren: link: up ")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
# A line that says the board ran out of memory: a traceback's last line, a log line
# naming MemoryError, a refusal or a failure for want of heap.
_OUT_OF_MEMORY = re.compile(r"MemoryError|out of memory|no free heap|no heap|no_memory")
# The runtime's line before the traceback of a run that ran out of memory: the
# traceback is the report.
_ANNOUNCED = re.compile(r"^wren: run \S+ ran out of memory$")
_ALLOCATING = re.compile(r"allocating (\d+) bytes")

# How long one request may take to end before it counts as lost: a run whose link was
# cut waits out the board's reconnect (a quarter second) and the broker's redelivery.
RUN_TIMEOUT_S = 60.0
# The least time from one request to the next (Soak.one).
MIN_GAP_S = 0.05
# How long the board has to print its end of a run once the host has seen the run end
# (it collects twice first), and a board that reset itself to be up again.
ENDED_TIMEOUT_S = 10.0
START_TIMEOUT_S = 30.0

# The fault schedule, by request number k = 1, 2, ...: the answer's stream cut when
# k % 10 == 9; the link cut when k % 20 == 4, in a pause of the answer after its first
# words.
STREAM_CUT_EVERY, STREAM_CUT_AT = 10, 9
LINK_CUT_EVERY, LINK_CUT_AT = 20, 4
LINK_CUT_PAUSE_S = 0.3
MEMORY_TOOL_EVERY = 5
LOCAL_TOOL_EVERY = 7
# Refusals of a request that asking again later can cure (PROTOCOL "Errors"): the board
# or the bridge busy, short of heap, offline or stopping.
RETRYABLE_REFUSALS = ("busy", "rate_limited", "no_memory", "device_offline", "bridge_stopping")


class Fault:
    """What the harness does to a request (plain names: they print as they are)."""

    NONE = ""
    STREAM_CUT = "stream_cut"
    LINK_CUT = "link_cut"
    FORCED = "forced_memory_error"


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """What the model answers request k, and the fault it gets."""

    number: int
    turns: tuple[Turn, ...]
    fault: str
    text: str  # the assistant text of the run done: each turn's, in order
    tools: tuple[str, ...]  # the tools the model calls


_WORDS = (
    "the room holds its warmth well through the evening and the radiator under the "
    "window takes a while to respond so a small change now shows in about twenty "
    "minutes while the hallway stays a degree cooler than the living room because the "
    "door to the stairs is often open and the thermostat reads the air near the shelf"
).split()


def _answer(rng: random.Random, k: int) -> str:
    """A long answer (1,000-2,000 characters) that names its request, so an answer that
    reached another request, or lost or doubled a piece, does not compare equal."""
    size = rng.randint(1000, 2000)
    words = [f"Answer {k}:"]
    n = len(words[0])
    while n < size:
        words.append(rng.choice(_WORDS))
        n += len(words[-1]) + 1
    return " ".join(words)[:size]


def _memory_call(k: int) -> ToolCall:
    """The memory tool call of request k, in turn: each field written, read back and
    searched."""
    note = {"topic": f"topic{k % 7}", "text": f"note {k}: likes 21 degrees at night"}
    house = {"topic": f"room{k % 5}", "text": f"house note {k}: the hall is cold"}
    ops: list[tuple[str, dict[str, Any]]] = [
        ("memory.remember", {"field": VISITS, "value": k}),
        ("memory.remember", {"field": NICKNAME, "value": f"Al {k}"}),
        ("memory.remember", {"field": NOTES, "key": note["topic"], "value": note}),
        ("memory.recall", {"query": "degrees at night", "field": NOTES}),
        ("memory.remember", {"field": HOUSE_NOTES, "key": house["topic"], "value": house}),
        ("memory.recall", {"query": "hall cold", "field": HOUSE_NOTES}),
        ("memory.list", {"field": NOTES, "limit": 5}),
        ("memory.load", {"field": NICKNAME}),
    ]
    name, args = ops[(k // MEMORY_TOOL_EVERY) % len(ops)]
    return ToolCall(name, json.dumps(args))


def plan(k: int, forced: bool = False) -> Plan:
    """Request k's model turns and fault, from k alone (the same k, the same plan)."""
    rng = random.Random(k)
    answer = _answer(rng, k)
    chunk = rng.randint(3, 6)
    fault = Fault.NONE
    if forced:
        fault = Fault.FORCED
    elif k % STREAM_CUT_EVERY == STREAM_CUT_AT:
        fault = Fault.STREAM_CUT
    elif k % LINK_CUT_EVERY == LINK_CUT_AT:
        fault = Fault.LINK_CUT
    calls: list[ToolCall] = []
    if k % MEMORY_TOOL_EVERY == 0:
        calls.append(_memory_call(k))
    if k % LOCAL_TOOL_EVERY == 0:
        calls.append(ToolCall(LOCAL_TOOL, "{}"))
    turns: list[Turn] = []
    text = ""
    if calls:
        text = f"Let me look into that for request {k}. "
        turns.append(Turn(text=text, chunk_chars=chunk, tool_calls=calls, args_chunk_chars=3))
    # The answer's SSE events: the role chunk, one per piece of text, the finish, [DONE].
    events = 1 + -(-len(answer) // chunk) + 2
    turns.append(
        Turn(
            text=answer,
            chunk_chars=chunk,
            drop_after=events // 2 if fault == Fault.STREAM_CUT else None,
            rest_after_s=LINK_CUT_PAUSE_S if fault == Fault.LINK_CUT else 0.0,
        )
    )
    return Plan(k, tuple(turns), fault, text + answer, tuple(c.name for c in calls))


def request_text(k: int, leave: int | None = None) -> str:
    """Request k's text; a forced one starts with the ballast's mark and size."""
    head = f"{BALLAST_MARK}{leave:05d}] " if leave is not None else ""
    return f"{head}Request {k}: how warm is it, and what do you remember?"


# --------------------------------------------------------------------------- the relay


class Relay:
    """A TCP relay on loopback between the board and the broker: each connection
    accepted is joined to a new one to `target()`, and two threads pass its bytes on as
    they come, one each way. `cut()` shuts both ends of every connection it holds: the
    board reads the end of its stream, the broker sees its client gone without a
    DISCONNECT (and publishes its will). Later connections are relayed as before."""

    def __init__(self, target: Callable[[], tuple[str, int]]) -> None:
        # Asked at each accept: the broker's port may be known only once it has started.
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closed = False
        self.cuts = 0  # connections cut
        self._thread = threading.Thread(target=self._accept, name="soak-relay", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def cut(self) -> int:
        """Shut every connection the relay holds; how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self.cuts += len(pairs)
        for pair in pairs:
            for s in pair:
                _shut(s)
        return len(pairs)

    def close(self) -> None:
        self._closed = True
        _shut(self._listener)
        self._listener.close()
        self.cut()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                board, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                broker = socket.create_connection(self.target(), timeout=5)
            except OSError:
                board.close()
                continue
            broker.settimeout(None)
            for s in (board, broker):
                # Each message leaves when written, as from the parts themselves.
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (board, broker)
            with self._lock:
                self._pairs.append(pair)
            for a, b in (pair, pair[::-1]):
                args = (a, b, pair)
                threading.Thread(
                    target=self._pump, args=args, name="soak-pump", daemon=True
                ).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        """Bytes from src to dst until either end is shut; then both are, and the pair is
        no longer the relay's to cut."""
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(src)
            _shut(dst)
            with self._lock:
                if pair in self._pairs:
                    self._pairs.remove(pair)
            src.close()


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or shut already


def _console_index(s: Stack, pattern: re.Pattern[str], after: int, deadline: float) -> int | None:
    """The index of the first console line at `after` or later that matches `pattern`,
    waiting for one until `deadline`; None past it. Not Stack.wait_console, which ends at
    once while the board is down between its reset and its start again."""
    while True:
        lines = s.console
        for i in range(after, len(lines)):
            if pattern.search(lines[i]):
                return i
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class MemoryErrorLine:
    """A MemoryError the board's console reported, and where: a traceback's innermost
    frame (`module:line in function`), or the words of the log line that said it."""

    line: str
    place: str
    size: int | None = None  # the allocation that failed, when the line says
    trace: str = ""  # a traceback's frames, outermost first


@dataclass
class RunRecord:
    """One request of the soak, as the host and the board's console saw it."""

    number: int
    req: str
    fault: str
    # done, failed, cancelled, refused (refused by its req id, by the board or the
    # bridge) or lost (no end within RUN_TIMEOUT_S).
    status: str
    run: str | None = None
    kind: str | None = None  # the failure's or the refusal's kind
    msg: str | None = None
    cause: str | None = None
    retryable: bool | None = None
    refused_req: str | None = None  # the req id a refusal named
    text_ok: bool | None = None  # done: the answer arrived exactly
    tools_ok: bool | None = None  # done: each tool the model called ran, none failed
    heap_free: int | None = None  # bytes, the run's "ended; heap free" line
    idle_free: int | None = None  # bytes, the "idle; heap free" line after it
    largest_free: int | None = None  # bytes, mem_info's max free sz right after it
    qstrs: int | None = None  # interned names after the run (qstr_info's n_qstr)
    qstr_pools: int | None = None
    sent_at: float = 0.0  # time.monotonic() as the request was sent
    ended_at: float = 0.0  # ... and as its end reached the host (or the wait gave up)
    links_cut: int = 0  # connections the relay cut during this request
    cut_while_running: bool | None = None  # a link cut: the run had not ended yet
    resets: list[str] = field(default_factory=list)  # lines saying the board reset itself
    memory_errors: list[MemoryErrorLine] = field(default_factory=list)
    console: list[str] = field(default_factory=list)  # the board's lines meanwhile

    @property
    def seconds(self) -> float:
        """Request sent -> its end at the host."""
        return self.ended_at - self.sent_at

    @property
    def boot(self) -> str | None:
        """The board boot that ran it: a run id is `<boot>.<n>`."""
        return self.run.split(".")[0] if self.run else None

    @property
    def named_and_retryable(self) -> bool:
        """Done; or failed with a kind and `retryable`; or refused, by its own req id,
        for a reason asking again can cure."""
        if self.status == "done":
            return True
        if self.status == "refused":
            return self.refused_req == self.req and self.kind in RETRYABLE_REFUSALS
        return self.status == "failed" and bool(self.kind) and self.retryable is True


def memory_errors(lines: Sequence[str]) -> list[MemoryErrorLine]:
    """Each MemoryError the console lines report, with its place. A traceback (the
    runtime prints one for a run that ran out of memory, after a line saying so) is one,
    placed at its innermost frame; a log line that names a MemoryError, or says there
    was no heap for something, is one, placed by its words with numbers, addresses and
    run ids left out."""
    found = []
    frames: list[str] = []
    for line in lines:
        frame = _FRAME.match(line)
        if line.startswith("Traceback"):
            frames = []
        elif frame:
            frames.append(f"{frame.group(1)}:{frame.group(2)} in {frame.group(3)}")
        elif line.startswith("MemoryError"):
            place = frames[-1] if frames else "(no traceback)"
            found.append(MemoryErrorLine(line.strip(), place, _size(line), " > ".join(frames)))
            frames = []
        elif _OUT_OF_MEMORY.search(line) and not _ANNOUNCED.search(line):
            found.append(MemoryErrorLine(line.strip(), _place(line), _size(line)))
    return found


def _size(line: str) -> int | None:
    m = _ALLOCATING.search(line)
    return int(m.group(1)) if m else None


def _place(line: str) -> str:
    text = line.removeprefix("wren: ").split("MemoryError", 1)[0]
    text = re.sub(r"\d+\.\d+\.\d+\.\d+:\d+|\b[0-9a-f]{8}\.\d+\b|\d+", "N", text)
    return text.rstrip(" :(") or line.strip()


# --------------------------------------------------------------------------- the soak


class Soak:
    """The model server, the relay and the stack; `run(n)`. A context manager."""

    def __init__(
        self,
        *,
        heap: str = "128K",
        micropython: str | None = None,
        bridge_args: Sequence[str] = (),
        probe: bool = True,
        ballast: bool = True,
        runtime: str = "flash",
    ) -> None:
        self.heap = heap
        # Where the board holds the runtime (tests/stack.py RUNTIMES): "frozen" for a
        # binary that has it frozen in, whose flash must not hold a copy.
        self.runtime = runtime
        self.micropython = micropython
        self.bridge_args = ["--merge-ms", "0", *bridge_args]
        # Without the probe the board runs the agent alone and each run's own heap line
        # is all there is: what the probe costs is the difference. Without the ballast
        # no request can be forced.
        self.probe = probe
        self.ballast = ballast and probe
        self.workdir = Path(tempfile.mkdtemp(prefix="wren-soak-"))
        self.model = ModelServer()
        self.relay: Relay | None = None
        self.stack: Stack | None = None
        self.block = 0  # bytes per GC block of the board's binary
        self.records: list[RunRecord] = []
        self._next = 1

    def __enter__(self) -> Soak:
        try:
            self.model.start()
            self._start()
        except BaseException:
            self.close(quiet=True)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(quiet=exc is not None)

    def _start(self) -> None:
        # The board's settings name the relay; the relay asks the stack for the broker's
        # port when the board first connects, once the stack has started the broker.
        self.relay = Relay(lambda: (stack.host, stack.port))
        stack = Stack(
            self.workdir,
            model_url=self.model.url,
            heap=self.heap,
            micropython=self.micropython,
            main_py=main_py(self.probe, self.ballast),
            runtime=self.runtime,
            bridge_args=self.bridge_args,
            board_settings={"port": self.relay.port},
        )
        self.stack = stack
        stack.start()
        assert stack.board is not None
        self.block = gc_block(stack.board.command()[0])
        # The tenant collection is shared: the agent reaches it only with a grant, made
        # as an operator makes one, in the registry the running bridge reads (again
        # within its RECHECK_S, long before the first memory call).
        with Registry(stack.registry_path) as registry:
            registry.add_grant(TENANT, AGENT, HOUSE_NOTES)

    def close(self, quiet: bool = False) -> None:
        try:
            if self.stack is not None:
                self.stack.close(quiet=quiet)
        finally:
            if self.relay is not None:
                self.relay.close()
            self.model.close()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def run(self, n: int, force: Mapping[int, int] | None = None) -> list[RunRecord]:
        """The next `n` requests, one after another: each is sent once the one before
        has ended at the host and the board has printed its end of it. `force` maps a
        request number to the free bytes the board's ballast leaves it."""
        out = []
        for _ in range(n):
            k = self._next
            self._next += 1
            out.append(self.one(k, (force or {}).get(k)))
            self.records.append(out[-1])
            board = self.stack.board if self.stack is not None else None
            if board is not None and board.proc is not None and board.proc.poll() is not None:
                # Dead and not started again (_wait waited for that): nothing more to
                # learn from the requests left.
                assert self.stack is not None
                raise StackError(
                    f"board: exited with code {board.proc.returncode} by request {k} and "
                    f"was not started again\n{self.stack.describe()}"
                )
        return out

    def one(self, k: int, leave: int | None = None) -> RunRecord:
        """Request k, start to end (`leave`: forced, with that much heap left)."""
        s = self.stack
        assert s is not None and s.client is not None and self.relay is not None
        if leave is not None and not self.ballast:
            raise ValueError("a forced request needs the ballast (Soak(ballast=True))")
        p = plan(k, forced=leave is not None)
        # The model answers this request's calls by its plan (the server picks a turn by
        # how many answers the conversation holds). Requests go one at a time, and a
        # call a board sends again after a cut is one the bridge has seen already.
        self.model.script = list(p.turns)
        mark = s.console_mark()
        # A user's pace at the fastest: requests refused at once (a board the bridge
        # holds offline) would otherwise follow each other within a millisecond, past
        # the tenant's request rate at the bridge (BridgeConfig.host_rate, 50 a second).
        if self.records:
            time.sleep(max(0.0, self.records[-1].sent_at + MIN_GAP_S - time.monotonic()))
        sent = time.monotonic()
        req = s.request(request_text(k, leave))
        rec = RunRecord(k, req, p.fault, "lost", sent_at=sent)
        snap: RunSnapshot | None = None
        deadline = sent + RUN_TIMEOUT_S
        try:
            if p.fault == Fault.LINK_CUT:
                # Mid-run: once the host has seen the answer's first words, in the pause
                # the model makes after them. A run that ended before (it failed) has
                # its link cut all the same, between it and the next request.
                seen = s.client.wait_for(
                    req, lambda r: r.terminal or bool(assistant_text(r)), RUN_TIMEOUT_S
                )
                rec.cut_while_running = not seen.terminal
                rec.links_cut = self.relay.cut()
            snap = self._wait(req, deadline)
        except RequestRefused as e:
            rec.status, rec.kind, rec.msg, rec.refused_req = "refused", e.kind, e.msg, e.req
        except (StackError, TimeoutError) as e:
            rec.msg = str(e).splitlines()[0]
        rec.ended_at = time.monotonic()
        if snap is not None:
            rec.status, rec.run, rec.retryable = snap.status, snap.run, snap.retryable
            if snap.error:
                rec.kind = snap.error.get("kind")
                rec.msg = snap.error.get("msg")
                rec.cause = snap.error.get("cause")
            if snap.status == "done":
                rec.text_ok = assistant_text(snap) == p.text
                results = [r for r in snap.rows if r.kind == "tool_result"]
                rec.tools_ok = len(results) == len(p.tools) and not any(r.failed for r in results)
            self._settle(snap.run, mark)
        lines = s.console[mark:]
        self._read_heap(rec, lines)
        rec.memory_errors = memory_errors(lines)
        rec.resets = [line for line in lines if _RESET.search(line)]
        rec.console = lines
        return rec

    def _wait(self, req: str, deadline: float) -> RunSnapshot:
        """The run of `req` once it has ended (Stack.wait_run: a part that died ends the
        wait). A board that reset itself is not one of those: the Stack starts it again,
        and the run ends as the bridge ends a run its board's restart cut off."""
        s = self.stack
        assert s is not None
        while True:
            resets = s.board_resets
            try:
                return s.wait_run(req, max(0.0, deadline - time.monotonic()))
            except StackError:
                if s.board_resets != resets:
                    continue  # started again already
                board = s.board
                if board is None or board.proc is None or board.proc.poll() is None:
                    raise  # the run's time ran out, or another part died
                # The board is down: until the Stack has started it again (bounded).
                up = time.monotonic() + START_TIMEOUT_S
                while s.board_resets == resets and time.monotonic() < up:
                    time.sleep(0.02)
                if s.board_resets == resets:
                    raise

    def _settle(self, run: str, mark: int) -> None:
        """Wait for the board's own end of `run` on its console (after line `mark`): its
        "ended; heap free" line and the probe's lines behind it; or, for a board that
        reset itself, its link up again. Bounded: a board that says neither shows it in
        the record's console."""
        s = self.stack
        assert s is not None
        ended = f"wren: run {run} ended;"
        deadline = time.monotonic() + ENDED_TIMEOUT_S
        while time.monotonic() < deadline:
            lines = s.console[mark:]
            for i, line in enumerate(lines):
                if line.startswith(ended):
                    if not self.probe or any(_QSTRS.match(x) for x in lines[i + 1 :]):
                        # And its idle line, which a request sent at once would forestall
                        # (a board with a run never says it).
                        _console_index(s, _IDLE, mark + i, time.monotonic() + IDLE_TIMEOUT_S)
                        return
                elif _RESET.search(line):
                    # Started again by the Stack, and connected.
                    up = time.monotonic() + START_TIMEOUT_S
                    at = _console_index(s, _RESTARTED, mark + i, up)
                    if at is not None:
                        _console_index(s, _LINK_UP, at, up)
                    return
            time.sleep(0.01)

    def _read_heap(self, rec: RunRecord, lines: list[str]) -> None:
        for i, line in enumerate(lines):
            m = _ENDED.match(line)
            if m and m.group(1) == rec.run:
                rec.heap_free = int(m.group(2))
                for after in lines[i + 1 :]:
                    idle = _IDLE.match(after)
                    if idle:
                        rec.idle_free = int(idle.group(1))
                        break
                for after in lines[i + 1 : i + 8]:
                    f = _MAX_FREE.search(after)
                    if f:
                        rec.largest_free = int(f.group(1)) * self.block
                    q = _QSTRS.match(after)
                    if q:
                        rec.qstr_pools, rec.qstrs = int(q.group(1)), int(q.group(2))
                        return
                return
