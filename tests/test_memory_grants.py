"""Shared tenant fields and their grants, through a real Mosquitto and the real bridge.

Three boards declare the same fields: dev1 (tenant acme, agent thermostat), dev3 (acme,
kiosk) and dev2 (globex, kiosk). A `tenant` field is one store per tenant that an agent
reaches only with a grant in the bridge's registry (PROTOCOL.md "Scopes"); the grants
here are made as an operator makes them, through the registry file, some by `wren grant`
in a process of its own while the bridge runs.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_bridge.memory import MemoryService, TinyMemoryStore
from server_bridge.memory.grants import READ, WRITE
from server_bridge.memory.recall import RecallIndex
from server_bridge.models.scripted import ScriptedProvider
from tests.test_bridge import Peer, World, wait_for
from tests.test_cli import TIMEOUT_S, _env, wren
from tests.test_memory_service import files
from tools.broker import MosquittoProcess

FIELDS = [
    {"name": "menu", "vis": "public", "dur": "tenant"},
    {"name": "house_notes", "vis": "public", "dur": "tenant", "kind": "collection"},
    {"name": "secret_plan", "dur": "tenant", "kind": "collection"},  # private
    {"name": "own_notes", "vis": "public", "dur": "agent", "kind": "collection"},
]
_ids = itertools.count(1)
# How long a grant changed by another process may take to reach the bridge: the
# registry's recheck time is 0.25 s; this bounds the polling, it is not the expectation.
REACH_S = 10.0


class Board:
    """A board peer of one device: its hello, then memory calls and their answers."""

    def __init__(self, w: GrantWorld, device: str, agent: str) -> None:
        self.w, self.device = w, device
        self.res = w.d("rpc/res", device)
        self.peer = Peer(w.broker, [self.res])
        hello = {"agent": agent, "ver": "0.1.0", "fw": "test", "boot": "b0000001",
                 "fields": FIELDS, "tools": [], "limits": {"payload": 4096}}  # fmt: skip
        self.peer.send(w.d("hello", device), hello)
        wait_for(lambda: w.bridge.hello(device) is not None, f"{device}'s hello")

    def rpc(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        c = next(_ids)
        self.peer.send(self.w.d("rpc", self.device), {"c": c, "m": method, "a": args,
                                                      "r": "b0000001.1"})  # fmt: skip
        got = self.peer.get(self.res)
        assert got["c"] == c and "ch" not in got, got
        return dict(got)

    def ok(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        got = self.rpc(method, args)
        assert "ok" in got, got
        return dict(got["ok"])

    def kind(self, method: str, args: dict[str, Any]) -> str:
        """The kind a call is refused with (a state.commit's one write on its own)."""
        got = self.rpc(method, args)
        if method == "state.commit" and "ok" in got:
            [result] = got["ok"]["results"]
            return str(result.get("err", {}).get("kind", "ok"))
        return str(got["err"]["kind"]) if "err" in got else "ok"

    def close(self) -> None:
        self.peer.close()


class GrantWorld(World):
    def __init__(self, broker: MosquittoProcess, tmp: Path) -> None:
        self.broker = broker
        self.tmp = tmp
        service = MemoryService(TinyMemoryStore(tmp / "memory"), index=RecallIndex(embedder=None))
        super().__init__(broker, tmp, ScriptedProvider(), memory=service)
        self.registry.add_device("dev3", "acme", "kiosk")
        # Added after the bridge started: read once the bridge has seen the registry
        # again, as a board registered and then booted is (links.py).
        wait_for(lambda: self.bridge.reads_device("dev3"), "the bridge to read dev3")
        self.registry.add_grant("acme", "thermostat")  # every tenant field, read-write
        self.thermo = Board(self, "dev1", "thermostat")
        self.kiosk = Board(self, "dev3", "kiosk")
        self.globex = Board(self, "dev2", "kiosk")

    def wren_grant(self, *args: str) -> None:
        """`wren grant ...` on the bridge's registry file, as an operator runs it."""
        proc = subprocess.run(
            wren("grant", *args, "--registry", str(self.tmp / "registry.json")),
            cwd=self.tmp,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def stored(self) -> dict[str, bytes]:
        return files(self.tmp / "memory")

    def close(self) -> None:
        for b in (self.thermo, self.kiosk, self.globex):
            b.close()
        super().close()


@pytest.fixture
def gw(broker: MosquittoProcess, tmp_path: Path) -> Iterator[GrantWorld]:
    w = GrantWorld(broker, tmp_path)
    yield w
    w.close()


def remember(board: Board, field: str, key: str, value: str, w: str) -> None:
    board.ok("mem.remember", {"field": field, "key": key, "value": value, "w": w})


def seed(gw: GrantWorld) -> None:
    """The thermostat (granted every tenant field) writes the menu and a house note."""
    gw.thermo.ok("state.commit", {"writes": [{"field": "menu", "value": "soup", "w": "t:1"}]})
    remember(gw.thermo, "house_notes", "boiler", "the boiler is serviced in May", "t:2")


def menu_of(board: Board) -> Any:
    return board.ok("state.load", {"fields": ["menu"]})["values"].get("menu")


def note_keys(board: Board) -> list[str]:
    return [r["key"] for r in board.ok("mem.list", {"field": "house_notes"})["rows"]]


def test_two_agents_of_a_tenant_share_a_tenant_field_with_grants(gw: GrantWorld) -> None:
    gw.registry.add_grant("acme", "kiosk", "menu")
    gw.registry.add_grant("acme", "kiosk", "house_notes")
    commit = {"writes": [{"field": "menu", "value": "soup", "w": "t:1"}]}
    assert gw.thermo.ok("state.commit", commit)["results"][0]["ver"] == 1
    remember(gw.thermo, "house_notes", "boiler", "the boiler is serviced in May", "t:2")
    # The kiosk reads what the thermostat wrote, and writes to the same store.
    assert menu_of(gw.kiosk) == "soup"
    gw.kiosk.ok("state.commit", {"writes": [{"field": "menu", "value": "stew", "w": "k:1"}]})
    remember(gw.kiosk, "house_notes", "door", "the back door sticks", "k:2")
    assert menu_of(gw.thermo) == "stew"
    assert note_keys(gw.thermo) == ["door", "boiler"]
    hits = gw.kiosk.ok("mem.recall", {"query": "boiler service"})["hits"]
    assert [(h["field"], h["key"]) for h in hits] == [("house_notes", "boiler")]
    assert hits[0]["prov"]["agent"] == "thermostat" and hits[0]["prov"]["dev"] == "dev1"
    # The owner rule still holds on top of the grants: the thermostat's private tenant
    # collection stays its own, though the kiosk is granted every tenant field.
    gw.registry.add_grant("acme", "kiosk")
    remember(gw.thermo, "secret_plan", "p", "boiler replacement budget", "t:3")
    assert gw.kiosk.kind("mem.list", {"field": "secret_plan"}) == "forbidden"
    hits = gw.kiosk.ok("mem.recall", {"query": "boiler budget", "k": 20})["hits"]
    assert [h["key"] for h in hits] == ["boiler"]


def test_an_agent_without_a_grant_is_refused_forbidden_and_nothing_changes(
    gw: GrantWorld,
) -> None:
    seed(gw)
    remember(gw.kiosk, "own_notes", "mine", "the boiler room key is at the desk", "k:0")
    # A grant of another field grants nothing here; arguments that name a grant or a
    # tenant are data.
    gw.registry.add_grant("acme", "kiosk", "prices")
    forged = {"grant": "*", "grants": {"*": "write"}, "tenant": "acme", "agent": "thermostat"}
    before = gw.stored()
    refused: list[tuple[str, dict[str, Any]]] = [
        ("state.load", {"fields": ["menu"]}),
        ("state.commit", {"writes": [{"field": "menu", "value": "x", "w": "k:1", **forged}]}),
        ("mem.remember", {"field": "house_notes", "value": "x", "w": "k:2"}),
        ("mem.forget", {"field": "house_notes", "key": "boiler", "w": "k:3"}),
        ("mem.append", {"field": "menu", "text": "!", "w": "k:4"}),
        ("mem.list", {"field": "house_notes"}),
        ("mem.peek", {"field": "house_notes", "key": "boiler"}),
        ("mem.recall", {"query": "boiler", "field": "house_notes"}),
    ]
    for method, args in refused:
        assert gw.kiosk.kind(method, {**args, **forged}) == "forbidden", method
    assert gw.stored() == before
    # Recall over every field skips the tenant field: only the kiosk's own row.
    hits = gw.kiosk.ok("mem.recall", {"query": "boiler", "k": 20, **forged})["hits"]
    assert [(h["field"], h["key"]) for h in hits] == [("own_notes", "mine")]
    assert menu_of(gw.thermo) == "soup" and note_keys(gw.thermo) == ["boiler"]


def test_a_read_only_grant_reads_and_every_write_is_forbidden(gw: GrantWorld) -> None:
    seed(gw)
    gw.registry.add_grant("acme", "kiosk", access=READ)
    assert menu_of(gw.kiosk) == "soup"
    assert note_keys(gw.kiosk) == ["boiler"]
    peek = gw.kiosk.ok("mem.peek", {"field": "house_notes", "key": "boiler"})
    assert peek["row"]["value"] == "the boiler is serviced in May"
    hits = gw.kiosk.ok("mem.recall", {"query": "boiler"})["hits"]
    assert [h["key"] for h in hits] == ["boiler"]
    before = gw.stored()
    writes: list[tuple[str, dict[str, Any]]] = [
        ("state.commit", {"writes": [{"field": "menu", "value": "x", "w": "k:1"}]}),
        ("mem.remember", {"field": "house_notes", "value": "x", "w": "k:2"}),
        ("mem.forget", {"field": "house_notes", "key": "boiler", "w": "k:3"}),
        ("mem.forget", {"field": "menu", "w": "k:4"}),
        ("mem.replace", {"field": "menu", "old": "soup", "text": "x", "w": "k:5"}),
        ("mem.cas", {"field": "menu", "value": "x", "if_ver": 1, "w": "k:6"}),
    ]
    for method, args in writes:
        assert gw.kiosk.kind(method, args) == "forbidden", method
    assert gw.stored() == before
    # The field's own grant widens the read-only `*` for that field alone.
    gw.registry.add_grant("acme", "kiosk", "menu", WRITE)
    assert gw.kiosk.kind("state.commit", writes[0][1]) == "ok"
    assert gw.kiosk.kind(*writes[1]) == "forbidden"
    assert menu_of(gw.thermo) == "x"


def test_another_tenants_agent_cannot_reach_the_field(gw: GrantWorld) -> None:
    # globex grants its kiosk every tenant field; acme's kiosk has no grant. The grant is
    # globex's: an acme device running an agent of that name gets nothing from it, and
    # the globex device reaches globex's tenant fields only.
    gw.registry.add_grant("globex", "kiosk")
    seed(gw)
    assert gw.kiosk.kind("state.load", {"fields": ["menu"]}) == "forbidden"
    assert menu_of(gw.globex) is None
    assert gw.globex.ok("mem.list", {"field": "house_notes"})["rows"] == []
    hits = gw.globex.ok("mem.recall", {"query": "boiler", "k": 20, "tenant": "acme"})["hits"]
    assert hits == []
    assert gw.globex.kind("mem.peek", {"field": "house_notes", "key": "boiler",
                                       "tenant": "acme"}) == "not_found"  # fmt: skip
    # What globex's kiosk writes lands in globex's store; acme's is as it was.
    gw.globex.ok("state.commit", {"writes": [{"field": "menu", "value": "fondue", "w": "g:1",
                                              "tenant": "acme"}]})  # fmt: skip
    gw.globex.ok("mem.forget", {"field": "house_notes", "key": "boiler", "w": "g:2"})
    assert menu_of(gw.globex) == "fondue"
    assert menu_of(gw.thermo) == "soup" and note_keys(gw.thermo) == ["boiler"]


def test_a_grant_removed_by_wren_grant_takes_effect_on_the_running_bridge(
    gw: GrantWorld,
) -> None:
    gw.thermo.ok("state.commit", {"writes": [{"field": "menu", "value": "soup", "w": "t:1"}]})
    gw.wren_grant("add", "--tenant", "acme", "--agent", "kiosk")
    load = {"fields": ["menu"]}
    wait_for(lambda: gw.kiosk.kind("state.load", load) == "ok", "the grant", REACH_S)
    assert menu_of(gw.kiosk) == "soup"
    gw.wren_grant("remove", "--tenant", "acme", "--agent", "kiosk")
    wait_for(lambda: gw.kiosk.kind("state.load", load) == "forbidden", "the removal", REACH_S)
    write = {"writes": [{"field": "menu", "value": "stew", "w": "k:1"}]}
    assert gw.kiosk.kind("state.commit", write) == "forbidden"
    assert menu_of(gw.thermo) == "soup"
    # Read-only from the command line: reads come back, writes stay refused.
    gw.wren_grant("add", "--tenant", "acme", "--agent", "kiosk", "--read-only")
    wait_for(lambda: gw.kiosk.kind("state.load", load) == "ok", "the read-only grant", REACH_S)
    assert gw.kiosk.kind("state.commit", write) == "forbidden"
    assert menu_of(gw.thermo) == "soup"
