"""A certificate authority of a test's own, made with the openssl command line: its CA
(PEM and DER, the board's form), a second CA that signed nothing the broker shows (a
board given it refuses the broker), the broker's certificate for `localhost` and
127.0.0.1, the same name's certificate that expired in 2020, and a client certificate
for the bridge and host clients. EC P-256 throughout: what an ESP32's mbedTLS verifies
fastest. No dependency: openssl is on every machine Mosquitto is.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OPENSSL", "Pki", "make_pki"]

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"

# `openssl ca`'s configuration: leaves signed by the test CA with the dates asked for.
_CA_CONF = """[ca]
default_ca = test
[test]
database = {db}/index.txt
new_certs_dir = {db}
serial = {db}/serial
default_md = sha256
policy = any
unique_subject = no
[any]
commonName = supplied
[server]
basicConstraints = CA:false
subjectAltName = DNS:localhost,IP:127.0.0.1
[client]
basicConstraints = CA:false
"""
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def ca_pem(self) -> Path:
        return self.path("ca.pem")

    @property
    def ca_der(self) -> Path:
        return self.path("ca.der")

    @property
    def other_der(self) -> Path:
        """A CA that signed nothing here."""
        return self.path("other.der")

    @property
    def server_pem(self) -> Path:
        return self.path("server.pem")

    @property
    def server_key(self) -> Path:
        return self.path("server.key")

    @property
    def expired_pem(self) -> Path:
        """The broker's name and key, valid in January 2020 only."""
        return self.path("expired.pem")

    @property
    def client_pem(self) -> Path:
        return self.path("client.pem")

    @property
    def client_key(self) -> Path:
        return self.path("client.key")


def _run(*args: str, cwd: Path) -> None:
    done = subprocess.run([OPENSSL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr.strip()}")


def _ca(directory: Path, name: str, cn: str) -> None:
    _run("req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.pem",
         "-days", "3650", "-subj", f"/CN={cn}",
         "-addext", "basicConstraints=critical,CA:true",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)  # fmt: skip
    _run("x509", "-in", f"{name}.pem", "-outform", "DER", "-out", f"{name}.der", cwd=directory)


def _leaf(directory: Path, name: str, cn: str, ext: str, dates: list[str], key: str) -> None:
    if not (directory / key).exists():
        _run("req", *_EC, "-keyout", key, "-out", f"{name}.csr", "-subj", f"/CN={cn}",
             cwd=directory)  # fmt: skip
    else:
        _run("req", "-new", "-key", key, "-out", f"{name}.csr", "-subj", f"/CN={cn}",
             cwd=directory)  # fmt: skip
    _run("ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key",
         "-in", f"{name}.csr", "-out", f"{name}.pem", "-extensions", ext, "-notext", *dates,
         cwd=directory)  # fmt: skip


def make_pki(directory: Path) -> Pki:
    """Write the test PKI (module docstring) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    db = directory / "db"
    db.mkdir(exist_ok=True)
    (db / "index.txt").write_text("")
    (db / "serial").write_text("01\n")
    (directory / "ca.cnf").write_text(_CA_CONF.format(db=db.resolve()))
    _ca(directory, "ca", "Wren test CA")
    _ca(directory, "other", "Another CA")
    year = ["-days", "365"]
    _leaf(directory, "server", "localhost", "server", year, "server.key")
    gone = ["-startdate", "20200101000000Z", "-enddate", "20200201000000Z"]
    _leaf(directory, "expired", "localhost", "server", gone, "server.key")
    _leaf(directory, "client", "bridge", "client", year, "client.key")
    return Pki(directory)
