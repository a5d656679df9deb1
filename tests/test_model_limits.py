"""What a model call may cost, and how long it may take (issue 25, items 7 and 8;
PROTOCOL.md "Model calls").

End to end, every part real: a board on the MicroPython unix port (.mpy, 128 KiB) whose
agent names its own `model` and `max_tokens`, Mosquitto with Wren's ACL, `wren bridge`
as a process with its command-line options, the OpenAI-compatible test server
(tests/model_server.py) and the host client. Beside them, the provider alone against the
same server, and the rules (models/policy.py) on their own. Nothing asserts how long
something took: a wait's bound only says it ended.

- A board asks for `the-most-expensive-model` and 2**63 - 1 tokens: refused by name
  (`model_not_allowed`), nothing reaching the model server, unless the operator allowed
  the model; then the server gets it with the bridge's `--max-tokens`. A run that loops
  is stopped at `--run-model-calls`.
- A model streaming a token every 0.3 s for longer than the idle timeout in all (each gap
  under it) finishes; one that goes silent past it fails `stalled`; one still streaming
  at `--model-timeout` fails `timeout`, not retryable.
- An answer cut by the model's length limit reaches the host as such (`msg.end`
  `finish: "length"`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from server_bridge import service
from server_bridge.host.reducer import RunSnapshot
from server_bridge.host.terminal import render
from server_bridge.models.base import ModelError
from server_bridge.models.openai import IDLE_TIMEOUT_S, OpenAIProvider
from server_bridge.models.policy import ModelGate, ModelPolicy, ModelRefused, parse_allow
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import Stack, assistant_text
from tools.demo import TENANT

EXPENSIVE = "the-most-expensive-model"
CHEAP = "cheap-model"
HUGE = 2**63 - 1

# A meter reader whose agent chooses its own model and answer length, as a board may.
METER = f"""\
from edge_runtime import board, platform
from edge_runtime.agent import Agent

agent = Agent("meter", "1.0", "You read the meter.", model="{EXPENSIVE}",
              max_tokens={HUGE})


@agent.tool("read_meter", "Read the meter in kWh")
def read_meter(args):
    platform.log("tool read_meter ran")
    return 42

board.start(agent)
"""
# The thermostat without its memory field: these runs are about the model call.
PLAIN = {"memory": False}
MESSAGES = [{"role": "user", "content": "How much?"}]


def run_events(s: Stack, snap: RunSnapshot, t: str) -> list[dict[str, Any]]:
    assert s.client is not None
    return [e for e in s.client.events if e["r"] == snap.run and e["t"] == t]


def failed_with(s: Stack, snap: RunSnapshot, cause: str) -> dict[str, str]:
    assert snap.status == "failed", f"{snap.status}\n{s.describe()}"
    assert snap.error is not None and snap.error["kind"] == "llm", snap.error
    assert snap.error.get("cause") == cause, snap.error
    return snap.error


# ----------------------------------------------------------------- item 7, end to end


def test_a_board_asking_for_a_model_the_bridge_does_not_allow_is_refused_by_name(
    tmp_path: Path,
) -> None:
    with (
        ModelServer([Turn(text="I should never be asked.")]) as server,
        Stack(
            tmp_path,
            model_url=server.url,
            model=CHEAP,
            main_py=METER,
            # Allowed for another agent of the tenant, not for this device's.
            bridge_args=["--allow-model", f"{TENANT}/kiosk={EXPENSIVE}"],
        ) as s,
    ):
        snap = s.ask("How much have we used?")
        error = failed_with(s, snap, "model_not_allowed")
        assert snap.retryable is False  # the same call is refused the same way
        assert EXPENSIVE in error["msg"] and "--allow-model" in error["msg"]
        # Refused as it arrived: the model server never heard of it.
        assert server.requests == []


def test_an_allowed_model_gets_the_bridges_token_cap_and_a_looping_run_is_stopped(
    tmp_path: Path,
) -> None:
    with (
        ModelServer([Turn(text="You have used 42 kWh.")]) as server,
        Stack(
            tmp_path,
            model_url=server.url,
            model=CHEAP,
            main_py=METER,
            bridge_args=[
                "--allow-model", f"{TENANT}={EXPENSIVE}",
                "--max-tokens", "256",
                "--run-model-calls", "2",
            ],
        ) as s,
    ):  # fmt: skip
        snap = s.ask("How much have we used?")
        assert snap.status == "done", s.describe()
        assert assistant_text(snap) == "You have used 42 kWh."
        (body,) = server.requests
        # The model the operator allowed, and the bridge's cap, not the board's 2**63 - 1.
        assert body["model"] == EXPENSIVE
        assert body["max_tokens"] == 256

        # A model that keeps calling the tool: the run's third call is the bridge's no.
        again = Turn(tool_calls=[ToolCall("read_meter")])
        server.override_next(again, again, Turn(text="never said"))
        snap = s.ask("Read it until it changes.")
        error = failed_with(s, snap, "run_limit")
        assert snap.retryable is False
        assert "--run-model-calls" in error["msg"]
        assert len(server.requests) == 3  # the first run's one, this run's two
        assert all(b["max_tokens"] == 256 for b in server.requests)
        assert s.console_count("tool read_meter ran", 2) == 2


# ----------------------------------------------------------------- item 8, end to end


def test_a_slow_steady_model_finishes_a_stalled_or_endless_one_fails_by_name(
    tmp_path: Path,
) -> None:
    # Each gap 0.3 s, under the 1 s idle timeout; the whole stream (11 events) over 3 s.
    steady = "one two three four five six"
    with (
        ModelServer([Turn(text=steady, chunk_chars=4, delay_s=0.3)]) as server,
        Stack(
            tmp_path,
            model_url=server.url,
            board_settings=PLAIN,
            bridge_args=["--model-idle-timeout", "1", "--model-timeout", "8"],
        ) as s,
    ):
        snap = s.ask("Count slowly.")
        assert snap.status == "done", f"{snap.error}\n{s.describe()}"
        assert assistant_text(snap) == steady

        # Silent before its first token for longer than the idle timeout: a model that
        # slow to start is as slow the next time.
        server.override_next(Turn(text="late", hang_s=5))
        snap = s.ask("Think hard first.")
        error = failed_with(s, snap, "stalled")
        assert snap.retryable is False and "--model-idle-timeout" in error["msg"]

        # Silent mid-answer: the server's trouble, worth asking again.
        server.override_next(Turn(text="It is twenty-one degrees.", rest_after_s=5))
        snap = s.ask("How warm is it?")
        error = failed_with(s, snap, "stalled")
        assert snap.retryable is True and "--model-idle-timeout" in error["msg"]

        # Streaming steadily past the overall limit (over 40 gaps of 0.3 s against 8 s).
        server.override_next(Turn(text="word " * 40, chunk_chars=5, delay_s=0.3))
        snap = s.ask("Tell me everything.")
        error = failed_with(s, snap, "timeout")
        assert snap.retryable is False and "--model-timeout" in error["msg"]


def test_an_answer_cut_by_the_length_limit_says_so_to_the_host(tmp_path: Path) -> None:
    with (
        ModelServer([Turn(text="The full answer is")]) as server,
        Stack(tmp_path, model_url=server.url, board_settings=PLAIN) as s,
    ):
        server.override_next(Turn(text="The full answer is", finish_reason="length"))
        cut = s.ask("Explain it all.")
        whole = s.ask("Say it briefly.")
        for snap in (cut, whole):
            assert snap.status == "done", s.describe()
            assert assistant_text(snap) == "The full answer is"
        (end,) = run_events(s, cut, "msg.end")
        assert end["d"].get("finish") == "length"
        (end,) = run_events(s, whole, "msg.end")
        assert end["d"].get("finish") == "stop"
        # The host's snapshot keeps it, and its transcript says it.
        assert [r.finish for r in cut.rows if r.kind == "assistant"] == ["length"]
        assert "assistant: The full answer is [cut short: the answer reached its token limit]" in (
            render(cut)
        )
        assert not any("cut short" in line for line in render(whole))


# ----------------------------------------------------------------- the provider alone


def complete(provider: OpenAIProvider, deadline_s: float = 30) -> tuple[Any, list[Any]]:
    """One call (on a thread of its own, so a hang cannot hang the test); the final or
    the exception, and the chunks."""
    out: list[Any] = []
    chunks: list[Any] = []

    def call() -> None:
        try:
            out.append(
                provider.complete(
                    MESSAGES, [], chunks.append, deadline=time.monotonic() + deadline_s
                )
            )
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)  # a bound for the test, not a timing claim
    assert not t.is_alive() and out, "the call never ended"
    return out[0], chunks


def test_the_provider_holds_a_model_to_its_idle_timeout_not_to_its_whole_time() -> None:
    text = "a slow but steady model"
    with ModelServer([Turn(text=text, chunk_chars=3, delay_s=0.2)]) as server:
        provider = OpenAIProvider(server.url, "m", api_key="k", timeout=1, temperature=0.2)
        final, chunks = complete(provider)
        assert final["finish"] == "stop", final
        assert "".join(c["text"] for c in chunks) == text
        assert server.requests[0]["temperature"] == 0.2

        server.override_next(Turn(text="never", hang_s=4))
        failed, _ = complete(provider)
        assert isinstance(failed, ModelError), failed
        assert (failed.cause, failed.retryable) == ("stalled", False)

        server.override_next(Turn(text="half an answer", rest_after_s=4))
        failed, chunks = complete(provider)
        assert isinstance(failed, ModelError), failed
        assert (failed.cause, failed.retryable) == ("stalled", True)
        assert chunks  # it had begun

        server.override_next(Turn(text="x" * 40, chunk_chars=1, delay_s=0.2))
        failed, _ = complete(provider, deadline_s=2)
        assert isinstance(failed, ModelError), failed
        assert (failed.cause, failed.retryable) == ("timeout", False)


def test_the_length_finish_reaches_the_final_answer() -> None:
    with ModelServer([Turn(text="cut", finish_reason="length")]) as server:
        final, _ = complete(OpenAIProvider(server.url, "m", api_key="k"))
        assert final["finish"] == "length"


# ----------------------------------------------------------------- the rules


def test_the_gate_allows_the_bridges_model_and_the_lists_and_caps_tokens() -> None:
    policy = ModelPolicy(
        allowed={"*": frozenset({"shared"}), "acme": frozenset({"big"}),
                 "acme/kiosk": frozenset({"huge"}), "lab": frozenset({"*"})},
    )  # fmt: skip
    gate = ModelGate("own", 512, policy)
    for tenant, agent, model in (
        ("acme", "thermostat", None),
        ("acme", "thermostat", "own"),
        ("acme", "thermostat", "shared"),
        ("acme", "thermostat", "big"),
        ("acme", "kiosk", "huge"),
        ("lab", "any", "whatever-model"),
    ):
        ok = gate.admit(tenant, agent, "d1", None, model, HUGE)
        assert (ok.model, ok.max_tokens) == (model, 512)
    for tenant, agent, model in (
        ("acme", "thermostat", "huge"),  # another agent's
        ("other", "thermostat", "big"),  # another tenant's
        ("acme", "thermostat", EXPENSIVE),
    ):
        with pytest.raises(ModelRefused) as refused:
            gate.admit(tenant, agent, "d1", None, model, 10)
        assert (refused.value.cause, refused.value.retryable) == ("model_not_allowed", False)
    assert gate.admit("acme", "thermostat", "d1", None, None, None).max_tokens == 512
    assert gate.admit("acme", "thermostat", "d1", None, None, 100).max_tokens == 100


def test_the_gate_caps_a_runs_calls_tokens_and_model_time() -> None:
    gate = ModelGate(None, 1000, ModelPolicy(run_calls=3, run_tokens=1500, run_s=60))
    first = gate.admit("t", "a", "d1", "b.1", None, None)
    assert (first.max_tokens, first.run_left_s) == (1000, 60)
    gate.spend("d1", "b.1", 50.0, 1200)
    second = gate.admit("t", "a", "d1", "b.1", None, None)
    # What the run has left of its tokens and its time.
    assert (second.max_tokens, second.run_left_s) == (300, 10)
    gate.spend("d1", "b.1", 11.0, 10)
    with pytest.raises(ModelRefused, match="--run-model-time") as refused:
        gate.admit("t", "a", "d1", "b.1", None, None)
    assert refused.value.cause == "run_limit"
    # Another run, or the same run id from another device, starts from nothing.
    gate.admit("t", "a", "d1", "b.2", None, None)
    gate.admit("t", "a", "d2", "b.1", None, None)
    gate.admit("t", "a", "d1", "b.3", None, None)
    gate.spend("d1", "b.3", 1.0, 1500)
    with pytest.raises(ModelRefused, match="--run-model-tokens"):
        gate.admit("t", "a", "d1", "b.3", None, None)
    for _ in range(3):
        gate.admit("t", "a", "d1", "b.4", None, None)
    with pytest.raises(ModelRefused, match="--run-model-calls"):
        gate.admit("t", "a", "d1", "b.4", None, None)


def test_the_bridge_options_make_the_rules() -> None:
    args = service.build_parser().parse_args(
        ["--allow-model", "gpt-4o", "--allow-model", "acme=big,bigger",
         "--allow-model", "acme=biggest", "--allow-model", "acme/kiosk=org/model:7b",
         "--max-tokens", "300", "--model-timeout", "900", "--model-idle-timeout", "20",
         "--temperature", "0.7", "--run-model-calls", "5", "--run-model-tokens", "9000",
         "--run-model-time", "120"]
    )  # fmt: skip
    policy = service.model_policy(args)
    assert policy.allowed == {
        "*": frozenset({"gpt-4o"}),
        "acme": frozenset({"big", "bigger", "biggest"}),
        "acme/kiosk": frozenset({"org/model:7b"}),
    }
    assert (policy.run_calls, policy.run_tokens, policy.run_s) == (5, 9000, 120)
    config = service.bridge_config(args)
    assert (config.llm_max_tokens, config.llm_timeout_s) == (300, 900)
    assert (args.model_idle_timeout, args.temperature) == (20, 0.7)
    # The defaults: the provider's own idle timeout, written once more for --help.
    defaults = service.build_parser().parse_args([])
    assert defaults.model_idle_timeout == IDLE_TIMEOUT_S
    assert service.model_policy(defaults) == ModelPolicy(allowed={})
    assert parse_allow("*=a=b") == ("*", frozenset({"a=b"}))


@pytest.mark.parametrize(
    "argv",
    [
        ["--allow-model", "Acme=x"],
        ["--allow-model", "acme="],
        ["--max-tokens", "0"],
        ["--max-tokens", "many"],
        ["--temperature", "3"],
        ["--temperature", "nan"],
        ["--model-timeout", "0"],
        ["--model-idle-timeout", "-1"],
        ["--run-model-calls", "0"],
    ],
)
def test_the_bridge_refuses_bad_model_options(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        service.build_parser().parse_args(argv)
    assert argv[0] in capsys.readouterr().err
