"""The greenhouse example's host: sends one request to the board, prints what a host
sees of the run as it happens (its nodes, the edge it took, tool calls, budgets), and
answers what the run waits for: the gardener's question and the valve's approval.

    python examples/greenhouse/host.py --broker 127.0.0.1:1883 --device greenhouse1

It asks on the terminal; `--yes` approves every call and `--answer TEXT` answers every
question without asking (what tests/test_example_greenhouse.py does). The session token
is signed with the tenant's secret from the registry, as `wren ask` does.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from server_bridge.host.client import HostClient
from server_bridge.host.reducer import RunSnapshot
from server_bridge.registry import Registry
from server_bridge.service import add_broker_arguments
from server_bridge.tokens import sign

REQUEST = "Water the greenhouse if it needs it."


def describe(event: dict[str, Any]) -> str | None:
    """One line for an event a dashboard would draw on the run's graph, else None."""
    t, d = event["t"], event["d"]
    where = f"{event.get('n')}#{event.get('a')}"
    if t == "node.start":
        return f"  > {where} ({d.get('kind') or 'node'})"
    if t == "node.end":
        port = f" -> {d['port']}" if d.get("port") else ""
        return f"  < {where} {d.get('status')}{port}"
    if t == "edge":
        return f"  edge {d.get('from')} --{d.get('port')}--> {d.get('to')}"
    if t == "usage":
        return f"    usage {where}: in {d.get('in')}, out {d.get('out')}"
    if t == "budget":
        return f"  budget {d.get('kind')}: {d.get('used')} of {d.get('limit')} ({d.get('level')})"
    if t == "tool.call":
        who = "the host" if d.get("client") else "the board"
        return f"    tool {d.get('name')} {d.get('input')} (answered by {who})"
    if t == "approval.request":
        return f"    {d.get('name')} waits for approval"
    if t in ("run.paused", "run.resumed", "run.done", "run.failed", "run.cancelled"):
        return f"{t} {d}"
    return None


def run_once(
    client: HostClient,
    device: str,
    token: str,
    text: str,
    decide: Callable[[str, str, str], tuple[bool, str]],
    out: TextIO,
    timeout: float = 60.0,
) -> RunSnapshot:
    """Send `text`, print the run's graph as it happens, answer every pending call with
    `decide(kind, name, input) -> (ok, answer)` (kind `approval` or `tool`), and return
    the run's final snapshot.

    `decide` is asked only once the run has paused, for every call it waits on, before
    any answer is sent: the run is quiet then, so a prompt on the terminal is not cut
    by the run's lines. A line that comes anyway is held until the answers are sent."""
    lock = threading.Lock()
    held: list[str] | None = None  # lines that came while `decide` asked

    def write(lines: list[str]) -> None:
        out.writelines(line + "\n" for line in lines)
        out.flush()

    def show(event: dict[str, Any], _snap: RunSnapshot) -> None:
        # On the client's network thread: never blocked on a person.
        line = describe(event)
        if line is None:
            return
        with lock:
            if held is not None:
                held.append(line)
            else:
                write([line])

    client.on_event = show
    req = client.request(device, token, text)
    answered: set[str] = set()
    while True:
        snap = client.wait_for(
            req,
            lambda s: s.terminal or (s.status == "paused" and bool(set(s.pending) - answered)),
            timeout,
        )
        if snap.terminal:
            return snap
        with lock:
            held = []
        calls = [(call, row) for call, row in snap.pending.items() if call not in answered]
        decided = []
        for call, row in calls:
            kind = "approval" if row.status == "approval" else "tool"
            decided.append((call, kind, decide(kind, row.name or "?", row.input or "{}")))
        for call, kind, (ok, answer) in decided:
            answered.add(call)
            if kind == "approval":
                client.approve(device, token, snap.run, call, ok)
            else:
                client.answer(device, token, snap.run, call, answer)
        with lock:
            write(held)
            held = None


def answer_text(snap: RunSnapshot) -> str:
    """The run's answer: its assistant messages, a blank line between two."""
    texts = (r.text.strip() for r in snap.rows if r.kind == "assistant")
    return "\n\n".join(t for t in texts if t)


def ask_terminal(yes: bool, answer: str | None) -> Callable[[str, str, str], tuple[bool, str]]:
    def decide(kind: str, name: str, args: str) -> tuple[bool, str]:
        if kind == "approval":
            if yes:
                return True, ""
            return input(f"approve {name} {args}? [y/N] ").strip().lower() == "y", ""
        if answer is not None:
            return True, answer
        return True, input(f"{name} {args}: ")

    return decide


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_broker_arguments(p, "WREN_HOST_USER", "WREN_HOST_PASSWORD")
    p.add_argument("--registry", type=Path, default=Path(".wren/registry.json"))
    p.add_argument("--tenant", default="demo")
    p.add_argument("--device", default="greenhouse1")
    p.add_argument("--user-id", default="gardener-1", help="the end user the token names")
    p.add_argument("--yes", action="store_true", help="approve every call without asking")
    p.add_argument("--answer", help="answer every question with this, without asking")
    p.add_argument("text", nargs="?", default=REQUEST)
    args = p.parse_args(argv)
    host, port = args.broker or ("127.0.0.1", 1883)
    secret = Registry(args.registry).tenant_secret(args.tenant)
    if secret is None:
        print(f"tenant {args.tenant!r} is not in {args.registry}", file=sys.stderr)
        return 1
    token = sign(bytes.fromhex(secret), args.tenant, args.user_id)
    # Given the token, the client reads the device's topic and this user's alone: the
    # runs of other users of the tenant are not its to see (PROTOCOL.md "Who sees what").
    client = HostClient(
        host, port, args.tenant, username=args.user, password=args.password, token=token
    )
    client.connect(timeout=10)
    try:
        snap = run_once(
            client, args.device, token, args.text, ask_terminal(args.yes, args.answer), sys.stdout
        )
    finally:
        client.close()
    print(answer_text(snap))
    graph = (f"{n.path} x{n.activations} {n.status}" for n in snap.nodes.values())
    print("nodes: " + ", ".join(graph))
    return 0 if snap.status == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
