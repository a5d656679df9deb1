"""The `wren` command line: demo, bridge, virtual board, ask.

wren demo [--once]                 broker + bridge + virtual board + terminal view
wren bridge --broker HOST:PORT     the server bridge on its own
wren board --virtual               the board runtime on the MicroPython unix port
wren ask "question"                send one request as a host and watch the run
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from server_bridge import service
from server_bridge.service import add_broker_arguments, broker_address
from tools import demo as demo_mod


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
        type=broker_address,
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

    # The bridge service's own options (server_bridge/service.py), so `wren bridge` and
    # `python -m server_bridge` cannot drift apart.
    service.add_arguments(sub.add_parser("bridge", help="run the server bridge"))

    v = sub.add_parser("board", help="run a board")
    v.add_argument(
        "--virtual", action="store_true", required=True, help="the virtual board (unix port)"
    )
    add_broker_arguments(v, "WREN_BOARD_USER", "WREN_BOARD_PASSWORD")
    v.add_argument("--device", default="thermo1")
    v.add_argument("--heap", default="128K")
    v.add_argument("--flash", type=Path, help="flash directory (default .wren/boards/DEVICE)")
    v.add_argument(
        "--py",
        action="store_true",
        help="run from .py sources instead of .mpy built with mpy-cross",
    )
    v.add_argument("--cpython", action="store_true", help="run the board code on CPython")

    # A host user of its own (WREN_HOST_USER): a broker that binds client ids to users
    # lets two connections of one user knock each other off (PROTOCOL.md "Identity").
    a = sub.add_parser(
        "ask", help="send one request as a host (an MQTT user of its own) and show the run"
    )
    add_broker_arguments(a, "WREN_HOST_USER", "WREN_HOST_PASSWORD")
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
    h.add_argument("--broker", type=broker_address, metavar="HOST:PORT", help="for broker tests")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, service.stop_on_sigterm)
    service.setup_logging(args.verbose)
    try:
        if args.command == "demo":
            return demo_mod.run_demo(args)
        if args.command == "bridge":
            if args.stats:
                return service.print_stats(args.stats_file)
            return service.run(args)
        if args.command == "board":
            return demo_mod.run_board(args)
        if args.command == "ask":
            return demo_mod.run_ask(args)
        if args.command == "hil":
            return _run_hil(args)
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return service.STOP_EXIT_CODE
    except (demo_mod.DemoError, service.ServiceError) as e:
        print(f"wren {args.command}: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
