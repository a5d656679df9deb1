"""Scrubbing secrets out of text bound for logs or for a customer.

An exception raised by a model library, an HTTP client or a provider written elsewhere
may carry a request URL with credentials, an Authorization header or an API key in its
message. The bridge logs such exceptions as their type and a scrubbed message, and keeps
the (scrubbed) traceback at DEBUG: an operator still sees what failed and where, a log
shipper never sees a key.

The patterns are deliberately broad: a false positive costs a few characters of a log
line, a false negative leaks a credential.
"""

from __future__ import annotations

import re
import traceback

__all__ = ["MASK", "describe", "scrub", "scrubbed_traceback"]

MASK = "***"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # user:password@ (or a token as the user) in any URL: //user:pass@host -> //***@host
    (re.compile(r"//[^\s/?#@]+@"), f"//{MASK}@"),
    # Authorization header values.
    (re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+"), rf"\1 {MASK}"),
    (re.compile(r"(?i)\b(basic)\s+[A-Za-z0-9+/=]{8,}"), rf"\1 {MASK}"),
    # OpenAI-style keys (sk-..., sk-proj-...) and the similar prefixes others use.
    (re.compile(r"\b(sk|pk|rk)[-_][A-Za-z0-9_-]+"), rf"\1-{MASK}"),
    # name=value / name: value pairs in query strings, form bodies, headers, reprs.
    (
        re.compile(
            r"(?i)\b(api[_-]?key|\w*token|secret|password|passwd|pwd|authorization)"
            r"(['\"]?\s*[=:]\s*['\"]?)[^\s&,;'\"]+"
        ),
        rf"\1\2{MASK}",
    ),
)


def scrub(text: str) -> str:
    """`text` with anything that looks like a credential replaced by `***`."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def describe(exc: BaseException, limit: int = 500) -> str:
    """`TypeName: scrubbed message`, capped at `limit` characters of message."""
    msg = scrub(str(exc))
    if len(msg) > limit:
        msg = msg[:limit] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def scrubbed_traceback(exc: BaseException) -> str:
    """The formatted traceback of `exc` (with its chained causes), scrubbed."""
    return scrub("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
