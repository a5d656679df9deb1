"""An OpenAI-compatible chat-completions provider (OpenAI, Ollama, llama.cpp server, vLLM).

Stdlib only (urllib): one streaming POST to `{base_url}/chat/completions`, the SSE reply
parsed line by line and turned into the contract's chunks (see models/base.py).

Errors: every failure becomes a ModelError whose message is safe to show a customer (it
names no key, no URL, no server text); the detail goes to the log, with the key
scrubbed from it.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from server_bridge.models.base import Chunk, Final, ModelError

log = logging.getLogger(__name__)

# One SSE line longer than this is not a chat-completions chunk; refuse it instead of
# buffering without bound.
MAX_LINE = 1 << 20
# How much of an HTTP error body is read for the log.
MAX_ERROR_BODY = 4096

# OpenAI function names must match this; ours may not (`memory.remember` has a dot), so
# names are mapped on the way out and back on the way in.
_FN_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}\Z")
_FN_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_-]")


class _ToolNames:
    """A two-way map between our tool names and names the API accepts, stable within
    one call (tools and the conversation's earlier calls map the same way)."""

    def __init__(self) -> None:
        self.out: dict[str, str] = {}
        self.back: dict[str, str] = {}

    def wire(self, name: str) -> str:
        if name in self.out:
            return self.out[name]
        wire = name if _FN_NAME.match(name) else (_FN_BAD_CHARS.sub("_", name)[:64] or "tool")
        base, n = wire, 1
        while wire in self.back and self.back[wire] != name:
            n += 1
            suffix = f"_{n}"
            wire = base[: 64 - len(suffix)] + suffix
        self.out[name], self.back[wire] = wire, name
        return wire

    def ours(self, wire: str) -> str:
        return self.back.get(wire, wire)


@dataclass
class _CallParts:
    """A streamed tool call being assembled from its deltas."""

    id: str = ""
    name: str = ""
    args: list[str] = field(default_factory=list)


def _safe_url(url: str) -> str:
    """The URL without user:password@, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _json_text(value: Any) -> str:
    """Tool-call input is a JSON string on our wire; accept a map too and encode it."""
    if isinstance(value, str):
        return value or "{}"
    if value is None:
        return "{}"
    return json.dumps(value, ensure_ascii=False)


class OpenAIProvider:
    """Provider for any server that speaks OpenAI's streaming chat completions."""

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        timeout: float = 60,
    ) -> None:
        parts = urllib.parse.urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("base_url must be an http:// or https:// URL")
        self._basic: str | None = None
        if parts.username is not None:
            # urllib does not send URL credentials itself; turn them into a header and
            # keep them out of the URL that is logged or shown.
            user = urllib.parse.unquote(parts.username)
            pwd = urllib.parse.unquote(parts.password or "")
            self._basic = base64.b64encode(f"{user}:{pwd}".encode()).decode()
        self.base_url = _safe_url(base_url.rstrip("/"))
        self.model = model
        # Local servers (Ollama, llama.cpp) need no key; None then means no header.
        self._api_key = api_key if api_key is not None else os.environ.get(api_key_env) or None
        self.timeout = timeout
        # No proxy for loopback servers even when the environment names one: a local
        # Ollama or llama.cpp server is never behind the corporate proxy.
        host = parts.hostname or ""
        handlers: list[urllib.request.BaseHandler] = []
        if host in ("localhost", "127.0.0.1", "::1"):
            handlers.append(urllib.request.ProxyHandler({}))
        self._opener = urllib.request.build_opener(*handlers)

    def __repr__(self) -> str:
        # Never show the key, even in a debugger or a log of the provider object.
        return f"OpenAIProvider(base_url={self.base_url!r}, model={self.model!r})"

    # --- request ------------------------------------------------------------------

    def build_request(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        model: str | None = None,
        max_tokens: int | None = None,
    ) -> tuple[dict[str, Any], _ToolNames]:
        """The JSON body for one call, and the tool-name map to read the answer with."""
        names = _ToolNames()
        body: dict[str, Any] = {
            "model": model or self.model,
            "messages": [self._message(m, names) for m in messages],
            "stream": True,
            # Without this the stream carries no token counts.
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": names.wire(_text(t.get("name"))),
                        "description": _text(t.get("description")),
                        "parameters": t.get("args") or {"type": "object", "properties": {}},
                    },
                }
                for t in tools
            ]
        if max_tokens is not None:
            # `max_tokens` rather than `max_completion_tokens`: it is the one every
            # OpenAI-compatible server (Ollama, llama.cpp, vLLM) understands.
            body["max_tokens"] = max_tokens
        return body, names

    @staticmethod
    def _message(m: Mapping[str, Any], names: _ToolNames) -> dict[str, Any]:
        role = m.get("role")
        content = _text(m.get("content"))
        if role in ("system", "user"):
            return {"role": role, "content": content}
        if role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": content}
            calls = m.get("tools") or []
            if calls:
                out["tool_calls"] = [
                    {
                        "id": str(c.get("call")),
                        "type": "function",
                        "function": {
                            "name": names.wire(_text(c.get("name"))),
                            "arguments": _json_text(c.get("input")),
                        },
                    }
                    for c in calls
                ]
            return out
        if role == "tool":
            return {"role": "tool", "tool_call_id": str(m.get("call")), "content": content}
        raise ModelError(f"unsupported message role {role!r}")

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "User-Agent": "wren-bridge",
        }
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        elif self._basic:
            headers["Authorization"] = f"Basic {self._basic}"
        return headers

    def _scrub(self, text: str) -> str:
        if self._api_key:
            text = text.replace(self._api_key, "***")
        return text

    # --- the call -----------------------------------------------------------------

    def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        emit: Callable[[Chunk], None],
        model: str | None = None,
        max_tokens: int | None = None,
    ) -> Final:
        body, names = self.build_request(messages, tools, model, max_tokens)
        url = f"{self.base_url}/chat/completions"
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers=self._headers(), method="POST"
        )
        try:
            response = self._opener.open(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise self._http_error(e) from None
        except TimeoutError as e:
            log.warning("model server %s timed out: %s", self.base_url, e)
            raise ModelError("the model server timed out") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            if isinstance(getattr(e, "reason", None), TimeoutError):
                log.warning("model server %s timed out: %s", self.base_url, e)
                raise ModelError("the model server timed out") from None
            log.warning("model server %s unreachable: %s", self.base_url, self._scrub(str(e)))
            raise ModelError("could not reach the model server") from None
        with response:
            try:
                return self._read_stream(response, emit, names)
            except ModelError:
                raise
            except TimeoutError as e:
                log.warning("model server %s timed out mid-stream: %s", self.base_url, e)
                raise ModelError("the model server timed out") from None
            except (OSError, http.client.HTTPException) as e:
                log.warning("model stream from %s broke: %s", self.base_url, e)
                raise ModelError("the connection to the model server broke") from None

    def _http_error(self, e: urllib.error.HTTPError) -> ModelError:
        try:
            detail = e.read(MAX_ERROR_BODY).decode("utf-8", "replace")
        except (OSError, http.client.HTTPException):
            detail = ""
        finally:
            e.close()
        log.warning(
            "model server %s answered HTTP %s: %s", self.base_url, e.code, self._scrub(detail)
        )
        code = e.code
        if code in (401, 403):
            msg = "the model server refused the credentials"
        elif code == 404:
            msg = "the model or the model endpoint was not found"
        elif code == 429:
            msg = "the model server is rate limiting requests"
        elif code >= 500:
            msg = "the model server failed"
        else:
            msg = "the model server refused the request"
        return ModelError(f"{msg} (HTTP {code})")

    def _read_stream(
        self, response: Any, emit: Callable[[Chunk], None], names: _ToolNames
    ) -> Final:
        calls: dict[int, _CallParts] = {}
        usage = {"in": 0, "out": 0, "reason": 0}
        finish: str | None = None
        done = False
        data: list[str] = []

        def dispatch() -> None:
            nonlocal finish
            payload = "\n".join(data)
            data.clear()
            try:
                obj = json.loads(payload)
            except ValueError:
                log.warning("malformed SSE data from %s: %.200r", self.base_url, payload)
                raise ModelError("the model server sent a malformed stream") from None
            if not isinstance(obj, dict):
                raise ModelError("the model server sent a malformed stream")
            if obj.get("error"):
                # vLLM and others report failures inside the stream after a 200.
                log.warning(
                    "model server %s streamed an error: %s",
                    self.base_url,
                    self._scrub(json.dumps(obj["error"])[:MAX_ERROR_BODY]),
                )
                raise ModelError("the model server reported an error")
            finish = self._chunk(obj, emit, calls, usage) or finish

        while True:
            raw = response.readline(MAX_LINE + 1)
            if not raw:
                break
            if len(raw) > MAX_LINE:
                raise ModelError("the model server sent an oversized stream line")
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line:
                # A blank line ends an SSE event.
                if data:
                    dispatch()
                continue
            if line.startswith(":"):
                continue  # an SSE comment (keep-alive)
            fieldname, _, value = line.partition(":")
            if fieldname != "data":
                continue  # event:, id:, retry: carry nothing for us
            value = value[1:] if value.startswith(" ") else value
            if value == "[DONE]":
                done = True
                break
            data.append(value)
        if data:
            dispatch()
        if not done and finish is None:
            raise ModelError("the model server ended the stream early")

        for index in sorted(calls):
            parts = calls[index]
            emit(
                {
                    "tool": {
                        "call": parts.id or f"call_{index}",
                        "name": names.ours(parts.name),
                        "input": "".join(parts.args) or "{}",
                    }
                }
            )
        # Some servers (Ollama) say "stop" even when the turn ended in tool calls; the
        # tool loop on the board reads the finish, so say what actually happened.
        if calls and finish in (None, "stop"):
            finish = "tool_calls"
        return {"usage": usage, "finish": finish or "stop"}

    @staticmethod
    def _chunk(
        obj: Mapping[str, Any],
        emit: Callable[[Chunk], None],
        calls: dict[int, _CallParts],
        usage: dict[str, int],
    ) -> str | None:
        """Apply one chat.completion.chunk; returns its finish_reason, if any."""
        finish: str | None = None
        u = obj.get("usage")
        if isinstance(u, Mapping):
            usage["in"] = _count(u.get("prompt_tokens"))
            usage["out"] = _count(u.get("completion_tokens"))
            details = u.get("completion_tokens_details")
            if isinstance(details, Mapping):
                usage["reason"] = _count(details.get("reasoning_tokens"))
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, Mapping):
                continue
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                content = delta.get("content")
                if isinstance(content, str) and content:
                    emit({"text": content})
                # DeepSeek and vLLM say reasoning_content; Ollama and OpenRouter reasoning.
                reason = delta.get("reasoning_content") or delta.get("reasoning")
                if isinstance(reason, str) and reason:
                    emit({"reason": reason})
                tool_calls = delta.get("tool_calls")
                for pos, tc in enumerate(tool_calls if isinstance(tool_calls, list) else []):
                    if isinstance(tc, Mapping):
                        _add_call_delta(calls, pos, tc)
            reason_end = choice.get("finish_reason")
            if isinstance(reason_end, str) and reason_end:
                finish = reason_end
        return finish


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _add_call_delta(calls: dict[int, _CallParts], pos: int, tc: Mapping[str, Any]) -> None:
    index = tc.get("index")
    parts = calls.setdefault(index if isinstance(index, int) else pos, _CallParts())
    call_id = tc.get("id")
    if isinstance(call_id, str) and call_id:
        # Set, not appended: some servers repeat the id in every fragment.
        parts.id = call_id
    fn = tc.get("function")
    if not isinstance(fn, Mapping):
        return
    name = fn.get("name")
    if isinstance(name, str) and name and name != parts.name:
        # The name normally comes whole in the first fragment; some servers repeat it
        # (ignored when equal) and a few split it (appended).
        parts.name += name
    args = fn.get("arguments")
    if isinstance(args, str):
        parts.args.append(args)
    elif isinstance(args, Mapping):
        # A server that sends the arguments as an object, whole, instead of JSON text.
        parts.args.append(json.dumps(args, ensure_ascii=False))
