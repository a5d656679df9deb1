"""The provider interface every model backend implements.

A provider turns one `llm.complete` call into a stream of chunks, exactly the chunk
shapes of the wire contract, so the RPC layer forwards them without translation:

    {"text": "..."}                                   streamed assistant text
    {"reason": "..."}                                 streamed reasoning text
    {"tool": {"call": id, "name": n, "input": json}}  a tool call (input is a JSON string)

and then returns the final answer `{"usage": {"in", "out", "reason"}, "finish": str}`.

`deadline`, when given, is a time.monotonic() value past which nobody waits for the
answer any more (the call's overall limit, `--model-timeout`, or what its run has left):
a provider stops by then — raising ModelError, cause `timeout`, not retryable — so a
stream that never finishes does not hold a worker. A provider that streams also gives up
on a server that goes silent (cause `stalled`; models/openai.py, `timeout`).

Which `model` a call names and how many `max_tokens` it may ask for is decided before the
provider is called (models/policy.py): a provider gets a model the bridge allows (None:
its own) and a `max_tokens` within the bridge's cap.

Messages are the board's conversation, in the contract's shape:
    {"role": "system" | "user", "content": str}
    {"role": "assistant", "content": str, "tools": [{"call", "name", "input"}]}
    {"role": "tool", "call": id, "content": str}
Tools are `{"name", "description", "args": <JSON schema>}`.

A provider may also offer `send_early(messages, tools, model, max_tokens)`: send the
request at once, on the thread that received the call, never blocking, and return what
it sent (with a `close()` for a call that then never runs) or None; the call's
`complete(..., early=that)` then reads its answer. The RPC layer uses it when present
(server_bridge/rpc.py, `Method.early`); the OpenAI provider has one.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

Chunk = dict[str, Any]
Final = dict[str, Any]


# Why a model call failed, as hosts are told (run.failed `err.cause`, PROTOCOL.md
# "Errors"), and whether asking again can help.
CAUSES = (
    "auth",
    "not_found",
    "rate_limited",
    "overloaded",
    "timeout",
    "stalled",
    "bad_response",
    "bad_endpoint",
    "unavailable",
    "model_not_allowed",
    "run_limit",
)


# What a model call past its overall limit says (cause `timeout`, not retryable): the
# provider's words and the RPC layer's (server_bridge/rpc.py), whichever answers first.
TOO_SLOW = (
    "the model call did not finish in time (the bridge's --model-timeout): "
    "ask for a shorter answer, or raise the limit"
)


class ModelError(Exception):
    """A provider failure the board sees as an RPC error of kind 'llm': its message is
    customer-safe and says what to do; `cause` is one of CAUSES and `retryable` whether
    the same call may succeed later (a wrong key or model never will)."""

    kind = "llm"

    def __init__(self, msg: str, cause: str = "unavailable", retryable: bool = True) -> None:
        super().__init__(msg)
        self.cause = cause if cause in CAUSES else "unavailable"
        self.retryable = retryable


class Cancelled(ModelError):
    """The call was ended from outside, mid-stream: the bridge is stopping
    (`OpenAIProvider.cancel`). Retryable: the same call may succeed once a bridge is back."""

    def __init__(self, msg: str = "the bridge stopped during the model call: ask again") -> None:
        super().__init__(msg, "unavailable", True)


class Provider(Protocol):
    name: str

    def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        emit: Callable[[Chunk], None],
        model: str | None = None,
        max_tokens: int | None = None,
        *,
        deadline: float | None = None,
    ) -> Final:
        """Stream chunks through `emit` and return the final {usage, finish}; give up
        with a ModelError once time.monotonic() passes `deadline`."""
        ...


def check_base_url(url: str) -> urllib.parse.SplitResult:
    """An OpenAI-compatible server's base URL, split; ValueError, in words a user can
    act on, for one that is not http:// or https:// with a host (and a valid port)."""
    parts = urllib.parse.urlsplit(url.strip().rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"expected an http:// or https:// URL such as http://127.0.0.1:11434/v1, got {url!r}"
        )
    try:
        parts.port  # noqa: B018 - reading it is the check: urllib raises for a bad one
    except ValueError:
        raise ValueError(f"the port of {url!r} is not a number in 0..65535") from None
    return parts
