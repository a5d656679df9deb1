"""Session tokens: claims {ten, usr, exp} signed with the tenant's secret (HMAC-SHA256).

A token is `<base64url(msgpack claims)>.<base64url(hmac)>`. The bridge verifies it and
takes the user id from it; nothing else in a host message names the user.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass

import msgpack

from edge_runtime.events import MAX_ID


class TokenError(ValueError):
    """A session token that is malformed, forged, expired or for another tenant."""

    kind = "bad_token"


@dataclass(frozen=True)
class Session:
    tenant: str
    user: str
    expires: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(secret: bytes, tenant: str, user: str, ttl_s: int = 3600, now: float | None = None) -> str:
    # The user id reaches the board as `usr`, which the board bounds like every id: a
    # token naming a longer one could never start a run, so it is not issued.
    if not isinstance(user, str) or not 0 < len(user) <= MAX_ID:
        raise ValueError(f"a session token's user id must be a str of 1..{MAX_ID} chars")
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_ID:
        raise ValueError(f"a session token's tenant must be a str of 1..{MAX_ID} chars")
    exp = int((time.time() if now is None else now) + ttl_s)
    body = msgpack.packb({"ten": tenant, "usr": user, "exp": exp})
    mac = hmac.new(secret, body, hashlib.sha256).digest()
    return f"{_b64(body)}.{_b64(mac)}"


def verify(secret: bytes, token: object, tenant: str, now: float | None = None) -> Session:
    """Return the session a token proves, for the tenant whose topic it arrived on."""
    if not isinstance(token, str) or token.count(".") != 1 or len(token) > 1024:
        raise TokenError("malformed session token")
    body_text, mac_text = token.split(".")
    try:
        body = _unb64(body_text)
        mac = _unb64(mac_text)
    except (ValueError, TypeError) as e:
        raise TokenError("malformed session token") from e
    want = hmac.new(secret, body, hashlib.sha256).digest()
    if not hmac.compare_digest(want, mac):
        raise TokenError("session token signature does not verify")
    try:
        claims = msgpack.unpackb(body, max_str_len=MAX_ID, max_map_len=8, max_array_len=0)
    except Exception as e:  # noqa: BLE001 - any decode failure is a malformed token
        raise TokenError("malformed session token claims") from e
    if not isinstance(claims, dict):
        raise TokenError("malformed session token claims")
    ten, usr, exp = claims.get("ten"), claims.get("usr"), claims.get("exp")
    if not isinstance(ten, str) or not isinstance(usr, str) or not usr or not isinstance(exp, int):
        raise TokenError("session token lacks ten, usr or exp")
    if ten != tenant:
        raise TokenError("session token is for another tenant")
    if exp < (time.time() if now is None else now):
        raise TokenError("session token has expired")
    return Session(ten, usr, exp)
