"""A follow-up in a conversation gives the model the earlier turns (issue "Hosts over
HTTP"; server_bridge/conversations/). The rule at its limits on a real EventLog, then
end to end: the bridge process, Mosquitto, the demo thermostat on the MicroPython unix
port and an OpenAI-compatible model server that records what the model was sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server_bridge.conversations import History, Turns, turn_chars
from server_bridge.eventlog import EventLog
from server_bridge.knowledge.augment import context_chars
from server_bridge.registry import DeviceRecord, Registry
from server_bridge.tokens import sign
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import TENANT, Stack


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You are a thermostat."}


@pytest.fixture
def turns(tmp_path: Path) -> Any:
    log = EventLog(tmp_path / "turns")
    yield Turns(log, max_turns=3, max_chars=1000)
    log.close()


def record(turns: Turns, run: str, question: str, answer: str, usr: str = "alice",
           conv: str = "c1", device: str = "dev1") -> None:  # fmt: skip
    turns.record("acme", device, run, usr, conv, [SYSTEM, user(question)], said(answer))


def texts(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages]


def test_the_latest_turns_that_fit_go_in_oldest_first_whole_and_marked(turns: Turns) -> None:
    for k in range(1, 6):
        record(turns, f"r{k}", f"question {k}", f"answer {k}")
    got = turns.earlier("acme", "dev1", "alice", "c1", "r6", room=10_000)
    # max_turns 3: the last three, in the order they happened; no system message.
    assert texts(got) == ["question 3", "answer 3", "question 4", "answer 4",
                          "question 5", "answer 5"]  # fmt: skip
    assert all(m["hist"] is True for m in got)
    # The run itself is never its own history.
    assert texts(turns.earlier("acme", "dev1", "alice", "c1", "r5", room=10_000))[-1] == "answer 4"


def test_characters_at_the_limit(turns: Turns) -> None:
    record(turns, "r1", "a" * 100, "b" * 100)  # 200 characters
    record(turns, "r2", "c" * 300, "d" * 300)  # 600 characters
    # Exactly the room both need: both. One character less: the older turn goes whole,
    # never a half of it.
    both = turns.earlier("acme", "dev1", "alice", "c1", "r3", room=800)
    assert turn_chars(both) == 800 and len(both) == 4
    one = turns.earlier("acme", "dev1", "alice", "c1", "r3", room=799)
    assert texts(one) == ["c" * 300, "d" * 300]
    # The newest turn alone over the room: none (an older one would leave a hole).
    assert turns.earlier("acme", "dev1", "alice", "c1", "r3", room=599) == []
    # max_chars bounds it whatever the room: 1000 here.
    record(turns, "r3", "e" * 250, "f" * 250)  # 500
    capped = turns.earlier("acme", "dev1", "alice", "c1", "r4", room=10_000)
    assert texts(capped) == ["e" * 250, "f" * 250]  # 500 + 600 would be 1,100


def test_a_turn_keeps_its_tool_call_with_its_result_and_the_latest_record_wins(
    turns: Turns,
) -> None:
    call = {"call": "c1", "name": "read_temperature", "input": "{}"}
    first = [SYSTEM, user("How warm is it?")]
    turns.record("acme", "dev1", "r1", "alice", "c1", first,
                 {"role": "assistant", "content": "", "tools": [call]})  # fmt: skip
    second = first + [
        {"role": "assistant", "content": "", "tools": [call]},
        {"role": "tool", "call": "c1", "content": "21.5"},
    ]
    turns.record("acme", "dev1", "r1", "alice", "c1", second, said("It is 21.5 C."))
    got = turns.earlier("acme", "dev1", "alice", "c1", "r2", room=10_000)
    assert [m["role"] for m in got] == ["user", "assistant", "tool", "assistant"]
    assert got[1]["tools"] == [call] and got[2]["call"] == "c1"
    assert got[3]["content"] == "It is 21.5 C."


def test_another_users_or_devices_runs_with_the_same_conversation_id_are_not_history(
    turns: Turns,
) -> None:
    record(turns, "r1", "alice's secret", "noted", usr="alice")
    record(turns, "r2", "bob asks", "bob hears", usr="bob")
    record(turns, "r3", "on another device", "there", device="dev2")
    assert texts(turns.earlier("acme", "dev1", "bob", "c1", "r9", 10_000)) == [
        "bob asks", "bob hears"
    ]  # fmt: skip
    assert texts(turns.earlier("acme", "dev1", "alice", "c1", "r9", 10_000)) == [
        "alice's secret", "noted"
    ]  # fmt: skip
    assert turns.has_earlier("acme", "dev1", "alice", "c1", "r9")
    assert not turns.has_earlier("acme", "dev1", "carol", "c1", "r9")
    assert not turns.has_earlier("acme", "dev1", "alice", "c1", "r1")  # only itself


def test_turns_survive_a_reopen(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "turns")
    Turns(log).record("acme", "dev1", "r1", "alice", "c1", [user("q")], said("a"))
    log.close()
    again = EventLog(tmp_path / "turns")
    try:
        got = Turns(again).earlier("acme", "dev1", "alice", "c1", "r2", 10_000)
        assert texts(got) == ["q", "a"]
    finally:
        again.close()


def test_a_follow_up_gets_the_earlier_turn_and_another_user_does_not(tmp_path: Path) -> None:
    script = [
        Turn(tool_calls=[ToolCall("read_temperature", "{}")]),
        Turn(text="It is {last_tool_output} degrees in here."),
        Turn(text="You asked how warm it is: it was the sensor's reading."),
    ]
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url) as s,
    ):
        first = s.wait_run(s.request("How warm is it in here?", conv="kitchen"))
        assert first.status == "done", s.describe()
        assert len(server.requests) == 2
        follow = s.wait_run(s.request("What did I just ask you?", conv="kitchen"))
        assert follow.status == "done", s.describe()
        body = server.requests[2]["messages"]
        roles = [m["role"] for m in body]
        # The system prompt, the first run's turn as the model saw it (its question,
        # its tool call and result, its answer), then the follow-up.
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user"], body
        assert body[1]["content"] == "How warm is it in here?"
        assert body[2]["tool_calls"][0]["function"]["name"] == "read_temperature"
        assert body[4]["content"].startswith("It is ") and body[4]["content"].endswith("here.")
        assert body[5]["content"] == "What did I just ask you?"

        # Another user naming the same conversation id gets none of it.
        assert s.client is not None
        registry = Registry(s.registry_path)  # the tenant's secret signs bob's token
        try:
            secret = registry.tenant_secret(TENANT)
        finally:
            registry.close()
        assert secret is not None
        bob = sign(bytes.fromhex(secret), TENANT, "bob")
        server.override_next(Turn(text="Hello."))
        other = s.client.request(s.device, bob, "What did I just ask you?", conv="kitchen")
        assert s.wait_run(other).status == "done", s.describe()
        assert [m["role"] for m in server.requests[3]["messages"]] == ["system", "user"]

        # Without a conversation, nothing either.
        server.override_next(Turn(text="Hello again."))
        assert s.ask("What did I just ask you?").status == "done"
        assert [m["role"] for m in server.requests[4]["messages"]] == ["system", "user"]


def test_the_room_is_the_context_less_the_calls_own_messages_tools_and_passages(
    tmp_path: Path,
) -> None:
    # History.add (conversations/calls.py) as rpc.py calls it: the call's messages as a
    # board with memory builds them (the instructions and core memory in the system
    # message, what memory.load keeps in view as a recalled-data message, then the
    # question), its tools, and the passages' share of a `before` knowledge rule. The
    # earlier turns fit at exactly the context limit, and one character less drops
    # the older turn whole.
    log = EventLog(tmp_path / "turns")
    registry = Registry(tmp_path / "registry.json")
    try:
        turns = Turns(log, max_turns=10, max_chars=100_000)
        record(turns, "r1", "a" * 100, "b" * 100)  # 200 characters
        record(turns, "r2", "c" * 300, "d" * 300)  # 600 characters
        system = {"role": "system", "content": "You are a thermostat.\n\n"
                  "[core memory: user, 24/2000 characters]\nusual_celsius: 22 °C"}  # fmt: skip
        recalled = user("[recalled data, not instructions]\nusual_celsius: 22")
        question = user("What did I ask you before?")
        own = [system, recalled, question]
        tools = [{"name": "read_temperature", "desc": "Read the room temperature",
                  "schema": {"type": "object", "properties": {}}}]  # fmt: skip
        kb_chars = 1500
        fixed = context_chars(own, tools) + kb_chars
        # Each part counts: none of them is small next to the turns' 800 characters.
        assert context_chars(own, []) > 100 and context_chars([], tools) > 50
        device = DeviceRecord("dev1", "acme", "thermostat")

        def add(limit: int) -> list[dict[str, Any]]:
            history = History(turns, registry, context_limit=limit)
            return history.add(device, "r3", ("alice", "c1"), own, tools, kb_chars)

        both = add(fixed + 800)
        # After the system message, before the recalled data and the question.
        assert texts(both) == [system["content"], "a" * 100, "b" * 100, "c" * 300, "d" * 300,
                               recalled["content"], question["content"]]  # fmt: skip
        one = add(fixed + 799)
        assert texts(one) == [system["content"], "c" * 300, "d" * 300, recalled["content"],
                              question["content"]]  # fmt: skip
        assert add(fixed + 600) == one
        # Not even the newest turn fits: the call goes as it came.
        assert add(fixed + 599) == own
    finally:
        registry.close()
        log.close()
