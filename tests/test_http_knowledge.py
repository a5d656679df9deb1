"""Knowledge over the hosts' HTTP API (server_bridge/http/knowledge.py), with rights per
end user from the registry: the real `wren bridge --http --knowledge` process (the
default embedder), Mosquitto and the demo board, called with httpx; and the grants as
`wren grant` writes them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_bridge.registry import RECHECK_S, Registry
from tests.stack import TENANT, Stack
from tests.test_cli import _ok, _registry_cli
from tests.test_http_api import bearer, http_url, token

PUMP = """# The pump

## Priming
Before the first run, open the bleed screw on the pump head and fill the housing with
water until no air comes out. Close the screw and switch the pump on.

## Cleaning the filter
Every month take the filter cartridge out, rinse it under running water and put it back
with the arrow towards the pump.
"""

VALVES = "The valves close by themselves when the soil moisture sensor reads above 40 %."


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    args = ["--http", "127.0.0.1:0", "--knowledge", str(tmp_path / "knowledge.sqlite3")]
    with Stack(tmp_path, bridge_args=args) as s:
        yield s


def grant(s: Stack, usr: str, collection: str, access: str) -> None:
    # As `wren grant add --user-id` writes it; a running bridge reads the file again
    # within RECHECK_S.
    with Registry(s.registry_path) as reg:
        reg.add_user_grant(TENANT, usr, f"kb:{collection}", access)
    time.sleep(2 * RECHECK_S)


def put(base: str, tok: str, src: str, text: str, **more: Any) -> httpx.Response:
    return httpx.put(f"{base}/v1/knowledge/manuals/sources/{src}", headers=bearer(tok),
                     json={"text": text, **more}, timeout=120)  # fmt: skip


def search(base: str, tok: str, query: str, **more: Any) -> httpx.Response:
    return httpx.post(f"{base}/v1/knowledge/search", headers=bearer(tok),
                      json={"query": query, **more}, timeout=60)  # fmt: skip


def test_rights_per_end_user_put_search_delete_and_what_a_refusal_keeps(stack: Stack) -> None:
    base = http_url(stack)
    alice, bob, carol = (token(stack, u) for u in ("alice", "bob", "carol"))
    watcher = token(stack, "ops", watch=True)

    # Before any grant: nothing is listed, a put is the 404 of a missing collection.
    assert httpx.get(f"{base}/v1/knowledge", headers=bearer(alice)).json() == {"collections": []}
    refused = put(base, alice, "pump.md", PUMP, kind="md")
    assert (refused.status_code, refused.json()["error"]) == (404, "unknown_collection")

    grant(stack, "alice", "manuals", "write")
    grant(stack, "bob", "manuals", "read")
    first = put(base, alice, "pump.md", PUMP, kind="md", tags=["pump"])
    assert first.status_code == 200, first.text
    assert first.json()["status"] == "new" and first.json()["chunks"] >= 1
    assert put(base, alice, "pump.md", PUMP, kind="md", tags=["pump"]).json()["status"] == (
        "unchanged"
    )
    assert put(base, alice, "garden/valves.txt", VALVES).json()["status"] == "new"

    # Bob reads: the passage with its provenance; he may not write.
    found = search(base, bob, "how do I get the air out of the pump before starting it")
    assert found.status_code == 200, found.text
    top = found.json()["hits"][0]
    assert (top["collection"], top["src"]) == ("manuals", "pump.md")
    assert top["headings"][-1] == "Priming" and "bleed screw" in top["text"]
    assert len(top["ver"]) == 64 and isinstance(top["score"], float)
    listed = httpx.get(f"{base}/v1/knowledge", headers=bearer(bob)).json()["collections"]
    assert [(c["collection"], c["access"], c["sources"]) for c in listed] == [
        ("manuals", "read", 2)
    ]
    for refused in (put(base, bob, "pump.md", "gone"),
                    httpx.delete(f"{base}/v1/knowledge/manuals/sources/pump.md",
                                 headers=bearer(bob)),
                    httpx.delete(f"{base}/v1/knowledge/manuals", headers=bearer(bob))):  # fmt: skip
        assert (refused.status_code, refused.json()["error"]) == (403, "forbidden")

    # Carol, and a watcher (watching runs grants no knowledge), see none of it.
    for tok in (carol, watcher):
        assert search(base, tok, "pump").json()["hits"] == []
        named = search(base, tok, "pump", collections=["manuals"])
        assert (named.status_code, named.json()["error"]) == (404, "unknown_collection")
        hidden = httpx.get(f"{base}/v1/knowledge/manuals/sources", headers=bearer(tok))
        assert hidden.status_code == 404
    assert httpx.get(f"{base}/v1/knowledge", headers=bearer("forged")).status_code == 401

    # Bad input: each refused by name; what was stored stays.
    for response, status, kind in (
        (put(base, alice, "big.txt", "x" * (300 << 10)), 413, "too_large"),
        (put(base, alice, ".hidden", "text"), 400, "bad_envelope"),
        (put(base, alice, "manual.pdf", "text", kind="pdf"), 400, "bad_envelope"),
        (put(base, alice, "empty.txt", "   "), 400, "bad_envelope"),
        (put(base, alice, "tags.txt", "text", tags="pump"), 400, "bad_envelope"),
        (httpx.put(f"{base}/v1/knowledge/manuals/sources/x.txt", headers=bearer(alice),
                   content=b"\xff{not json"), 400, "bad_envelope"),  # fmt: skip
        (search(base, bob, "pump", k=0), 400, "bad_envelope"),
        (search(base, bob, "pump", k="5"), 400, "bad_envelope"),
        (search(base, bob, "p" * 10_000), 413, "too_large"),
    ):
        assert (response.status_code, response.json()["error"]) == (status, kind), response.text
    sources = httpx.get(f"{base}/v1/knowledge/manuals/sources", headers=bearer(bob)).json()
    assert sorted(s["src"] for s in sources["sources"]) == ["garden/valves.txt", "pump.md"]
    assert "usr:alice" in next(s for s in sources["sources"] if s["src"] == "pump.md")["tags"]

    # A changed text replaces the source; a delete is gone for good, across a restart.
    changed = put(base, alice, "pump.md", PUMP.replace("bleed screw", "vent plug"), kind="md")
    assert changed.json()["status"] == "changed"
    assert "vent plug" in search(base, bob, "air out of the pump").json()["hits"][0]["text"]
    gone = httpx.delete(f"{base}/v1/knowledge/manuals/sources/pump.md", headers=bearer(alice))
    assert gone.status_code == 200 and gone.json()["chunks"] >= 1
    stack.kill_bridge()
    stack.start_bridge()
    base = http_url(stack)
    hits = search(base, bob, "air out of the pump").json()["hits"]
    assert all(h["src"] != "pump.md" for h in hits)
    again = httpx.delete(f"{base}/v1/knowledge/manuals/sources/pump.md", headers=bearer(alice))
    assert again.status_code == 404
    whole = httpx.delete(f"{base}/v1/knowledge/manuals", headers=bearer(alice))
    assert whole.status_code == 200 and whole.json()["chunks"] >= 1
    assert search(base, bob, "valves").json()["hits"] == []


def test_end_user_grants_from_the_command_line(tmp_path: Path) -> None:
    _ok(tmp_path, "tenant", "add", "acme")
    added = _ok(tmp_path, "grant", "add", "--tenant", "acme", "--user-id", "alice",
                "--field", "kb:manuals")  # fmt: skip
    assert added.splitlines()[0] == (
        "grant: user alice of tenant acme may search, put documents into and delete from "
        "knowledge collection manuals over HTTP"
    )
    _ok(tmp_path, "grant", "add", "--tenant", "acme", "--user-id", "bob", "--field",
        "kb:manuals", "--read-only")  # fmt: skip
    assert _ok(tmp_path, "grant", "list").splitlines() == [
        "TENANT  AGENT  FIELD  ACCESS",
        "",
        "TENANT  USER   FIELD       ACCESS",
        "acme    alice  kb:manuals  read-write",
        "acme    bob    kb:manuals  read-only",
    ]
    # An end user is granted knowledge only: never a memory field.
    memory = _registry_cli(tmp_path, "grant", "add", "--tenant", "acme", "--user-id", "eve",
                           "--field", "notes")  # fmt: skip
    assert memory.returncode == 1 and "knowledge collection" in memory.stderr
    both = _registry_cli(tmp_path, "grant", "add", "--tenant", "acme", "--user-id", "eve",
                         "--agent", "kiosk", "--field", "kb:manuals")  # fmt: skip
    assert both.returncode == 2  # one subject or the other
    _ok(tmp_path, "grant", "remove", "--tenant", "acme", "--user-id", "bob", "--field",
        "kb:manuals")  # fmt: skip
    with Registry(tmp_path / ".wren" / "registry.json") as registry:
        assert registry.user_grants_of("acme", "alice").knowledge("manuals") == "write"
        assert registry.user_grants_of("acme", "bob").knowledge("manuals") is None
        assert registry.user_grants_of("globex", "alice").knowledge("manuals") is None
