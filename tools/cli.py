"""The `wren` command line: demo, bridge, virtual board, ask.

wren demo [--once]                 broker + bridge + virtual board + terminal view
wren bridge --broker HOST:PORT     the server bridge on its own
wren board --virtual               the board runtime on the MicroPython unix port
wren ask "question"                send one request as a host and watch the run
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from server_bridge.config import BridgeConfig
from tools import demo as demo_mod


def broker_arg(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got {text!r}")
    return value


def _add_broker_options(p: argparse.ArgumentParser, user_env: str, password_env: str) -> None:
    p.add_argument("--broker", type=broker_arg, metavar="HOST:PORT", help="MQTT broker to use")
    p.add_argument("--user", default=os.environ.get(user_env), help=f"MQTT user (env {user_env})")
    p.add_argument(
        "--password",
        default=os.environ.get(password_env),
        help=f"MQTT password (env {password_env})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wren", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run broker, bridge, a virtual board and the terminal view")
    d.add_argument(
        "--once", action="store_true", help="one scripted request, print the transcript, exit"
    )
    d.add_argument(
        "--broker",
        type=broker_arg,
        metavar="HOST:PORT",
        help="use this broker instead of starting one",
    )
    d.add_argument(
        "--user", default=os.environ.get("WREN_BRIDGE_USER"), help="bridge MQTT user on --broker"
    )
    d.add_argument("--password", default=os.environ.get("WREN_BRIDGE_PASSWORD"))
    d.add_argument("--heap", default="128K", help="board heap for the unix port (default 128K)")
    d.add_argument("--device", default="thermo1")
    d.add_argument("--ask", default="How warm is it in here?", help="the first request's text")
    d.add_argument(
        "--py",
        action="store_true",
        help="run the board from .py sources instead of .mpy (needs ~145K heap)",
    )
    d.add_argument("--cpython", action="store_true", help="run the virtual board on CPython")
    d.add_argument(
        "--workdir", type=Path, help="keep the demo's files here (default: a temporary dir)"
    )
    d.add_argument(
        "--embedded-broker",
        action="store_true",
        help="use the Python broker even if mosquitto exists",
    )

    b = sub.add_parser("bridge", help="run the server bridge")
    _add_broker_options(b, "WREN_BRIDGE_USER", "WREN_BRIDGE_PASSWORD")
    b.add_argument("--registry", type=Path, default=Path(".wren/registry.json"))
    b.add_argument(
        "--client-id",
        default="wren-bridge",
        help="MQTT client id of this bridge's persistent session (a second bridge process "
        "on the same broker needs its own)",
    )
    b.add_argument("--tenant", default="demo", help="tenant to create when the registry is new")
    b.add_argument(
        "--device", action="append", default=[], help="register DEVICE[:AGENT] in --tenant"
    )
    b.add_argument(
        "--script", type=Path, help="scripted model: a JSON script file (default: the demo script)"
    )
    b.add_argument(
        "--openai-base-url", help="use an OpenAI-compatible server, e.g. http://127.0.0.1:11434/v1"
    )
    b.add_argument("--model", default=os.environ.get("WREN_MODEL", "gpt-4o-mini"))
    b.add_argument(
        "--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key"
    )
    b.add_argument(
        "--merge-ms",
        type=milliseconds,
        metavar="MS",
        help="hold a model's small text chunks up to MS before sending them to a board "
        f"(default {BridgeConfig.rpc_merge_s * 1000:g}; 0 sends each chunk as it comes)",
    )

    v = sub.add_parser("board", help="run a board")
    v.add_argument(
        "--virtual", action="store_true", required=True, help="the virtual board (unix port)"
    )
    _add_broker_options(v, "WREN_BOARD_USER", "WREN_BOARD_PASSWORD")
    v.add_argument("--device", default="thermo1")
    v.add_argument("--heap", default="128K")
    v.add_argument("--flash", type=Path, help="flash directory (default .wren/boards/DEVICE)")
    v.add_argument(
        "--py",
        action="store_true",
        help="run from .py sources instead of .mpy built with mpy-cross",
    )
    v.add_argument("--cpython", action="store_true", help="run the board code on CPython")

    a = sub.add_parser("ask", help="send one request as a host and show the run")
    _add_broker_options(a, "WREN_HOST_USER", "WREN_HOST_PASSWORD")
    a.add_argument("text")
    a.add_argument(
        "--registry", type=Path, default=Path(".wren/registry.json"), help="for the tenant secret"
    )
    a.add_argument("--tenant", default="demo")
    a.add_argument("--device", default="thermo1")
    a.add_argument("--user-id", default="cli-user", help="the end user the session token names")
    a.add_argument("--timeout", type=float, default=60.0)
    h = sub.add_parser("hil", help="run the board tests on a target through its raw REPL")
    target = h.add_mutually_exclusive_group(required=True)
    target.add_argument("--pty", action="store_true", help="the unix port on a pseudo-terminal")
    target.add_argument("--port", help="a real board's serial port, e.g. /dev/ttyACM0")
    h.add_argument("--deploy", action="store_true", help="copy the files first (mpremote)")
    h.add_argument("--heap", default="128K", help="unix port heap (with --pty)")
    h.add_argument("--broker", type=broker_arg, metavar="HOST:PORT", help="for broker tests")
    h.add_argument("module", nargs="*", help="test modules (default: all)")
    return parser


def _run_hil(args: argparse.Namespace) -> int:
    from tools import hil

    try:
        if args.deploy and args.port:
            hil.deploy(args.port)
        return hil.run(args.port, args.heap, args.module, args.broker)
    except hil.HilError as e:
        print(f"wren hil: {e}", file=sys.stderr)
        return 1


def _stop_on_sigterm(signum: int, frame: object) -> None:
    # `kill` (and service managers) stop us with SIGTERM; raising here runs the same
    # clean-up as Ctrl-C, so a broker or board we started does not outlive us.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        if args.command == "demo":
            return demo_mod.run_demo(args)
        if args.command == "bridge":
            return demo_mod.run_bridge(args)
        if args.command == "board":
            return demo_mod.run_board(args)
        if args.command == "ask":
            return demo_mod.run_ask(args)
        if args.command == "hil":
            return _run_hil(args)
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return 130
    except demo_mod.DemoError as e:
        print(f"wren {args.command}: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
