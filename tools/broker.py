"""Start Mosquitto for the demo and the tests.

Mosquitto on a free loopback port with a config of our own. It is required:
`tools/setup.sh` installs it, and `WREN_MOSQUITTO` names the binary when it is
somewhere else (see mosquitto_binary).

With `persistence=True` Mosquitto keeps its sessions, retained messages and queued QoS 1
messages in its work directory and saves them when it is stopped with SIGTERM, so
`MosquittoProcess.restart()` stands for a broker restart as production sees one: the
persistent sessions of the bridge and the boards survive it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tools.owned_process import die_with_owner, stop_process

# The Mosquitto binary to run, when it is not `mosquitto` on PATH or in /usr/sbin.
MOSQUITTO_ENV = "WREN_MOSQUITTO"


class BrokerError(RuntimeError):
    """The broker could not be started or did not accept connections in time."""


class MosquittoMissing(BrokerError):
    """No Mosquitto binary was found; the message says how to install one."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BrokerError(f"nothing accepted connections on {host}:{port} within {timeout_s}s")


@dataclass
class MosquittoProcess:
    host: str
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    _owned_dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    # The command line that started it, so restart() runs the same config on the same port.
    argv: list[str] = field(default_factory=list, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _terminate(self) -> None:
        # SIGTERM, not SIGKILL: Mosquitto saves its persistence file on the way out.
        stop_process(self.proc)

    def stop(self) -> None:
        self._terminate()
        if self._owned_dir is not None:
            self._owned_dir.cleanup()
            self._owned_dir = None

    def restart(self, timeout_s: float = 10.0, down: Callable[[], None] | None = None) -> None:
        """Stop the broker (SIGTERM, so it saves its sessions when persistence is on) and
        start it again on the same port and config; return once it accepts connections.

        `down`, if given, is called while the broker is stopped (a test's chance to make
        its clients act while the broker is away).
        """
        if not self.argv:
            raise BrokerError("this broker was not started by start_mosquitto")
        self._terminate()
        if down is not None:
            down()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_owner(),
        )
        try:
            wait_for_port(self.host, self.port, timeout_s)
        except BrokerError:
            self._terminate()
            raise BrokerError(
                f"mosquitto did not come back on {self.address}: {self.log()}"
            ) from None
        if self.proc.poll() is not None:
            raise BrokerError(f"mosquitto exited at restart: {self.log()}")


def mosquitto_binary() -> str | None:
    """The Mosquitto executable, or None: $WREN_MOSQUITTO when it is set (a path, or a
    name looked up on PATH), else `mosquitto` on PATH, else /usr/sbin/mosquitto (where
    Debian's package puts it, and /usr/sbin is often not on a user's PATH)."""
    named = os.environ.get(MOSQUITTO_ENV)
    if named:
        # Only what the variable names: a wrong name is reported, not papered over by
        # another Mosquitto found elsewhere.
        return shutil.which(named)
    return shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )


def mosquitto_missing() -> MosquittoMissing:
    """The error for a binary mosquitto_binary() did not find, saying how to get one."""
    named = os.environ.get(MOSQUITTO_ENV)
    looked = f" ({MOSQUITTO_ENV}={named}: not found)" if named else ""
    return MosquittoMissing(
        f"Mosquitto is not installed{looked}: run `sh tools/setup.sh` "
        "(or `apt-get install mosquitto` / `brew install mosquitto`)"
    )


def start_mosquitto(
    workdir: Path | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    extra_conf: str = "",
    allow_anonymous: bool = True,
    persistence: bool = False,
) -> MosquittoProcess:
    """Run Mosquitto in the foreground on host:port with its own config and log.

    `extra_conf` is appended (e.g. password_file / acl_file lines); with it,
    pass allow_anonymous=False to make the broker authenticate every client.
    `persistence` keeps sessions, retained and queued messages in `workdir` across
    `restart()`.
    """
    exe = mosquitto_binary()
    if exe is None:
        raise mosquitto_missing()
    owned = None
    if workdir is None:
        owned = tempfile.TemporaryDirectory(prefix="wren-mosquitto-")
        workdir = Path(owned.name)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    log_path = workdir / "mosquitto.log"
    conf = workdir / "mosquitto.conf"
    if persistence:
        # The database file lives in the work directory; it is written on SIGTERM (and
        # not on a timer: autosave_interval's default is half an hour).
        saved = f"persistence true\npersistence_location {workdir.resolve()}/\n"
    else:
        saved = "persistence false\n"
    # Started as root, Mosquitto switches to the `mosquitto` user, which can neither
    # write its log nor its database into our private work directory: keep root, unless
    # the caller's configuration already names the user (a duplicate is an error).
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    user = "user root\n" if as_root and not re.search(r"^user\s", extra_conf, re.M) else ""
    # Nagle off, as on every socket of Wren's path (server_bridge/tcp.py says why),
    # unless the caller's configuration says otherwise (a benchmark's baseline).
    tuned = "" if re.search(r"^set_tcp_nodelay\s", extra_conf, re.M) else "set_tcp_nodelay true\n"
    conf.write_text(
        f"listener {port} {host}\n"
        f"allow_anonymous {'true' if allow_anonymous else 'false'}\n"
        + saved
        + user
        + tuned
        + f"log_dest file {log_path}\n"
        "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
        "max_packet_size 1048576\n" + extra_conf
    )
    argv = [exe, "-c", str(conf)]
    # A session of its own: Ctrl-C in a terminal reaches the process that started the
    # broker, which stops its parts in order (the broker last), not the broker first
    # under the clients still using it. And it dies with that process (owned_process):
    # a SIGKILLed `wren demo` left its broker running.
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_owner(),
    )
    broker = MosquittoProcess(host, port, workdir, proc, log_path, owned, argv)
    try:
        wait_for_port(host, port)
    except BrokerError:
        broker.stop()
        raise BrokerError(f"mosquitto did not start on {host}:{port}: {broker.log()}") from None
    except BaseException:
        # Ctrl-C while it starts: it is in a session of its own, so no one else stops it.
        broker.stop()
        raise
    if proc.poll() is not None:
        raise BrokerError(f"mosquitto exited at start: {broker.log()}")
    return broker
