"""Scope tickets (tokens.sign_scope / verify_scope): what a board's memory call proves."""

from __future__ import annotations

import pytest

from server_bridge import tokens
from server_bridge.tokens import TokenError

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
NOW = 1_800_000_000.0


def test_a_ticket_proves_its_tenant_device_user_and_conversation() -> None:
    t = tokens.sign_scope(SECRET, "acme", "dev1", "alice", "c1", now=NOW)
    scope = tokens.verify_scope(SECRET, t, "acme", "dev1", now=NOW + 60)
    assert (scope.tenant, scope.device, scope.user, scope.conv) == ("acme", "dev1", "alice", "c1")
    assert scope.expires == int(NOW) + tokens.SCOPE_TTL_S


def test_a_ticket_may_carry_no_user_or_conversation() -> None:
    t = tokens.sign_scope(SECRET, "acme", "dev1", None, None, now=NOW)
    scope = tokens.verify_scope(SECRET, t, "acme", "dev1", now=NOW)
    assert scope.user is None and scope.conv is None


@pytest.mark.parametrize(
    ("secret", "tenant", "device", "at", "why"),
    [
        (OTHER, "acme", "dev1", NOW, "signature"),
        (SECRET, "globex", "dev1", NOW, "another device"),
        (SECRET, "acme", "dev2", NOW, "another device"),
        (SECRET, "acme", "dev1", NOW + tokens.SCOPE_TTL_S + 1, "expired"),
    ],
)
def test_a_ticket_proves_nothing_for_another_secret_device_tenant_or_after_expiry(
    secret: bytes, tenant: str, device: str, at: float, why: str
) -> None:
    t = tokens.sign_scope(SECRET, "acme", "dev1", "alice", "c1", now=NOW)
    with pytest.raises(TokenError, match=why):
        tokens.verify_scope(secret, t, tenant, device, now=at)


def test_tickets_and_session_tokens_never_stand_in_for_each_other() -> None:
    # Both are signed with the tenant's secret; a board holds tickets naming users, and
    # must not be able to present one as that user's session (nor a host the reverse).
    ticket = tokens.sign_scope(SECRET, "acme", "dev1", "alice", "c1", now=NOW)
    session = tokens.sign(SECRET, "acme", "alice", now=NOW)
    with pytest.raises(TokenError, match="signature"):
        tokens.verify(SECRET, ticket, "acme", now=NOW)
    with pytest.raises(TokenError, match="signature"):
        tokens.verify_scope(SECRET, session, "acme", "dev1", now=NOW)


@pytest.mark.parametrize("bad", [None, 7, "", "abc", "a.b.c", "!!!.???", "x" * 2000 + ".y"])
def test_a_malformed_ticket_is_bad_token(bad: object) -> None:
    with pytest.raises(TokenError) as e:
        tokens.verify_scope(SECRET, bad, "acme", "dev1", now=NOW)
    assert e.value.kind == "bad_token"


def test_ids_past_the_contracts_bound_are_not_signed() -> None:
    with pytest.raises(ValueError):
        tokens.sign_scope(SECRET, "acme", "dev1", "u" * 65, None)
    with pytest.raises(ValueError):
        tokens.sign_scope(SECRET, "acme", "", "alice", None)


# --- TokenCache: the bridge's remembered verifications and tickets -------------------


class _Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_cache_serves_a_verified_token_until_it_expires() -> None:
    clock = _Clock()
    cache = tokens.TokenCache(clock=clock)
    tok = tokens.sign(SECRET, "acme", "alice", ttl_s=60, now=NOW)
    first = cache.verify(SECRET.hex(), tok, "acme")
    assert cache.verify(SECRET.hex(), tok, "acme") is first  # kept
    clock.t = NOW + 61
    with pytest.raises(TokenError, match="expired"):
        cache.verify(SECRET.hex(), tok, "acme")


def test_the_cache_judges_another_secret_tenant_or_a_refusal_again() -> None:
    cache = tokens.TokenCache(clock=_Clock())
    tok = tokens.sign(SECRET, "acme", "alice", now=NOW)
    cache.verify(SECRET.hex(), tok, "acme")
    with pytest.raises(TokenError, match="signature"):
        cache.verify(OTHER.hex(), tok, "acme")  # the tenant's secret was changed
    with pytest.raises(TokenError, match="another tenant"):
        cache.verify(SECRET.hex(), tok, "globex")
    forged = tok[:-2] + ("AA" if not tok.endswith("AA") else "BB")
    for _ in range(2):
        with pytest.raises(TokenError):
            cache.verify(SECRET.hex(), forged, "acme")
    with pytest.raises(TokenError, match="malformed"):
        cache.verify(SECRET.hex(), None, "acme")


def test_the_cache_reuses_a_ticket_for_its_scope_only_and_for_reuse_s() -> None:
    clock = _Clock()
    cache = tokens.TokenCache(reuse_s=60, clock=clock)
    t1 = cache.scope(SECRET.hex(), "acme", "dev1", "alice", "c1")
    assert cache.scope(SECRET.hex(), "acme", "dev1", "alice", "c1") == t1
    assert cache.scope(SECRET.hex(), "acme", "dev1", "alice", "c2") != t1
    assert cache.scope(SECRET.hex(), "acme", "dev1", "bob", "c1") != t1
    assert cache.scope(OTHER.hex(), "acme", "dev1", "alice", "c1") != t1
    scope = tokens.verify_scope(SECRET, t1, "acme", "dev1", now=NOW)
    assert (scope.user, scope.conv, scope.expires) == ("alice", "c1", int(NOW) + tokens.SCOPE_TTL_S)
    clock.t = NOW + 61
    t2 = cache.scope(SECRET.hex(), "acme", "dev1", "alice", "c1")
    assert (
        tokens.verify_scope(SECRET, t2, "acme", "dev1", now=clock.t).expires
        == int(clock.t) + tokens.SCOPE_TTL_S
    )


def test_the_cache_is_bounded() -> None:
    cache = tokens.TokenCache(max_entries=3, clock=_Clock())
    toks = [tokens.sign(SECRET, "acme", f"u{k}", now=NOW) for k in range(5)]
    for k, tok in enumerate(toks):
        cache.verify(SECRET.hex(), tok, "acme")
        cache.scope(SECRET.hex(), "acme", "dev1", f"u{k}", None)
    assert len(cache._sessions) == 3 and len(cache._tickets) == 3
