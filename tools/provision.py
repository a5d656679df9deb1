"""`wren provision`: a board's settings.json, written to the board with mpremote.

    wren provision --port /dev/ttyACM0 --device thermo1 --host 192.168.1.10 \\
        --wifi-ssid home --wifi-password-file ~/.wifi-pass
    wren provision --port /dev/ttyUSB0 --device thermo1 --host broker.example.com \\
        --tls-ca ca.pem --broker-files .wren/broker

The device must be in the registry (`wren device add`). The registry keeps only a hash of
its broker password, so provisioning gives the device a new password: it is made here,
written to the board's settings.json and its hash to the registry (and, with
`--broker-files DIR`, to the broker's password file there, as `wren broker-files` writes
it); the board's earlier password stops working once the broker reloads its files.
Neither that password nor the Wi-Fi password is ever printed, and the Wi-Fi password is
read from a file or the environment (WREN_WIFI_PASSWORD), never from the command line,
where any user's `ps` would show it.

The settings are checked against the board's settings table (tools/board_settings.py)
before anything is written, to the board or to the registry. With `--tls-ca FILE` the CA
certificate is copied to the board beside settings.json; with `--agent MODULE` main.py
becomes `import MODULE` (the module `wren flash` put there, or one frozen in the
firmware). Then the board is soft-reset and boots with its new settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from server_bridge import brokerconf
from server_bridge.registry import BRIDGE, DEVICE, Registry, RegistryError
from tools import board_settings
from tools.flash import MARK, QUERY, FlashError, mpremote, open_port, parse_query, query, soft_reset

WIFI_PASSWORD_ENV = "WREN_WIFI_PASSWORD"
SETTINGS = "settings.json"
# What a key holding a secret shows as, wherever settings are printed.
HIDDEN = "(set, not shown)"
SECRET_KEYS = {"password"}


class ProvisionError(Exception):
    """Provisioning refused or failed; the message is the one line the user sees."""


@dataclass
class Provisioned:
    settings: dict[str, Any]  # as written to the board (it holds the new password)
    files: list[str]  # what was written to the board
    broker_files: Path | None  # the password file written, if any


def shown(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with every secret replaced by HIDDEN: the only form ever printed."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out[key] = shown(value)
        else:
            out[key] = HIDDEN if key in SECRET_KEYS else value
    return out


def wifi_password(file: Path | None, env: dict[str, str] | None = None) -> str | None:
    """The Wi-Fi password: the file's first line, else $WREN_WIFI_PASSWORD, else None
    (an open network)."""
    if file is not None:
        try:
            text = file.read_text()
        except OSError as e:
            raise ProvisionError(f"--wifi-password-file {file}: {e.strerror or e}") from None
        lines = text.splitlines()
        if not lines or not lines[0]:
            raise ProvisionError(f"--wifi-password-file {file} is empty")
        return lines[0]
    return (env if env is not None else os.environ).get(WIFI_PASSWORD_ENV) or None


def make_settings(
    device: str,
    password: str,
    host: str,
    port: int | None = None,
    wifi: tuple[str, str | None] | None = None,
    tls_ca: str | None = None,
    server_hostname: str | None = None,
    prefix: str | None = None,
) -> dict[str, Any]:
    """The settings document provisioning writes, checked (SettingsInvalid)."""
    doc: dict[str, Any] = {"device": device, "password": password, "host": host}
    if port is not None:
        doc["port"] = port
    if prefix is not None:
        doc["prefix"] = prefix
    if wifi is not None:
        ssid, secret = wifi
        doc["wifi"] = {"ssid": ssid} if secret is None else {"ssid": ssid, "password": secret}
    if tls_ca is not None:
        doc["tls"] = {"ca": tls_ca}
        if server_hostname is not None:
            doc["tls"]["server_hostname"] = server_hostname
    return board_settings.check(doc)


def main_py(module: str) -> str:
    """A main.py that runs `module`: importing an agent's module starts the board (as
    `wren build` writes it); the demo's module has a main() to call."""
    if module == "edge_runtime.demo":
        return "from edge_runtime.demo import main\nmain()\n"
    return f"# written by wren provision: importing {module} starts the board\nimport {module}\n"


def _check_module(module: str) -> None:
    if not all(part.isidentifier() for part in module.split(".")):
        raise ProvisionError(f"--agent {module!r} is not a module name (e.g. kiosk)")


def write_password_file(registry: Registry, directory: Path) -> Path:
    """The broker's password file in `directory` written again from the registry, as
    `wren broker-files` writes it (each bridge user's control and link logins too),
    keeping the file's owner: its config and ACL are left as they are."""
    users = registry.users()
    bridges = [u.user for u in users if u.role == BRIDGE]
    entries = brokerconf.with_control_users({u.user: u.password_hash for u in users}, bridges)
    path = directory / "passwords"
    before = path.stat()
    brokerconf.write_password_entries(path, entries)
    if hasattr(os, "chown") and (before.st_uid, before.st_gid) != (os.getuid(), os.getgid()):
        os.chown(path, before.st_uid, before.st_gid)  # Mosquitto's own user, when it read it
    return path


def provision(
    port: str,
    registry_path: Path,
    device: str,
    host: str,
    mqtt_port: int | None = None,
    wifi: tuple[str, str | None] | None = None,
    tls_ca: Path | None = None,
    server_hostname: str | None = None,
    agent: str | None = None,
    prefix: str | None = None,
    broker_files: Path | None = None,
    reset: bool = True,
) -> Provisioned:
    """Carry out a provisioning (the module docstring); nothing is written when the
    settings, the port, the registry or the broker files' directory are refused."""
    if agent is not None:
        _check_module(agent)
    ca_name = tls_ca.name if tls_ca is not None else None
    if tls_ca is not None and not tls_ca.is_file():
        raise ProvisionError(f"--tls-ca {tls_ca}: no such file")
    # Checked first with a stand-in password: nothing is made, and nothing written,
    # for settings that would be refused.
    make_settings(device, "-", host, mqtt_port, wifi, ca_name, server_hostname, prefix)
    if broker_files is not None and not (broker_files / "passwords").is_file():
        dynsec = (broker_files / "dynsec.json").is_file()
        raise ProvisionError(
            f"--broker-files {broker_files}: "
            + ("dynsec.json is read only at the broker's start: leave --broker-files out, "
               "then run `wren broker-files --access dynsec` and restart Mosquitto" if dynsec
               else "no password file there (written by `wren broker-files --out DIR`)")
        )  # fmt: skip
    if not registry_path.is_file():
        raise ProvisionError(f"no registry at {registry_path} (`wren tenant add` creates one)")
    with Registry(registry_path) as reg:
        record = reg.device(device)
        user = reg.user(device)
    if record is None:
        raise ProvisionError(
            f"unknown device {device!r} in {registry_path}: add it first "
            f"(wren device add {device} --tenant TENANT)"
        )
    if user is not None and user.role != DEVICE:
        raise ProvisionError(f"broker user {device!r} is not the device's")
    open_port(port).close()

    password = brokerconf.new_password()
    settings = make_settings(
        device, password, host, mqtt_port, wifi, ca_name, server_hostname, prefix
    )
    # The board first: a failure here leaves the registry as it was (the board keeps its
    # old password, which still works).
    written = _write_board(port, settings, tls_ca, agent)
    try:
        with Registry(registry_path) as reg:
            reg.set_device_password_hash(device, brokerconf.hash_password(password))
    except (RegistryError, OSError, ValueError) as e:
        raise ProvisionError(
            f"the board has its new settings but the registry was not updated ({e}): "
            "run wren provision again"
        ) from None
    pw_file = None
    if broker_files is not None:
        try:
            with Registry(registry_path) as reg:
                pw_file = write_password_file(reg, broker_files)
        except (OSError, ValueError) as e:
            raise ProvisionError(
                f"the board and the registry have the new password, but the broker's "
                f"password file in {broker_files} was not written ({e}): run wren broker-files"
            ) from None
    if reset:
        soft_reset(port)
    return Provisioned(settings, written, pw_file)


def _write_board(
    port: str, settings: dict[str, Any], ca: Path | None, agent: str | None
) -> list[str]:
    """settings.json (and the CA, and main.py) onto the board, each read back by hash."""
    if agent is not None and agent != "edge_runtime.demo":
        # Asked first (this also soft-resets the board: its agent stops): is the module
        # on the board's flash? Not an error when it is not: it may be frozen.
        top = agent.split(".")[0]
        sums, _ = query(port, [f"{top}.mpy", f"{top}.py", top], [])
        if not any(sums.values()):
            print(f"wren provision: note: no {top}.mpy, {top}.py or {top}/ on the board's flash "
                  "(fine if it is frozen into the firmware; else `wren flash` it)",
                  file=sys.stderr)  # fmt: skip
    # A private directory: the settings file holds the passwords for as long as the copy
    # takes, readable by this user only, and is removed with the directory.
    with tempfile.TemporaryDirectory(prefix="wren-provision-") as tmp:
        stage = Path(tmp)
        os.chmod(stage, 0o700)
        files: dict[str, bytes] = {}
        files[SETTINGS] = board_settings.dumps(settings).encode()
        if ca is not None:
            files[ca.name] = ca.read_bytes()
        if agent is not None:
            files["main.py"] = main_py(agent).encode()
        commands = []
        for name, data in files.items():
            local = stage / name
            fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            commands.append(["fs", "cp", "-f", str(local), f":{name}"])
        commands.append(["exec", QUERY % (MARK, list(files), [])])
        try:
            # mpremote's output names the files, never their contents.
            sums, _ = parse_query(mpremote(port, commands, resume=agent is not None))
        except FlashError as e:
            raise ProvisionError(str(e)) from None
    wrong = [n for n, d in files.items() if sums.get(n) not in (hashlib.sha256(d).hexdigest(), "?")]
    if wrong:
        raise ProvisionError(f"the board holds other bytes than were written: {', '.join(wrong)}")
    return list(files)


# --- the command line ---------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """Register `wren provision` on the `wren` subparsers."""
    from tools.cli import DEFAULT_REGISTRY

    p = sub.add_parser(
        "provision",
        help="write a board's settings.json (device, a new broker password, broker, Wi-Fi, "
        "TLS) with mpremote; secrets are never printed",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--port", required=True, help="the board's serial port (as wren flash)")
    p.add_argument("--device", required=True, help="the device id (in the registry)")
    p.add_argument("--host", required=True, help="the broker's host as the board reaches it")
    p.add_argument(
        "--port-mqtt",
        type=int,
        metavar="PORT",
        help="the broker's port (default on the board: 1883, 8883 with --tls-ca)",
    )
    p.add_argument("--wifi-ssid", metavar="SSID", help="the Wi-Fi network to join at boot")
    p.add_argument(
        "--wifi-password-file",
        type=Path,
        metavar="FILE",
        help=f"its password, the file's first line (else ${WIFI_PASSWORD_ENV}; neither: an "
        "open network)",
    )
    p.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help="connect over TLS, checking the broker against this CA certificate (PEM or "
        "DER), copied to the board",
    )
    p.add_argument(
        "--tls-server-hostname", metavar="NAME", help="the name on the broker's certificate, "
        "when it is not --host"
    )  # fmt: skip
    p.add_argument(
        "--agent",
        metavar="MODULE",
        help="the module main.py runs (e.g. kiosk, or edge_runtime.demo); default: main.py "
        "is left as it is",
    )
    p.add_argument("--prefix", help="the topic prefix, when not the default")
    p.add_argument("--registry", type=Path, default=DEFAULT_REGISTRY, help="the registry file")
    p.add_argument(
        "--broker-files",
        type=Path,
        metavar="DIR",
        help="also write the new password into the broker's password file in DIR "
        "(`wren broker-files --out DIR`), then SIGHUP Mosquitto",
    )
    p.add_argument("--no-reset", action="store_true", help="do not soft-reset the board after")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Carry out `wren provision`; 1 with one line on stderr when refused."""
    out = out or sys.stdout
    try:
        if args.wifi_password_file is not None and args.wifi_ssid is None:
            raise ProvisionError("--wifi-password-file needs --wifi-ssid")
        wifi = None
        if args.wifi_ssid is not None:
            wifi = (args.wifi_ssid, wifi_password(args.wifi_password_file))
        done = provision(
            args.port, args.registry, args.device, args.host, args.port_mqtt, wifi,
            args.tls_ca, args.tls_server_hostname, args.agent, args.prefix,
            args.broker_files, not args.no_reset,
        )  # fmt: skip
    except board_settings.SettingsInvalid as e:
        for problem in e.problems:
            print(f"wren provision: {type(problem).__name__}: {problem}", file=sys.stderr)
        print("wren provision: nothing was written", file=sys.stderr)
        return 1
    except (ProvisionError, FlashError) as e:
        print(f"wren provision: {e}", file=sys.stderr)
        return 1
    print(f"wren provision: {args.device} on {args.port}: wrote {', '.join(done.files)}", file=out)
    print(f"  settings.json: {json.dumps(shown(done.settings), sort_keys=True)}", file=out)
    print(f"  a new broker password for {args.device}: on the board and, hashed, in "
          f"{args.registry}", file=out)  # fmt: skip
    if done.broker_files is not None:
        print(f"  broker password file written: {done.broker_files}; reload Mosquitto:  "
              "kill -HUP <its pid>", file=out)  # fmt: skip
    else:
        print("  next: `wren broker-files` (with your options), then SIGHUP the Mosquitto "
              "that uses them: until then the board's new password is refused",
              file=out)  # fmt: skip
    if not args.no_reset:
        print("  soft reset: the board boots with its new settings", file=out)
    return 0
