"""Start an MQTT broker for the demo and the tests.

Mosquitto on a free loopback port with a config of our own when the binary exists;
`tools/embedded_broker.py` (a small MQTT 3.1.1 broker in Python) otherwise.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


class BrokerError(RuntimeError):
    """The broker could not be started or did not accept connections in time."""


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

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._owned_dir is not None:
            self._owned_dir.cleanup()
            self._owned_dir = None


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )


def start_mosquitto(
    workdir: Path | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    extra_conf: str = "",
    allow_anonymous: bool = True,
) -> MosquittoProcess:
    """Run Mosquitto in the foreground on host:port with its own config and log.

    `extra_conf` is appended (e.g. password_file / acl_file lines); with it,
    pass allow_anonymous=False to make the broker authenticate every client.
    """
    exe = mosquitto_binary()
    if exe is None:
        raise BrokerError("mosquitto is not installed (apt-get install -y mosquitto)")
    owned = None
    if workdir is None:
        owned = tempfile.TemporaryDirectory(prefix="wren-mosquitto-")
        workdir = Path(owned.name)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    log_path = workdir / "mosquitto.log"
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        f"listener {port} {host}\n"
        f"allow_anonymous {'true' if allow_anonymous else 'false'}\n"
        "persistence false\n"
        f"log_dest file {log_path}\n"
        "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
        "max_packet_size 1048576\n" + extra_conf
    )
    proc = subprocess.Popen(
        [exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    broker = MosquittoProcess(host, port, workdir, proc, log_path, owned)
    try:
        wait_for_port(host, port)
    except BrokerError:
        broker.stop()
        raise BrokerError(f"mosquitto did not start on {host}:{port}: {broker.log()}") from None
    if proc.poll() is not None:
        raise BrokerError(f"mosquitto exited at start: {broker.log()}")
    return broker
