"""Session tokens and scope tickets, signed with the tenant's secret (HMAC-SHA256).

A session token is `<base64url(msgpack claims)>.<base64url(hmac)>` with claims
{ten, usr, exp} and, for a watcher (a dashboard, an operator), `role: "watch"`. The
bridge verifies it and takes the user id from it; nothing else in a host message names
the user. The user id is a level of the host topic of that user's runs, so it is held
to topics.USR_PATTERN: no token is signed, and none verifies, for any other. Who may do
what with a run follows from the session (server_bridge/access.py).

A scope ticket has the same form with claims {ten, dev, usr, conv, exp}: the bridge
adds one to each request it forwards to a board, and the board copies it into the run's
memory calls, so the bridge knows whose memory a call may touch without keeping any
state, across its own restarts (PROTOCOL.md, "Scopes"). Tickets are signed with a key
derived from the tenant's secret for that use alone: a ticket never verifies as a
session token, nor a token as a ticket.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from edge_runtime.events import MAX_ID
from server_bridge.topics import USR_PATTERN, is_user_id

# The one role a session token may carry: it may watch (and act on) every run of its
# tenant (PROTOCOL.md "Who sees what"). A token without one speaks for its user alone.
WATCH = "watch"


class TokenError(ValueError):
    """A session token that is malformed, forged, expired or for another tenant."""

    kind = "bad_token"


@dataclass(frozen=True)
class Session:
    tenant: str
    user: str
    expires: int
    # The token's role is "watch": the session may see and act on every user's runs.
    watch: bool = False


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _claims(key: bytes, token: object, what: str, max_len: int) -> dict[Any, Any]:
    """The claims map of `<body>.<mac>` signed with `key`; TokenError naming `what`."""
    if not isinstance(token, str) or token.count(".") != 1 or len(token) > max_len:
        raise TokenError(f"malformed {what}")
    body_text, mac_text = token.split(".")
    try:
        body = _unb64(body_text)
        mac = _unb64(mac_text)
    except (ValueError, TypeError) as e:
        raise TokenError(f"malformed {what}") from e
    want = hmac.new(key, body, hashlib.sha256).digest()
    if not hmac.compare_digest(want, mac):
        raise TokenError(f"{what} signature does not verify")
    try:
        claims = msgpack.unpackb(body, max_str_len=MAX_ID, max_map_len=8, max_array_len=0)
    except Exception as e:  # noqa: BLE001 - any decode failure is a malformed token
        raise TokenError(f"malformed {what} claims") from e
    if not isinstance(claims, dict):
        raise TokenError(f"malformed {what} claims")
    return claims


def sign(
    secret: bytes,
    tenant: str,
    user: str,
    ttl_s: int = 3600,
    now: float | None = None,
    *,
    watch: bool = False,
) -> str:
    """A session token for `user` of `tenant`; with `watch`, a watcher's (role "watch")."""
    # The user id reaches the board as `usr` (bounded like every id) and names the host
    # topic of the user's runs: a token naming a longer one, or one with a character a
    # topic level cannot hold, could never be served, so it is not issued.
    if not is_user_id(user):
        raise ValueError(f"a session token's user id must match {USR_PATTERN}")
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_ID:
        raise ValueError(f"a session token's tenant must be a str of 1..{MAX_ID} chars")
    exp = int((time.time() if now is None else now) + ttl_s)
    claims: dict[str, Any] = {"ten": tenant, "usr": user, "exp": exp}
    if watch:
        claims["role"] = WATCH
    body = msgpack.packb(claims)
    mac = hmac.new(secret, body, hashlib.sha256).digest()
    return f"{_b64(body)}.{_b64(mac)}"


def verify(secret: bytes, token: object, tenant: str, now: float | None = None) -> Session:
    """Return the session a token proves, for the tenant whose topic it arrived on."""
    claims = _claims(secret, token, "session token", 1024)
    ten, usr, exp = claims.get("ten"), claims.get("usr"), claims.get("exp")
    if not isinstance(ten, str) or not isinstance(usr, str) or not usr or not isinstance(exp, int):
        raise TokenError("session token lacks ten, usr or exp")
    if not is_user_id(usr):
        # Signed by the tenant's secret, but not a user id a topic can name.
        raise TokenError("session token names a user id outside the contract's alphabet")
    role = claims.get("role")
    if role is not None and role != WATCH:
        # An unknown role is refused, never read as none: a newer issuer's narrower
        # role must not turn into a plain user's rights here, nor a wider one.
        raise TokenError("session token has an unknown role")
    if ten != tenant:
        raise TokenError("session token is for another tenant")
    if exp < (time.time() if now is None else now):
        raise TokenError("session token has expired")
    return Session(ten, usr, exp, role == WATCH)


def peek(token: object) -> dict[str, Any] | None:
    """The claims of a session token, NOT verified (a host holds no secret): what a host
    client reads to know which topics its token's events come on. None when malformed.
    Never a basis for a right: the bridge and the broker decide those."""
    if not isinstance(token, str) or token.count(".") != 1 or len(token) > 1024:
        return None
    try:
        claims = msgpack.unpackb(
            _unb64(token.split(".")[0]), max_str_len=MAX_ID, max_map_len=8, max_array_len=0
        )
    except Exception:  # noqa: BLE001 - any decode failure is a malformed token
        return None
    return claims if isinstance(claims, dict) else None


# A ticket outlives its run's longest wait on a person (a paused run, for hours).
SCOPE_TTL_S = 7 * 24 * 3600
_SCOPE_USE = b"wren/scope-ticket/v1"
# Four ids of at most MAX_ID characters, an expiry and the keys: well under this.
_MAX_TICKET = 1024


@dataclass(frozen=True)
class Scope:
    """Whose memory a board's call may touch: the request's verified user and
    conversation (None when the request had none), for one device of one tenant."""

    tenant: str
    device: str
    user: str | None
    conv: str | None
    expires: int


def _scope_key(secret: bytes) -> bytes:
    return hmac.new(secret, _SCOPE_USE, hashlib.sha256).digest()


def _optional_id(value: object) -> bool:
    return value is None or (isinstance(value, str) and 0 < len(value) <= MAX_ID)


def sign_scope(
    secret: bytes,
    tenant: str,
    device: str,
    user: str | None,
    conv: str | None,
    ttl_s: int = SCOPE_TTL_S,
    now: float | None = None,
) -> str:
    """The scope ticket for a request the bridge forwards to `device`."""
    for name, value in (("tenant", tenant), ("device", device)):
        if not isinstance(value, str) or not 0 < len(value) <= MAX_ID:
            raise ValueError(f"a scope ticket's {name} must be a str of 1..{MAX_ID} chars")
    if not _optional_id(user) or not _optional_id(conv):
        raise ValueError(f"a scope ticket's user and conv are None or 1..{MAX_ID} chars")
    exp = int((time.time() if now is None else now) + ttl_s)
    body = msgpack.packb({"ten": tenant, "dev": device, "usr": user, "conv": conv, "exp": exp})
    mac = hmac.new(_scope_key(secret), body, hashlib.sha256).digest()
    return f"{_b64(body)}.{_b64(mac)}"


def verify_scope(
    secret: bytes, ticket: object, tenant: str, device: str, now: float | None = None
) -> Scope:
    """The scope a ticket proves, for a call made by `device` (the broker-authenticated
    user of the call) of `tenant` (the registry's); TokenError when it proves none."""
    claims = _claims(_scope_key(secret), ticket, "scope ticket", _MAX_TICKET)
    ten, dev, exp = claims.get("ten"), claims.get("dev"), claims.get("exp")
    usr, conv = claims.get("usr"), claims.get("conv")
    if not isinstance(ten, str) or not isinstance(dev, str) or not isinstance(exp, int):
        raise TokenError("scope ticket lacks ten, dev or exp")
    if not _optional_id(usr) or not _optional_id(conv):
        raise TokenError("scope ticket has a malformed usr or conv")
    if ten != tenant or dev != device:
        raise TokenError("scope ticket is for another device")
    if exp < (time.time() if now is None else now):
        raise TokenError("scope ticket has expired")
    return Scope(ten, dev, usr, conv, exp)


class TokenCache:
    """The bridge's recent work on tokens, so a host's next request costs a lookup.

    A host sends the same session token with every request, and the bridge signs a
    scope ticket for every request it forwards; each is an HMAC, base64 and msgpack,
    which on a bridge whose code and data went cold between requests cost about a tenth
    of a request's time through it (60 us of 190, measured with the caches evicted).
    So a session token that verified is kept, by its secret, tenant and text, and served
    again until its own expiry; a ticket is kept by its secret and scope, and served
    again for `reuse_s` (its expiry then lies at most that much nearer: a ticket is a
    bearer credential for that one scope, so two requests holding the same one may do
    nothing either could not). A changed secret misses both. Refusals are not kept:
    each is judged again. Bounded: `max_entries` of each, least recently used first out.
    """

    def __init__(
        self,
        max_entries: int = 1024,
        reuse_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._max = max_entries
        self._reuse_s = reuse_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[tuple[str, str, str], Session] = OrderedDict()
        self._tickets: OrderedDict[tuple[str, str, str, str | None, str | None], tuple[str, float]]
        self._tickets = OrderedDict()

    def verify(self, secret_hex: str, token: object, tenant: str) -> Session:
        """verify(), remembered: the session of a token already verified for `tenant`
        with the same secret, unless it has expired since."""
        now = self._clock()
        if not isinstance(token, str):
            return verify(bytes.fromhex(secret_hex), token, tenant, now)  # refused
        key = (secret_hex, tenant, token)
        with self._lock:
            session = self._sessions.get(key)
            if session is not None:
                if session.expires >= now:
                    self._sessions.move_to_end(key)
                    return session
                del self._sessions[key]
        session = verify(bytes.fromhex(secret_hex), token, tenant, now)
        with self._lock:
            self._sessions[key] = session
            while len(self._sessions) > self._max:
                self._sessions.popitem(last=False)
        return session

    def scope(
        self, secret_hex: str, tenant: str, device: str, user: str | None, conv: str | None
    ) -> str:
        """sign_scope(), remembered for reuse_s."""
        now = self._clock()
        key = (secret_hex, tenant, device, user, conv)
        with self._lock:
            kept = self._tickets.get(key)
            if kept is not None:
                if now - kept[1] < self._reuse_s:
                    self._tickets.move_to_end(key)
                    return kept[0]
                del self._tickets[key]
        ticket = sign_scope(bytes.fromhex(secret_hex), tenant, device, user, conv, now=now)
        with self._lock:
            self._tickets[key] = (ticket, now)
            while len(self._tickets) > self._max:
                self._tickets.popitem(last=False)
        return ticket


def dashboard_link(base_url: str, token: str) -> str:
    """The dashboard of the bridge at `base_url` (its --http address), signed in with
    `token`: the token rides in the URL's fragment, which a browser never sends to a
    server (no access log keeps it), and the page takes it out of the address bar."""
    return f"{base_url.rstrip('/')}/ui/#token={token}"
