"""server_bridge/brokerconf.py: password entries that Mosquitto accepts, and the Wren ACL
as a real Mosquitto enforces it, written as an `acl_file` and as the dynamic security
plugin's file (each broker test runs on both)."""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest

from server_bridge import brokerconf
from tools.broker import (
    MosquittoProcess,
    free_port,
    mosquitto_binary,
    start_mosquitto,
    wait_for_port,
)

TIMEOUT_S = 10.0
P = "wren/v1"
USERS = {
    "bridge": "bridge-pw",
    "dev1": "dev1-pw",
    "dev2": "dev2-pw",
    "host-acme": "acme-pw",
    "host-other": "other-pw",
    "host-bob": "bob-pw",
    "observer": "observer-pw",
}
TENANTS = {"acme": ["host-acme", "host-bob"], "other": "host-other"}
# host-bob reads end user bob's runs alone; the other host users are watchers.
BOUND = {"host-bob": "bob"}
# Not a Wren rule: a user of the tests' own who reads everything, so a write the broker
# let through is seen (Wren's rules let no one but the bridge read all of P/#, and no
# one read outside it).
OBSERVER_ACL = "\n# Tests only: sees every write the broker accepts.\nuser observer\ntopic read #\n"
# The same for the dynamic security plugin: a role of the observer's.
OBSERVER_ROLE = {
    "rolename": "observer",
    "acls": [
        {"acltype": "publishClientReceive", "topic": "#", "allow": True},
        {"acltype": "subscribePattern", "topic": "#", "allow": True},
    ],
}
# The access backends of the broker tests: Mosquitto's acl_file and its dynamic
# security plugin.
ACCESS = ("acl_file", "dynsec")
# SUBACK reason codes: QoS 1 granted; refused under MQTT 3.1.1 and under MQTT 5.
GRANTED_1 = 0x01
REFUSED_311 = 0x80
NOT_AUTHORIZED_5 = 0x87


# --- password entries ------------------------------------------------------------------


def test_hash_has_mosquitto_layout() -> None:
    entry = brokerconf.hash_password("secret")
    assert re.fullmatch(r"\$7\$101\$[A-Za-z0-9+/]{16}\$[A-Za-z0-9+/]{86}==", entry), entry
    assert brokerconf.check_password("secret", entry)
    assert not brokerconf.check_password("Secret", entry)
    assert brokerconf.hash_password("secret") != entry  # a fresh salt every time
    with pytest.raises(ValueError):
        brokerconf.hash_password("x", salt=b"short")


def test_hash_equals_mosquitto_passwd_for_the_same_salt(tmp_path: Path) -> None:
    exe = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    if not Path(exe).exists():
        pytest.skip("mosquitto_passwd is not installed")
    pw_file = tmp_path / "pw"
    pw_file.touch()
    subprocess.run([exe, "-b", str(pw_file), "dev1", "s3cret pass"], check=True, timeout=30)
    user, entry = pw_file.read_text().strip().split(":", 1)
    assert user == "dev1"
    _, seven, iterations, salt, _ = entry.split("$")
    assert seven == "7"
    ours = brokerconf.hash_password("s3cret pass", base64.b64decode(salt), int(iterations))
    assert ours == entry
    assert brokerconf.check_password("s3cret pass", entry)


def test_password_file_is_private(tmp_path: Path) -> None:
    path = brokerconf.write_password_file(tmp_path / "passwords", {"b": "1", "a": "2"})
    lines = path.read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ["a", "b"]
    assert brokerconf.check_password("2", lines[0].split(":", 1)[1])
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError):
        brokerconf.write_password_file(tmp_path / "bad", {"a:b": "x"})


def test_password_entries_are_written_as_stored_and_only_entries(tmp_path: Path) -> None:
    entries = {"dev1": brokerconf.hash_password("a"), "bridge": brokerconf.hash_password("b")}
    path = brokerconf.write_password_entries(tmp_path / "passwords", entries)
    assert path.read_text() == f"bridge:{entries['bridge']}\ndev1:{entries['dev1']}\n"
    assert path.stat().st_mode & 0o777 == 0o600
    for bad in ({"dev1": "a plain password"}, {"dev1": "$7$101$abc"}, {"a b": entries["dev1"]}):
        with pytest.raises(ValueError):
            brokerconf.write_password_entries(tmp_path / "bad", bad)
    assert not (tmp_path / "bad").exists()
    assert brokerconf.check_entry(entries["dev1"]) == entries["dev1"]
    password = brokerconf.new_password()
    assert re.fullmatch(r"[A-Za-z0-9_-]{32}", password) and password != brokerconf.new_password()


def test_mosquitto_conf_is_a_whole_config_using_the_files(tmp_path: Path) -> None:
    entries = {"bridge": brokerconf.hash_password("b")}
    acl = brokerconf.acl_text(P, "bridge", {})
    conf = brokerconf.mosquitto_conf(tmp_path / "broker", entries, acl, 18830, "127.0.0.1")
    assert conf == tmp_path / "broker" / "mosquitto.conf"
    lines = conf.read_text().splitlines()
    directory = (tmp_path / "broker").resolve()
    options = [line for line in lines if line and not line.startswith("#")]
    # The listener first: the security options after it are that listener's.
    assert options[:2] == ["listener 18830 127.0.0.1", "allow_anonymous false"]
    for line in (
        f"password_file {directory / 'passwords'}",
        f"acl_file {directory / 'acl'}",
        "use_username_as_clientid true",
        "persistence true",
        f"persistence_location {directory}/",
    ):
        assert line in options
    assert (tmp_path / "broker" / "acl").read_text() == acl
    assert (
        brokerconf.mosquitto_conf(tmp_path / "b2", entries, acl)
        .read_text()
        .count("\nlistener 1883\n")
        == 1
    )
    for port, bind in ((0, None), (70000, None), (1883, "a b")):
        with pytest.raises(ValueError):
            brokerconf.mosquitto_conf(tmp_path / "b3", entries, acl, port, bind)


# --- ACL text ----------------------------------------------------------------


# A bridge user's siblings, in the order the ACL lists them (sorted by name).
LINK_USERS = (".ctl", ".l1", ".l2", ".l3")


def test_acl_text_is_exactly_the_wren_rules() -> None:
    assert brokerconf.acl_text(P, "bridge", {"acme": "host-acme"}) == (
        "# Wren broker ACL (written by server_bridge/brokerconf.py). Mosquitto denies whatever\n"
        "# is not granted here.\n"
        "\n"
        "# Devices: the MQTT user name is the device id.\n"
        "pattern read wren/v1/d/%u/req\n"
        "pattern read wren/v1/d/%u/ctl\n"
        "pattern read wren/v1/d/%u/rpc/res\n"
        "pattern write wren/v1/d/%u/status\n"
        "pattern write wren/v1/d/%u/hello\n"
        "pattern write wren/v1/d/%u/evt\n"
        "pattern write wren/v1/d/%u/rpc\n"
        "\n"
        "# Devices and hosts: the bridge's presence.\n"
        "pattern read wren/v1/b/status\n"
        "\n"
        "# The bridge.\n"
        "user bridge\n"
        "topic readwrite wren/v1/#\n"
        "\n"
        # Its control user (its control connection's login) and its link users (the
        # logins of its links, server_bridge/links.py): the same rights.
        "# The bridge.\n"
        "user bridge.ctl\n"
        "topic readwrite wren/v1/#\n"
        "\n"
        "# The bridge.\n"
        "user bridge.l1\n"
        "topic readwrite wren/v1/#\n"
        "\n"
        "# The bridge.\n"
        "user bridge.l2\n"
        "topic readwrite wren/v1/#\n"
        "\n"
        "# The bridge.\n"
        "user bridge.l3\n"
        "topic readwrite wren/v1/#\n"
        "\n"
        # A host user not bound to one end user is a watcher: every user's runs.
        "# Hosts of tenant acme: a watcher.\n"
        "user host-acme\n"
        "topic read wren/v1/h/acme/+/evt\n"
        "topic read wren/v1/h/acme/+/json/#\n"
        "topic read wren/v1/h/acme/+/u/+/evt\n"
        "topic read wren/v1/h/acme/+/u/+/json/#\n"
        "topic write wren/v1/h/acme/+/req\n"
        "topic write wren/v1/h/acme/+/ctl\n"
    )
    for bad in (
        ("wren/#", "bridge", {}),
        (P, "bad user", {}),
        (P, "bridge", {"Acme": "h"}),
        (P, "bridge", {"acme": "bridge"}),
        (P, ["bridge", "b2"], {"acme": ["h1", "b2"]}),
        (P, "bridge", {"acme": "bridge.ctl"}),  # the bridge's control user
        (P, "bridge", {"acme": "bridge.l2"}),  # one of its link users
        (P, "b" * 125, {}),  # no room for its control user's name
        (P, [], {}),
        (P, "bridge", {"acme": []}),
    ):
        with pytest.raises(ValueError):
            brokerconf.acl_text(*bad)  # type: ignore[arg-type]


def test_acl_text_takes_a_user_per_connection() -> None:
    # With client ids bound to users, each bridge process and each host connection has a
    # user of its own; each gets the same rights as the one user did.
    # A host user bound to one end user reads the device topics and that user's runs
    # alone (PROTOCOL.md "Who sees what"); never `req` or `ctl`, which carry tokens.
    text = brokerconf.acl_text(
        P, ["bridge-b", "bridge"], {"acme": ["host-acme-2", "host-acme"]},
        {"host-acme-2": "bob.b@example.com"},
    )  # fmt: skip
    blocks = text.split("\n\n")[3:]
    assert blocks == [
        "# The bridge.\nuser bridge\ntopic readwrite wren/v1/#",
        "# The bridge.\nuser bridge-b\ntopic readwrite wren/v1/#",
        *(f"# The bridge.\nuser bridge-b{x}\ntopic readwrite wren/v1/#" for x in LINK_USERS),
        *(f"# The bridge.\nuser bridge{x}\ntopic readwrite wren/v1/#" for x in LINK_USERS),
        "# Hosts of tenant acme: a watcher.\nuser host-acme\n"
        "topic read wren/v1/h/acme/+/evt\n"
        "topic read wren/v1/h/acme/+/json/#\n"
        "topic read wren/v1/h/acme/+/u/+/evt\n"
        "topic read wren/v1/h/acme/+/u/+/json/#\n"
        "topic write wren/v1/h/acme/+/req\n"
        "topic write wren/v1/h/acme/+/ctl",
        "# Hosts of tenant acme: bound to user bob.b@example.com.\nuser host-acme-2\n"
        "topic read wren/v1/h/acme/+/evt\n"
        "topic read wren/v1/h/acme/+/json/#\n"
        "topic read wren/v1/h/acme/+/u/bob.b@example.com/evt\n"
        "topic read wren/v1/h/acme/+/u/bob.b@example.com/json/#\n"
        "topic write wren/v1/h/acme/+/req\n"
        "topic write wren/v1/h/acme/+/ctl\n",
    ]
    # Bound: only a host user, only to an end-user id a topic level can hold.
    for bound in ({"bridge": "bob"}, {"nobody": "bob"}, {"host-acme": "a/b"},
                  {"host-acme": "+"}, {"host-acme": "_"}, {"host-acme": "b" * 65}):  # fmt: skip
        with pytest.raises(ValueError):
            brokerconf.acl_text(P, "bridge", {"acme": "host-acme"}, bound)


def test_the_configuration_binds_client_ids_to_users(tmp_path: Path) -> None:
    lines = brokerconf.secure_mosquitto_conf(tmp_path, {"u": "p"}, "").splitlines()
    assert "use_username_as_clientid true" in lines


# --- the dynamic security plugin's file ------------------------------------------------


def _acls(document: dict[str, Any], role: str) -> list[tuple[str, str]]:
    [found] = [r for r in document["roles"] if r["rolename"] == role]
    assert all(acl["allow"] is True for acl in found["acls"])
    return [(acl["acltype"], acl["topic"]) for acl in found["acls"]]


def _reads(topic: str, kind: str = "Literal") -> list[tuple[str, str]]:
    return [
        ("publishClientReceive", topic),
        (f"subscribe{kind}", topic),
        (f"unsubscribe{kind}", topic),
    ]


def test_dynsec_config_is_exactly_the_wren_rules() -> None:
    users = ("bridge", "bridge-b", "dev1", "host-acme", "host-acme-2", "host-other")
    entries = brokerconf.with_control_users(
        {user: brokerconf.hash_password(user) for user in users}, ["bridge", "bridge-b"]
    )
    doc = brokerconf.dynsec_config(
        P, ["bridge", "bridge-b"], {"acme": ["host-acme", "host-acme-2"], "other": "host-other"},
        entries, {"host-acme-2": "bob"},
    )  # fmt: skip
    # Whatever no role grants is denied, unsubscribing too.
    assert doc["defaultACLAccess"] == {
        "publishClientSend": False,
        "publishClientReceive": False,
        "subscribe": False,
        "unsubscribe": False,
    }
    assert {c["username"]: [r["rolename"] for r in c["roles"]] for c in doc["clients"]} == {
        "bridge": ["bridge"],
        "bridge-b": ["bridge"],
        # Each bridge user's control and link users: the bridge's role, its password.
        **{f"{b}{suffix}": ["bridge"] for b in ("bridge", "bridge-b")
           for suffix in (".ctl", ".l1", ".l2", ".l3")},
        "dev1": ["device-dev1", "presence"],
        # A watcher reads every user's runs of its tenant; a bound host user one's.
        "host-acme": ["tenant-acme", "watch-acme", "presence"],
        "host-acme-2": ["tenant-acme", "user-acme-bob", "presence"],
        "host-other": ["tenant-other", "watch-other", "presence"],
    }
    assert [r["rolename"] for r in doc["roles"]] == [
        "bridge", "device-dev1", "presence", "tenant-acme", "tenant-other", "user-acme-bob",
        "watch-acme", "watch-other",
    ]  # fmt: skip
    assert _acls(doc, "bridge") == [
        *_reads("wren/v1/#", "Pattern"),
        ("publishClientSend", "wren/v1/#"),
        ("subscribePattern", "$share/+/wren/v1/#"),
        ("unsubscribePattern", "$share/+/wren/v1/#"),
    ]
    assert _acls(doc, "device-dev1") == [
        *_reads("wren/v1/d/dev1/req"),
        *_reads("wren/v1/d/dev1/ctl"),
        *_reads("wren/v1/d/dev1/rpc/res"),
        ("publishClientSend", "wren/v1/d/dev1/status"),
        ("publishClientSend", "wren/v1/d/dev1/hello"),
        ("publishClientSend", "wren/v1/d/dev1/evt"),
        ("publishClientSend", "wren/v1/d/dev1/rpc"),
    ]
    assert _acls(doc, "tenant-acme") == [
        *_reads("wren/v1/h/acme/+/evt", "Pattern"),
        *_reads("wren/v1/h/acme/+/json/#", "Pattern"),
        ("publishClientSend", "wren/v1/h/acme/+/req"),
        ("publishClientSend", "wren/v1/h/acme/+/ctl"),
    ]
    assert _acls(doc, "watch-acme") == [*_reads("wren/v1/h/acme/+/u/+/evt", "Pattern"),
                                        *_reads("wren/v1/h/acme/+/u/+/json/#", "Pattern")]
    assert _acls(doc, "user-acme-bob") == [*_reads("wren/v1/h/acme/+/u/bob/evt", "Pattern"),
                                           *_reads("wren/v1/h/acme/+/u/bob/json/#", "Pattern")]
    assert _acls(doc, "presence") == _reads("wren/v1/b/status")
    # Each password as the registry stored it, in the plugin's fields.
    for client in doc["clients"]:
        entry = f"$7${client['iterations']}${client['salt']}${client['password']}"
        assert entry == entries[client["username"]]
    # A user without an entry cannot log in: it has no client.
    assert "host-acme-2" not in {
        c["username"] for c in brokerconf.dynsec_config(
            P, "bridge", {"acme": ["host-acme", "host-acme-2"]},
            {u: entries[u] for u in ("bridge", "host-acme")},
        )["clients"]
    }  # fmt: skip
    fields = entries["dev1"].split("$")
    short_salt = "$".join([*fields[:3], base64.b64encode(b"8 bytes!").decode(), fields[4]])
    for bad in (
        ("wren/#", "bridge", {}, {}),
        (P, "bridge", {"acme": "bridge"}, {}),
        (P, "bridge", {}, {"dev1": "a plain password"}),
        (P, "bridge", {}, {"a b": entries["dev1"]}),
        # The plugin would skip such a client without a word.
        (P, "bridge", {}, {"dev1": short_salt}),
    ):
        with pytest.raises(ValueError):
            brokerconf.dynsec_config(*bad)  # type: ignore[arg-type]


def test_dynsec_passwords_are_what_mosquitto_ctrl_stores(tmp_path: Path) -> None:
    exe = shutil.which("mosquitto_ctrl") or "/usr/bin/mosquitto_ctrl"
    if not Path(exe).exists():
        pytest.skip("mosquitto_ctrl is not installed")
    path = tmp_path / "dynsec.json"
    subprocess.run([exe, "dynsec", "init", str(path), "admin", "s3cret pass"],
                   check=True, timeout=30, capture_output=True)  # fmt: skip
    [theirs] = json.loads(path.read_text())["clients"]
    entry = brokerconf.hash_password(
        "s3cret pass", base64.b64decode(theirs["salt"]), theirs["iterations"]
    )
    [ours] = brokerconf.dynsec_config(P, "admin", {}, {"admin": entry})["clients"]
    assert {k: ours[k] for k in ("password", "salt", "iterations")} == {
        k: theirs[k] for k in ("password", "salt", "iterations")
    }


def test_dynsec_mosquitto_conf_loads_the_plugin_with_the_file(tmp_path: Path) -> None:
    doc = brokerconf.dynsec_config(P, "bridge", {}, {"bridge": brokerconf.hash_password("b")})
    plugin = tmp_path / brokerconf.DYNSEC_PLUGIN
    plugin.touch()
    conf = brokerconf.dynsec_mosquitto_conf(tmp_path / "broker", doc, 18830, "127.0.0.1", plugin)
    directory = (tmp_path / "broker").resolve()
    options = [line for line in conf.read_text().splitlines() if not line.startswith("#")]
    assert options[:2] == ["listener 18830 127.0.0.1", "allow_anonymous false"]
    for line in (
        f"plugin {plugin}",
        f"plugin_opt_config_file {directory / 'dynsec.json'}",
        "use_username_as_clientid true",
        "set_tcp_nodelay true",
        "persistence true",
        *brokerconf.BROKER_QUEUES.splitlines(),
    ):
        assert line in options
    assert not [line for line in options if line.startswith(("password_file", "acl_file"))]
    written = tmp_path / "broker" / "dynsec.json"
    assert json.loads(written.read_text()) == doc
    assert written.stat().st_mode & 0o777 == 0o600
    assert "then restart Mosquitto" in conf.read_text()


def test_a_missing_dynsec_plugin_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(brokerconf.DYNSEC_PLUGIN_ENV, raising=False)
    with pytest.raises(FileNotFoundError) as e:
        brokerconf.dynsec_plugin([tmp_path / "a", tmp_path / "b"])
    assert str(e.value) == (
        f"Mosquitto's dynamic security plugin mosquitto_dynamic_security.so is not in "
        f"{tmp_path / 'a'}, {tmp_path / 'b'}: install Mosquitto 2 (`apt-get install "
        f"mosquitto`) or name the file in WREN_MOSQUITTO_DYNSEC"
    )
    (tmp_path / "b" / brokerconf.DYNSEC_PLUGIN).parent.mkdir()
    (tmp_path / "b" / brokerconf.DYNSEC_PLUGIN).touch()
    found = brokerconf.dynsec_plugin([tmp_path / "a", tmp_path / "b"])
    assert found == tmp_path / "b" / brokerconf.DYNSEC_PLUGIN
    monkeypatch.setenv(brokerconf.DYNSEC_PLUGIN_ENV, str(tmp_path / "nowhere.so"))
    with pytest.raises(FileNotFoundError, match=r"^WREN_MOSQUITTO_DYNSEC=.*nowhere.so: no such"):
        brokerconf.dynsec_plugin([tmp_path / "b"])
    # Nothing is written when the plugin is missing.
    with pytest.raises(FileNotFoundError):
        brokerconf.dynsec_mosquitto_conf(tmp_path / "broker", {})
    assert not (tmp_path / "broker").exists()


# --- enforced by a real broker ----------------------------------------------------------------


class Client:
    def __init__(
        self,
        host: str,
        port: int,
        user: str | None,
        password: str | None,
        client_id: str | None = None,
        clean_session: bool = True,
        protocol: int = paho.MQTTv311,
    ) -> None:
        self.messages: queue.Queue[paho.MQTTMessage] = queue.Queue()
        self.connacks: queue.Queue[Any] = queue.Queue()
        self.subacks: queue.Queue[Any] = queue.Queue()
        self.disconnects: queue.Queue[Any] = queue.Queue()
        self.c = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=client_id or f"t-{user}",
            protocol=protocol,
            # MQTT 5 has clean start instead, at connect (paho refuses clean_session).
            clean_session=None if protocol == paho.MQTTv5 else clean_session,
        )
        if user is not None:
            self.c.username_pw_set(user, password)
        self.c.on_connect = lambda c, u, flags, rc, props: self.connacks.put(rc)
        self.c.on_subscribe = lambda c, u, mid, rcs, props: self.subacks.put(rcs)
        self.c.on_message = lambda c, u, msg: self.messages.put(msg)
        self.c.on_disconnect = lambda c, u, flags, rc, props: self.disconnects.put(rc)
        self.c.connect(host, port, keepalive=30)
        self.c.loop_start()
        self.rc = self.connacks.get(timeout=TIMEOUT_S)

    def subscribe(self, topic: str) -> list[Any]:
        """Subscribe at QoS 1; the SUBACK's reason codes."""
        self.c.subscribe(topic, 1)
        return list(self.subacks.get(timeout=TIMEOUT_S))

    def suback(self, topic: str) -> list[int]:
        """Subscribe at QoS 1; the SUBACK's raw reason codes, as the broker sent them."""
        return [rc.value for rc in self.subscribe(topic)]

    def publish(self, topic: str, payload: bytes) -> None:
        self.c.publish(topic, payload, 1).wait_for_publish(TIMEOUT_S)

    def until(self, payload: bytes) -> list[tuple[str, bytes]]:
        """Every message up to and including the first with `payload`: a marker sent
        after the messages that must NOT arrive proves they did not."""
        got = []
        while True:
            msg = self.messages.get(timeout=TIMEOUT_S)
            got.append((msg.topic, bytes(msg.payload)))
            if msg.payload == payload:
                return got

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@dataclass
class Secured:
    host: str
    port: int
    clients: list[Client]
    broker: MosquittoProcess
    access: str  # one of ACCESS

    def connect(self, user: str | None, password: str | None = None, **kw: Any) -> Client:
        if user is not None and password is None:
            password = USERS[user]
        c = Client(self.host, self.port, user, password, **kw)
        self.clients.append(c)
        return c

    def login(self, user: str, **kw: Any) -> Client:
        c = self.connect(user, **kw)
        assert not c.rc.is_failure, (user, c.rc)
        return c


def access_conf(access: str, directory: Path, users: dict[str, str]) -> str:
    """The configuration lines of USERS' rights (and the observer's) under `access`; the
    bridge's control user logs in with the bridge's password."""
    users = brokerconf.with_control_users(users, ["bridge"])
    if access == "acl_file":
        acl = brokerconf.acl_text(P, "bridge", TENANTS, BOUND) + OBSERVER_ACL
        return brokerconf.secure_mosquitto_conf(directory, users, acl)
    entries = {user: brokerconf.hash_password(pw) for user, pw in users.items()}
    doc = brokerconf.dynsec_config(P, "bridge", TENANTS, entries, BOUND)
    # The observer is a device to the rules (the ACL's %u makes it one too), and reads all.
    doc["roles"].append(OBSERVER_ROLE)
    [observer] = [c for c in doc["clients"] if c["username"] == "observer"]
    observer["roles"].append({"rolename": "observer"})
    return brokerconf.write_dynsec_files(directory, doc)


@pytest.fixture(params=ACCESS)
def secured(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Secured]:
    extra = access_conf(request.param, tmp_path / "conf", USERS)
    m = start_mosquitto(tmp_path / "mosquitto", extra_conf=extra, allow_anonymous=False)
    s = Secured(m.host, m.port, [], m, request.param)
    try:
        yield s
    finally:
        for c in s.clients:
            c.close()
        m.stop()


def test_wrong_password_and_strangers_are_refused(secured: Secured) -> None:
    assert secured.connect("dev1", "not-the-password").rc.is_failure
    assert secured.connect("nobody", "dev1-pw").rc.is_failure
    assert secured.connect(None).rc.is_failure
    assert not secured.connect("dev1").rc.is_failure


def test_the_bridges_control_user_has_the_bridges_rights_and_no_others(
    secured: Secured,
) -> None:
    ctl = brokerconf.control_user("bridge")
    # No one else's password opens it.
    for password in ("dev1-pw", "acme-pw", "not-the-password"):
        assert secured.connect(ctl, password).rc.is_failure
    bridge = secured.login(ctl, password=USERS["bridge"])
    # What the control connection reads: boards' calls, hosts' requests and control.
    for topic in (f"{P}/d/+/rpc", f"{P}/h/+/+/req", f"{P}/h/+/+/ctl", f"{P}/b/status"):
        assert bridge.suback(topic) == [GRANTED_1]
    if secured.access == "dynsec":
        assert bridge.suback("elsewhere/#") == [REFUSED_311]  # nothing outside the prefix
    dev1 = secured.login("dev1")
    dev1.subscribe(f"{P}/d/dev1/rpc/res")
    dev1.subscribe(f"{P}/d/dev1/req")
    host = secured.login("host-acme")
    host.subscribe(f"{P}/h/acme/+/evt")
    host.subscribe(f"{P}/b/status")
    observer = secured.login("observer")
    observer.subscribe("#")
    dev1.publish(f"{P}/d/dev1/rpc", b"a call")
    host.publish(f"{P}/h/acme/dev1/req", b"a request")
    assert bridge.until(b"a request") == [
        (f"{P}/d/dev1/rpc", b"a call"),
        (f"{P}/h/acme/dev1/req", b"a request"),
    ]
    # What it writes: answers and requests to boards, `_b` to hosts, the presence.
    bridge.publish(f"{P}/d/dev1/rpc/res", b"an answer")
    bridge.publish(f"{P}/d/dev1/req", b"the request")
    assert dev1.until(b"the request") == [
        (f"{P}/d/dev1/rpc/res", b"an answer"),
        (f"{P}/d/dev1/req", b"the request"),
    ]
    bridge.publish(f"{P}/h/acme/dev1/evt", b"a notice")
    bridge.c.publish(f"{P}/b/status", b"online", 1, retain=True).wait_for_publish(TIMEOUT_S)
    assert host.until(b"online") == [
        (f"{P}/h/acme/dev1/evt", b"a notice"),
        (f"{P}/b/status", b"online"),
    ]
    # Nothing outside the prefix: the observer sees the marker after it and not it.
    bridge.publish("elsewhere/x", b"outside")
    bridge.publish(f"{P}/d/dev1/ctl", b"marker")
    assert [m for m in observer.until(b"marker") if m[1] in (b"outside", b"marker")] == [
        (f"{P}/d/dev1/ctl", b"marker")
    ]


def test_device_writes_only_its_own_outgoing_topics(secured: Secured) -> None:
    bridge = secured.login("bridge")
    bridge.subscribe(f"{P}/#")
    dev1 = secured.login("dev1")
    dev1.publish(f"{P}/d/dev1/evt", b"own evt")
    dev1.publish(f"{P}/d/dev2/evt", b"forged evt")  # another device's topic
    dev1.publish(f"{P}/d/dev1/req", b"self-made req")  # only the bridge sends req
    dev1.publish(f"{P}/d/dev1/rpc/res", b"self-made answer")
    dev1.publish(f"{P}/d/dev1/hello", b"marker")
    assert bridge.until(b"marker") == [
        (f"{P}/d/dev1/evt", b"own evt"),
        (f"{P}/d/dev1/hello", b"marker"),
    ]


def test_only_the_bridge_reaches_a_device_and_only_that_device(secured: Secured) -> None:
    dev1 = secured.login("dev1")
    dev1.subscribe(f"{P}/d/dev1/req")
    dev1.subscribe(f"{P}/d/dev2/req")  # refused or never served: either way nothing comes
    dev2 = secured.login("dev2")
    dev2.publish(f"{P}/d/dev1/req", b"from a neighbour")
    bridge = secured.login("bridge")
    bridge.publish(f"{P}/d/dev2/req", b"for dev2")
    bridge.publish(f"{P}/d/dev1/req", b"for dev1")
    assert dev1.until(b"for dev1") == [(f"{P}/d/dev1/req", b"for dev1")]


def test_host_users_stay_in_their_tenant(secured: Secured) -> None:
    bridge = secured.login("bridge")
    bridge.subscribe(f"{P}/h/+/+/req")
    host = secured.login("host-acme")
    # Wider than allowed: the acl_file grants it and serves only acme's events on it; the
    # dynamic security plugin refuses it, and the host asks for its own.
    wide = host.suback(f"{P}/h/+/+/evt")
    if secured.access == "dynsec":
        assert wide == [REFUSED_311]
        assert host.suback(f"{P}/h/acme/+/evt") == [GRANTED_1]
    else:
        assert wide == [GRANTED_1]
    bridge.publish(f"{P}/h/other/dev9/evt", b"other tenant's event")
    bridge.publish(f"{P}/h/acme/dev1/evt", b"acme event")
    assert host.until(b"acme event") == [(f"{P}/h/acme/dev1/evt", b"acme event")]
    host.publish(f"{P}/h/other/dev9/req", b"into another tenant")
    host.publish(f"{P}/d/dev1/req", b"straight to the device")
    host.publish(f"{P}/h/acme/dev1/req", b"acme request")
    assert bridge.until(b"acme request") == [(f"{P}/h/acme/dev1/req", b"acme request")]


def test_everyone_reads_the_bridge_presence_and_only_the_bridge_writes_it(
    secured: Secured,
) -> None:
    status = f"{P}/b/status"
    bridge = secured.login("bridge")
    # Retained, and sent before anyone subscribed: readers get it when they subscribe.
    bridge.c.publish(status, b"retained online", 1, retain=True).wait_for_publish(TIMEOUT_S)
    dev1 = secured.login("dev1")
    host = secured.login("host-acme")
    for reader in (dev1, host):
        reader.subscribe(status)
        assert reader.until(b"retained online") == [(status, b"retained online")]
    # Neither a device nor a host may speak for the bridge: the bridge's marker is the
    # first thing that reaches the readers after their attempts.
    dev1.publish(status, b"forged by a device")
    host.publish(status, b"forged by a host")
    bridge.publish(status, b"marker")
    for reader in (dev1, host):
        assert reader.until(b"marker") == [(status, b"marker")]


# Each (user, topic, write): True a publish, False a subscription. The rules of
# brokerconf's docstring, one right at a time.
ALLOWED = [
    ("bridge", "wren/v1/d/dev1/req", True),
    ("bridge", "wren/v1/h/acme/dev1/evt", True),
    ("dev1", "wren/v1/d/dev1/evt", True),
    ("dev1", "wren/v1/d/dev1/rpc", True),
    ("dev1", "wren/v1/d/dev1/status", True),
    ("dev1", "wren/v1/d/dev1/req", False),
    ("dev1", "wren/v1/d/dev1/rpc/res", False),
    ("host-acme", "wren/v1/h/acme/dev1/evt", False),
    ("host-acme", "wren/v1/h/acme/dev1/req", True),
    ("host-acme", "wren/v1/h/acme/dev1/ctl", True),
    ("bridge", "wren/v1/b/status", True),
    ("bridge", "wren/v1/b/status", False),
    ("dev1", "wren/v1/b/status", False),
    ("host-acme", "wren/v1/b/status", False),
]
DENIED = [
    ("dev1", "wren/v1/d/dev2/evt", True),
    ("dev1", "wren/v1/d/dev1/req", True),
    ("dev1", "wren/v1/d/dev1/evt", False),
    ("dev1", "wren/v1/d/dev2/req", False),
    ("dev1", "wren/v1/d/dev1/rpc/res", True),
    ("dev1", "other/x", True),
    ("host-acme", "wren/v1/h/other/dev1/evt", False),
    ("host-acme", "wren/v1/h/acme/dev1/evt", True),
    ("host-acme", "wren/v1/d/dev1/req", True),
    (None, "wren/v1/d/dev1/evt", True),
    ("bridge", "elsewhere/x", True),
    ("dev1", "wren/v1/b/status", True),
    ("host-acme", "wren/v1/b/status", True),
    (None, "wren/v1/b/status", False),
    ("dev1", "wren/v1/b/other", False),
    ("host-acme", "wren/v1/b/status/x", False),
]
# Where each user ends its attempts with a marker it may certainly send (to the
# observer) or receive (from the bridge): what did not arrive before the marker never
# will.
MARKER_WRITE = {
    "bridge": f"{P}/d/dev1/req",
    "dev1": f"{P}/d/dev1/hello",
    "host-acme": f"{P}/h/acme/dev1/req",
}
MARKER_READ = {
    "bridge": f"{P}/d/dev1/evt",
    "dev1": f"{P}/d/dev1/req",
    "host-acme": f"{P}/h/acme/dev1/evt",
}


Check = tuple[str | None, str, bool]


def granted(secured: Secured, checks: list[Check]) -> tuple[set[Check], set[Check]]:
    """The checks the broker grants, seen from outside: a write is granted when the
    observer receives it, a read when the user receives what the bridge publishes there.
    Payloads carry the attempt's tag, so a message of an earlier attempt still queued
    for the same reader is not counted again. Also the reads whose subscription the
    SUBACK refused."""
    got: set[Check] = set()
    refused: set[Check] = set()
    clients = {"observer": secured.login("observer"), "bridge": secured.login("bridge")}
    clients["observer"].subscribe("#")
    for user in sorted({u for u, _, _ in checks if u is not None} - clients.keys()):
        clients[user] = secured.login(user)  # once: a second login would take its client id
    for user, write in sorted({(u, w) for u, _, w in checks}, key=repr):
        topics = [t for u, t, w in checks if u == user and w == write]
        if user is None:
            # Anonymous: refused at CONNECT, so it neither reads nor writes anything.
            assert secured.connect(None).rc.is_failure
            continue
        tag = f"{user} {'writes' if write else 'reads'}"
        if write:
            sender, reader, marker_topic = clients[user], clients["observer"], MARKER_WRITE[user]
        else:
            sender, reader, marker_topic = clients["bridge"], clients[user], MARKER_READ[user]
            for topic in topics:
                if any(rc.is_failure for rc in reader.subscribe(topic)):
                    refused.add((user, topic, write))
            assert reader.suback(marker_topic) == [GRANTED_1]
        for topic in topics:
            sender.publish(topic, f"{tag} {topic}".encode())
        marker = f"{tag} marker".encode()
        sender.publish(marker_topic, marker)
        for topic, payload in reader.until(marker):
            if payload == f"{tag} {topic}".encode():
                got.add((user, topic, write))
    return got, refused


def test_mosquitto_grants_exactly_the_listed_rights(secured: Secured) -> None:
    got, refused = granted(secured, ALLOWED + DENIED)
    assert sorted(set(ALLOWED) - got, key=repr) == [], "refused although allowed"
    assert sorted(got & set(DENIED), key=repr) == [], "granted although denied"
    # The acl_file grants every subscription in SUBACK; the dynamic security plugin
    # refuses exactly the denied reads there.
    denied_reads = {(u, t, w) for u, t, w in DENIED if u is not None and not w}
    assert refused == (denied_reads if secured.access == "dynsec" else set())


# --- identity: client ids bound to users -----------------------------------------------------

# Mosquitto's log line when a connection takes over a client id in use.
TAKEOVER = "already connected, closing old connection"


def test_no_other_user_can_take_a_devices_client_id(secured: Secured) -> None:
    # The board: a persistent session under its device id, as edge_runtime connects.
    dev1 = secured.login("dev1", client_id="dev1", clean_session=False)
    dev1.subscribe(f"{P}/d/dev1/req")
    bridge = secured.login("bridge", client_id="dev1")
    # Another tenant's host (and a neighbouring device) claim the board's client id, ten
    # times. Each CONNACK comes after the broker dealt with the id: a takeover would be
    # done (and logged) by then.
    for n in range(10):
        attacker = secured.login("host-other" if n % 2 else "dev2", client_id="dev1")
        attacker.close()
    assert TAKEOVER not in secured.broker.log()
    assert dev1.disconnects.empty()
    # The board's connection still works: the bridge reaches it (a bridge that had taken
    # the id, as it asked to, would have cut the board off instead).
    bridge.publish(f"{P}/d/dev1/req", b"still here")
    assert dev1.until(b"still here") == [(f"{P}/d/dev1/req", b"still here")]
    # The log names every connection by its user, whatever id it sent.
    assert "as dev1 (p2, c0, k30, u'dev1')" in secured.broker.log()
    assert "as host-other (p2, c1, k30, u'host-other')" in secured.broker.log()


def test_a_second_connection_of_one_user_takes_over_the_first(secured: Secured) -> None:
    # Why each host connection (and each bridge process) needs a user of its own.
    first = secured.login("host-acme", client_id="one")
    secured.login("host-acme", client_id="two")
    first.disconnects.get(timeout=TIMEOUT_S)
    assert TAKEOVER in secured.broker.log()


@pytest.mark.parametrize("secured", ["acl_file"], indirect=True)
def test_a_denied_subscription_is_granted_in_suback_and_delivers_nothing(
    secured: Secured,
) -> None:
    """Mosquitto's acl_file (2.0.11) does not check a subscription against the ACL: the
    SUBACK grants it and the ACL is applied to each message instead. PROTOCOL.md says
    so; if a Mosquitto refuses here (0x80), update it."""
    bridge = secured.login("bridge")
    dev1 = secured.login("dev1")
    host = secured.login("host-acme")
    denied = [
        (dev1, f"{P}/d/dev2/req"),
        (dev1, f"{P}/d/+/req"),
        (dev1, f"{P}/#"),
        (host, f"{P}/h/other/+/evt"),
        (host, f"{P}/d/+/req"),
    ]
    codes = {topic: reader.subscribe(topic) for reader, topic in denied}
    assert all(not rc.is_failure for rcs in codes.values() for rc in rcs), codes
    # Messages those filters match on topics neither reader may read.
    bridge.publish(f"{P}/d/dev2/req", b"denied")
    bridge.publish(f"{P}/h/other/dev2/evt", b"denied")
    # Markers each reader may read, sent after: what was denied would have come first.
    dev1.subscribe(f"{P}/d/dev1/req")
    host.subscribe(f"{P}/h/acme/dev1/evt")
    bridge.publish(f"{P}/d/dev1/req", b"marker")
    bridge.publish(f"{P}/h/acme/dev1/evt", b"marker")
    assert dev1.until(b"marker") == [(f"{P}/d/dev1/req", b"marker")]
    assert host.until(b"marker") == [(f"{P}/h/acme/dev1/evt", b"marker")]


def test_a_host_bound_to_one_user_reads_no_other_users_runs(secured: Secured) -> None:
    """Who sees what (PROTOCOL.md): a host user bound to bob reads its tenant's device
    topics and bob's runs, never alice's, however it subscribes; a watcher reads both.
    Under the acl_file the wider filters are granted and deliver only bob's; the plugin
    refuses them in SUBACK."""
    bridge = secured.login("bridge")
    bob = secured.login("host-bob")
    watcher = secured.login("host-acme")
    wide = [
        f"{P}/h/acme/+/u/+/evt",
        f"{P}/h/acme/+/u/alice/evt",
        f"{P}/h/acme/#",
        f"{P}/h/acme/dev1/req",  # other users' tokens go there
        f"{P}/h/acme/dev1/ctl",
    ]
    codes = [bob.suback(topic) for topic in wide]
    if secured.access == "dynsec":
        assert codes == [[REFUSED_311]] * len(wide)
    else:
        assert codes == [[GRANTED_1]] * len(wide)
    assert bob.suback(f"{P}/h/acme/+/u/bob/evt") == [GRANTED_1]
    assert bob.suback(f"{P}/h/acme/+/evt") == [GRANTED_1]
    assert watcher.suback(f"{P}/h/acme/+/u/+/evt") == [GRANTED_1]
    assert watcher.suback(f"{P}/h/acme/+/evt") == [GRANTED_1]
    # Alice's run, a token on req, then bob's run and the device's stream: bob gets the
    # last two alone, the watcher every event.
    bridge.publish(f"{P}/h/acme/dev1/u/alice/evt", b"alice's event")
    bridge.publish(f"{P}/h/acme/dev1/u/_/evt", b"a run of no known user")
    bridge.publish(f"{P}/h/acme/dev1/req", b"alice's token")
    bridge.publish(f"{P}/h/acme/dev1/u/bob/evt", b"bob's event")
    bridge.publish(f"{P}/h/acme/dev1/evt", b"marker")
    assert bob.until(b"marker") == [
        (f"{P}/h/acme/dev1/u/bob/evt", b"bob's event"),
        (f"{P}/h/acme/dev1/evt", b"marker"),
    ]
    assert watcher.until(b"marker") == [
        (f"{P}/h/acme/dev1/u/alice/evt", b"alice's event"),
        (f"{P}/h/acme/dev1/u/_/evt", b"a run of no known user"),
        (f"{P}/h/acme/dev1/u/bob/evt", b"bob's event"),
        (f"{P}/h/acme/dev1/evt", b"marker"),
    ]


# --- the dynamic security plugin: refused in SUBACK -------------------------------------------


@pytest.mark.parametrize("secured", ["dynsec"], indirect=True)
def test_dynsec_refuses_a_denied_subscription_in_suback(secured: Secured) -> None:
    """The dynamic security plugin checks a subscription against the user's roles and
    refuses what they do not grant (0x80 under MQTT 3.1.1): a client learns at once, and
    the broker keeps no subscription that could only deliver nothing."""
    clients = {user: secured.login(user) for user in ("bridge", "dev1", "host-acme")}
    bridge, dev1, host = clients.values()
    denied = [
        ("dev1", f"{P}/d/dev2/req"),  # another device's
        ("dev1", f"{P}/d/+/req"),
        ("dev1", f"{P}/d/dev1/#"),  # wider than its own, though all it matches is its own
        ("dev1", f"{P}/d/dev1/evt"),  # its own, but one it writes
        ("dev1", f"{P}/#"),
        ("dev1", "#"),
        ("dev1", f"$share/g/{P}/d/dev1/req"),
        ("dev1", f"{P}/h/acme/+/evt"),
        ("host-acme", f"{P}/h/other/+/evt"),  # another tenant's
        ("host-acme", f"{P}/h/other/dev2/evt"),
        ("host-acme", f"{P}/h/+/+/evt"),
        ("host-acme", f"{P}/h/acme/+/req"),  # its own tenant's, but one it writes
        ("host-acme", f"{P}/d/+/req"),
        ("host-acme", f"{P}/#"),
        ("bridge", "elsewhere/#"),
        ("bridge", "#"),
    ]
    codes = {(user, topic): clients[user].suback(topic) for user, topic in denied}
    assert {k: v for k, v in codes.items() if v != [REFUSED_311]} == {}
    own = [
        ("dev1", f"{P}/d/dev1/req"),
        ("dev1", f"{P}/d/dev1/ctl"),
        ("dev1", f"{P}/d/dev1/rpc/res"),
        ("dev1", f"{P}/b/status"),
        ("host-acme", f"{P}/h/acme/+/evt"),
        ("host-acme", f"{P}/b/status"),
        ("bridge", f"{P}/d/+/evt"),
        ("bridge", f"$share/bridge/{P}/d/+/rpc"),  # the bridge's shared_subscription
    ]
    codes = {(user, topic): clients[user].suback(topic) for user, topic in own}
    assert {k: v for k, v in codes.items() if v != [GRANTED_1]} == {}
    # What the refused filters would have matched, then markers on their own topics.
    bridge.publish(f"{P}/d/dev2/req", b"denied")
    bridge.publish(f"{P}/h/other/dev2/evt", b"denied")
    bridge.publish(f"{P}/d/dev1/req", b"marker")
    bridge.publish(f"{P}/d/dev1/rpc/res", b"answer")
    bridge.publish(f"{P}/h/acme/dev1/evt", b"marker")
    assert dev1.until(b"answer") == [
        (f"{P}/d/dev1/req", b"marker"),
        (f"{P}/d/dev1/rpc/res", b"answer"),
    ]
    assert host.until(b"marker") == [(f"{P}/h/acme/dev1/evt", b"marker")]
    dev1.publish(f"{P}/d/dev1/rpc", b"call")
    dev1.publish(f"{P}/d/dev1/evt", b"event")
    assert bridge.until(b"event") == [(f"{P}/d/dev1/rpc", b"call"), (f"{P}/d/dev1/evt", b"event")]


@pytest.mark.parametrize("secured", ["dynsec"], indirect=True)
def test_dynsec_refuses_a_denied_subscription_in_mqtt5_suback(secured: Secured) -> None:
    dev1 = secured.login("dev1", protocol=paho.MQTTv5)
    host = secured.login("host-other", protocol=paho.MQTTv5)
    assert dev1.suback(f"{P}/d/dev2/req") == [NOT_AUTHORIZED_5]
    assert host.suback(f"{P}/h/acme/+/evt") == [NOT_AUTHORIZED_5]
    assert dev1.suback(f"{P}/d/dev1/req") == [GRANTED_1]
    assert host.suback(f"{P}/h/other/+/evt") == [GRANTED_1]


@pytest.mark.parametrize("secured", ["dynsec"], indirect=True)
def test_dynsec_takes_new_users_at_a_restart_not_at_sighup(
    secured: Secured, tmp_path: Path
) -> None:
    """Mosquitto 2.0.11 reloads neither the plugin nor its file on SIGHUP: the registry's
    changes reach a broker using dynsec at its restart (brokerconf.write_dynsec_files)."""
    access_conf("dynsec", tmp_path / "conf", {**USERS, "dev3": "dev3-pw"})
    offset = len(secured.broker.log())
    secured.broker.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + TIMEOUT_S
    while "Reloading config" not in secured.broker.log()[offset:]:
        assert time.monotonic() < deadline, secured.broker.log()
        time.sleep(0.05)
    # The reload is done before the broker reads another packet.
    assert secured.connect("dev3", "dev3-pw").rc.is_failure
    assert not secured.connect("dev1").rc.is_failure
    secured.broker.restart()
    assert not secured.connect("dev3", "dev3-pw").rc.is_failure


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="what root's broker files do"
)
def test_broker_files_written_as_root_start_mosquitto_as_its_own_user(tmp_path: Path) -> None:
    import pwd

    try:
        owner = pwd.getpwnam(brokerconf.BROKER_USER)
    except KeyError:
        pytest.skip("no mosquitto user on this machine")
    exe = mosquitto_binary()
    assert exe is not None
    # pytest's tmp_path is private (0700): a directory Mosquitto's user can reach.
    shared = Path(tempfile.mkdtemp(prefix="wren-brokerconf-", dir="/tmp"))
    try:
        os.chmod(shared, 0o755)
        entries = {"bridge": brokerconf.hash_password("b")}
        acl = brokerconf.acl_text(P, "bridge", {})
        port = free_port()
        conf = brokerconf.mosquitto_conf(shared / "broker", entries, acl, port, "127.0.0.1")
        assert "user mosquitto" in conf.read_text().splitlines()
        assert {p.stat().st_uid for p in (conf.parent, *conf.parent.iterdir())} == {owner.pw_uid}
        proc = subprocess.Popen([exe, "-c", str(conf)], stderr=subprocess.PIPE, text=True)
        try:
            wait_for_port("127.0.0.1", port)
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=15)
        assert "should not be run as root" not in err, err
        # In a directory it cannot reach, root it stays (and Mosquitto says so).
        private = brokerconf.mosquitto_conf(tmp_path / "broker", entries, acl, port, "127.0.0.1")
        assert "user root" in private.read_text().splitlines()
    finally:
        shutil.rmtree(shared)
