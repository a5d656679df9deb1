"""`wren flash`: a build's files onto a board with mpremote, only what changed.

    wren flash --port /dev/ttyACM0                       the build in .wren/build/rp2 ...
    wren flash --port /dev/ttyUSB0 --build build/kiosk   ... or any `wren build --out`
    wren flash --port /dev/ttyUSB0 --target esp32 --agent examples/kiosk/main.py
    wren flash --port socket://127.0.0.1:4000 --settings settings.json

The build directory is what `wren build` wrote: the board's files as its root holds them
and `wren-build.json`, which lists them. The board is asked, in one raw-REPL call, for the
sha256 of each file it holds (and what else is in the package's directories); a file
whose hash matches is skipped, the others are copied with `mpremote fs cp`, and files
that would shadow the build are removed: a `.py` beside a built `.mpy` of the same name
(MicroPython imports the `.py` first), a file in the package's directory the build does
not have, and a flash copy of a module the build says is frozen into the firmware. The
copies are hashed again on the board, then the board is soft-reset from its friendly
REPL, so it boots as at power-on and runs main.py.

A `wren build --romfs` output holds a ROMFS image beside main.py. The board is asked
first whether its firmware has a ROMFS partition (`vfs.rom_ioctl`) and the sha256 of what
that partition holds; an image that differs is written with `mpremote romfs deploy`, and
flash copies of the modules in it are removed (they would shadow it).

The port is anything mpremote's `connect` takes as a device: a path (/dev/ttyUSB0,
/dev/ttyACM0, COM3) or a pyserial URL (socket://HOST:PORT, rfc2217://HOST:PORT).
"""

from __future__ import annotations

import argparse
import ast
import errno
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TextIO

from tools import board_settings

BUILD_JSON = "wren-build.json"
SETTINGS = "settings.json"
# mpremote's calls: a real board at 115200 baud copies ~5 KB/s, and a package is
# ~200 KB; no call should come near this.
MPREMOTE_TIMEOUT_S = 600.0
RESET_TIMEOUT_S = 10.0
# The line the board's hash query prints its answer on.
MARK = "WREN-FLASH"
# The query, run on the board: the sha256 of each path (None: absent; "d": a directory;
# "?": the board has no hashlib.sha256, so nothing is skipped), and what each directory
# holds. In a function, so its names go when it returns; 1 KiB read at a time.
QUERY = """\
def _wren_query(paths, dirs):
    import os
    try:
        from hashlib import sha256
    except ImportError:
        sha256 = None
    from binascii import hexlify
    buf = bytearray(1024)
    view = memoryview(buf)
    sums = {}
    for p in paths:
        try:
            mode = os.stat(p)[0]
        except OSError:
            sums[p] = None
            continue
        if mode & 0x4000:
            sums[p] = "d"
            continue
        if sha256 is None:
            sums[p] = "?"
            continue
        h = sha256()
        with open(p, "rb") as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
        sums[p] = hexlify(h.digest()).decode()
    held = {}
    for d in dirs:
        try:
            held[d] = [(e[0], e[1] == 0x4000) for e in os.ilistdir(d)]
        except OSError:
            held[d] = None
    print(%r, repr((sums, held)))
_wren_query(%r, %r)
del _wren_query
"""


class FlashError(Exception):
    """The flash could not be done; the message is the one line the user sees."""


@dataclass(frozen=True)
class LocalFile:
    """A file to put on the board: its path there ("/"-separated, from the root)."""

    path: str
    source: Path
    size: int
    sha256: str


@dataclass
class FlashReport:
    copied: list[LocalFile] = field(default_factory=list)
    unchanged: list[LocalFile] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # A --romfs build's image: deployed (True) or already on the board (False).
    romfs: tuple[LocalFile, bool] | None = None
    seconds: float = 0.0
    reset: bool = False

    @property
    def bytes_copied(self) -> int:
        return sum(f.size for f in self.copied)


# --- the port ---------------------------------------------------------------------------


def port_problem(port: str, e: BaseException) -> str:
    """One line for a port that could not be opened."""
    code = getattr(e, "errno", None)
    if code == errno.ENOENT:
        why = "no such port (is the board plugged in? ls /dev/ttyACM* /dev/ttyUSB*)"
    elif code in (errno.EACCES, errno.EPERM):
        why = "permission denied (is your user in the port's group, e.g. dialout?)"
    elif code == errno.EBUSY:
        why = "busy (another program has it open: a serial monitor, mpremote repl?)"
    elif isinstance(code, int):
        why = os.strerror(code)
    else:
        # pyserial's URL handlers say it in their own words ("Could not open port
        # socket://...: [Errno 111] Connection refused"): their reason, once.
        why = str(e).rsplit(": ", 1)[-1] or type(e).__name__
    return f"cannot open port {port}: {why}"


def open_port(port: str, timeout_s: float = 0.0) -> Any:
    """The board's console on `port` (a path or a pyserial URL), through pyserial;
    FlashError in one line when it cannot be opened."""
    try:
        import serial
    except ImportError:
        raise FlashError("a board needs pyserial: pip install pyserial") from None
    try:
        return serial.serial_for_url(port, 115200, timeout=timeout_s)
    except (OSError, ValueError) as e:  # SerialException is an OSError
        raise FlashError(port_problem(port, e)) from None


def soft_reset(port: str, timeout_s: float = RESET_TIMEOUT_S) -> None:
    """A soft reset from the friendly REPL, which runs main.py (one from the raw REPL,
    mpremote's `soft-reset`, does not): Ctrl-C stops what runs, Ctrl-B leaves the raw
    REPL, Ctrl-D reboots. Waits for the board to say it rebooted."""
    ser = open_port(port, timeout_s=0.1)
    try:
        ser.write(b"\r\x03\x03")
        time.sleep(0.1)
        ser.reset_input_buffer()
        ser.write(b"\x02\x04")
        seen = b""
        deadline = time.monotonic() + timeout_s
        while b"soft reboot" not in seen:
            if time.monotonic() > deadline:
                raise FlashError(f"the board on {port} did not soft-reset within {timeout_s}s")
            seen = seen[-64:] + ser.read(256)
    finally:
        ser.close()


# --- mpremote -----------------------------------------------------------------------------


def mpremote(port: str, commands: list[list[str]], resume: bool = True) -> str:
    """Run mpremote's `commands` (each a command and its arguments, chained with "+") on
    `port`; its output. `resume`: no soft reset first (mpremote's own, from the raw
    REPL, at a session's start)."""
    argv = [sys.executable, "-m", "mpremote", "connect", port]
    if resume:
        argv.append("resume")
    for i, cmd in enumerate(commands):
        argv += (["+"] if i else []) + cmd
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=MPREMOTE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise FlashError(
            f"mpremote on {port} did not finish within {MPREMOTE_TIMEOUT_S}s"
        ) from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise FlashError(f"mpremote on {port} failed: {' / '.join(said[-3:]) or done.returncode}")
    return done.stdout


def query(port: str, paths: list[str], dirs: list[str], resume: bool = False) -> tuple[
    dict[str, str | None], dict[str, list[tuple[str, bool]] | None]
]:  # fmt: skip
    """(hash of each path, entries of each directory) as the board holds them. The
    first call of a flash soft-resets the board (mpremote's way): what runs stops, and
    the board's heap is whole for the copies."""
    out = mpremote(port, [["exec", QUERY % (MARK, paths, dirs)]], resume=resume)
    return parse_query(out)


def parse_query(out: str) -> tuple[
    dict[str, str | None], dict[str, list[tuple[str, bool]] | None]
]:  # fmt: skip
    for line in out.splitlines():
        if line.startswith(MARK + " "):
            try:
                sums, held = ast.literal_eval(line[len(MARK) + 1 :])
            except (ValueError, SyntaxError):
                break
            return sums, held
    raise FlashError(f"the board did not answer the hash query: {out.strip()[-200:]!r}")


# --- what to copy ---------------------------------------------------------------------------


# Whether the board's firmware has a ROMFS partition, and the sha256 of its first `n`
# bytes (a deployed image of the build's size), hashed in place from the memory-mapped
# partition: nothing is copied into the heap.
ROM_QUERY = """\
def _wren_rom(n):
    import vfs
    if not hasattr(vfs, 'rom_ioctl'):
        return 'none'
    try:
        from hashlib import sha256
        from binascii import hexlify
    except ImportError:
        return '?'
    rom = vfs.rom_ioctl(2, 0)
    if not isinstance(rom, memoryview) or len(rom) < n:
        return 'small %%d' %% (len(rom) if isinstance(rom, memoryview) else -1)
    return hexlify(sha256(rom[:n]).digest()).decode()
print(%r, _wren_rom(%d))
del _wren_rom
"""


def rom_state(port: str, size: int) -> str:
    """What the board's ROMFS partition holds: 'none' (no ROMFS in its firmware), '?' (no
    hashlib), 'small N' (a partition of N bytes, too small for `size`), or the sha256 of its
    first `size` bytes."""
    # The flash's first call: mpremote's soft reset stops what the board runs.
    out = mpremote(port, [["exec", ROM_QUERY % (MARK, size)]], resume=False)
    for line in out.splitlines():
        if line.startswith(MARK + " "):
            return line[len(MARK) + 1 :].strip()
    raise FlashError(f"the board did not answer the ROMFS query: {out.strip()[-200:]!r}")


def deploy_romfs(port: str, build_dir: Path, record: dict[str, Any]) -> tuple[LocalFile, bool]:
    """The build's ROMFS image written to the board's partition when it holds other bytes;
    the image, and whether it was written (False: it was there already)."""
    try:
        listed = record["romfs"]
        image = _local(str(listed["path"]), build_dir / str(listed["path"]))
    except (KeyError, TypeError) as e:
        raise FlashError(
            f"{build_dir / BUILD_JSON}: its romfs entry cannot be read ({e})"
        ) from None
    except OSError as e:
        raise FlashError(f"the build's ROMFS image cannot be read: {e}") from None
    if image.sha256 != listed.get("sha256"):
        raise FlashError(f"{image.source} is not the image {BUILD_JSON} lists: build again")
    held = rom_state(port, image.size)
    if held == "none":
        raise FlashError(
            "the board's firmware has no ROMFS partition (vfs.rom_ioctl): flash a firmware "
            "with one, or build without --romfs"
        )
    if held.startswith("small"):
        raise FlashError(
            f"the board's ROMFS partition ({held.split()[1]} bytes) cannot hold the "
            f"{image.size:,}-byte image"
        )
    if held == image.sha256:
        return image, False
    mpremote(port, [["romfs", "deploy", str(image.source)]])
    if rom_state(port, image.size) != image.sha256:
        raise FlashError("the board's ROMFS partition holds other bytes than were deployed")
    return image, True


def _local(path: str, source: Path) -> LocalFile:
    data = source.read_bytes()
    return LocalFile(path, source, len(data), hashlib.sha256(data).hexdigest())


def read_build(build_dir: Path) -> tuple[list[LocalFile], dict[str, Any]]:
    """The files a `wren build` output lists, hashed as they are now, and its record."""
    record_path = build_dir / BUILD_JSON
    try:
        record = json.loads(record_path.read_text())
        listed = [str(f["path"]) for f in record["files"]]
    except FileNotFoundError:
        raise FlashError(f"no {BUILD_JSON} in {build_dir}: not a `wren build` output") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FlashError(f"{record_path} cannot be read: {e}") from None
    files = []
    for path in listed:
        pure = PurePosixPath(path)
        if pure.is_absolute() or ".." in pure.parts:
            raise FlashError(f"{record_path} lists {path!r}, outside the board's root")
        source = build_dir / path
        if not source.is_file():
            raise FlashError(f"{record_path} lists {path}, which is not in {build_dir}")
        files.append(_local(path, source))
    return files, record


@dataclass
class Plan:
    copy: list[LocalFile]
    same: list[LocalFile]
    make_dirs: list[str]
    remove: list[str]


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def asked(files: list[LocalFile], frozen: list[str]) -> tuple[list[str], list[str]]:
    """The paths and directories the board is asked about for these files."""
    paths = [f.path for f in files]
    for f in files:
        if f.path.endswith(".mpy"):
            paths.append(f.path[:-4] + ".py")  # would shadow the .mpy
    for name in frozen:
        paths += [name, f"{name}.py", f"{name}.mpy"]  # would shadow the frozen module
    dirs = sorted({_parent(f.path) for f in files} - {""})
    # Each directory's own ancestors, to know which to make.
    for d in list(dirs):
        parts = d.split("/")
        paths += ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return list(dict.fromkeys(paths)), dirs


def plan(
    files: list[LocalFile],
    frozen: list[str],
    sums: dict[str, str | None],
    held: dict[str, list[tuple[str, bool]] | None],
) -> Plan:
    built = {f.path for f in files}
    copy = [f for f in files if sums.get(f.path) != f.sha256]
    same = [f for f in files if sums.get(f.path) == f.sha256]
    dirs = sorted({_parent(f.path) for f in copy} - {""})
    make: list[str] = []
    for d in dirs:
        parts = d.split("/")
        for i in range(len(parts)):
            sub = "/".join(parts[: i + 1])
            if sums.get(sub) != "d" and sub not in make:
                make.append(sub)
    remove: list[str] = []
    for f in files:
        if f.path.endswith(".mpy") and sums.get(f.path[:-4] + ".py") not in (None, "d"):
            remove.append(f.path[:-4] + ".py")
    for d, entries in held.items():
        for name, is_dir in entries or ():
            path = f"{d}/{name}"
            if not is_dir and path not in built and path not in remove:
                remove.append(path)
    for name in frozen:
        for path in (name, f"{name}.py", f"{name}.mpy"):
            if sums.get(path) is not None and path not in built:
                remove.append(path)
    return Plan(copy, same, make, remove)


# --- the flash --------------------------------------------------------------------------------


def flash(
    port: str,
    build_dir: Path,
    settings: Path | None = None,
    reset: bool = True,
    out: TextIO | None = None,
) -> FlashReport:
    """Put `build_dir` (and `settings`, checked first) on the board at `port`: only what
    changed (the module docstring); prints what it did to `out`."""
    started = time.monotonic()
    files, record = read_build(build_dir)
    frozen = [str(n) for n in record.get("frozen", [])]
    if settings is not None:
        try:
            board_settings.load(settings)
        except board_settings.SettingsInvalid as e:
            raise FlashError(f"{settings}: {e}") from None
        files.append(_local(SETTINGS, settings))
    # Said in one line here rather than by mpremote's "failed to access".
    open_port(port).close()
    rom: tuple[LocalFile, bool] | None = None
    if "romfs" in record:
        # First: a board without ROMFS is told so before its flash is changed.
        rom = deploy_romfs(port, build_dir, record)
    paths, dirs = asked(files, frozen)
    sums, held = query(port, paths, dirs)
    todo = plan(files, frozen, sums, held)
    commands = [["fs", "mkdir", f":{d}"] for d in todo.make_dirs]
    for path in todo.remove:
        commands.append(["fs", "rm", "-r", f":{path}"] if sums.get(path) == "d" else
                        ["fs", "rm", f":{path}"])  # fmt: skip
    # -f: copy without mpremote's own hash check, done here for all files at once.
    commands += [["fs", "cp", "-f", str(f.source), f":{f.path}"] for f in todo.copy]
    if todo.copy:
        # Read back in the same session: each copy's hash, as the board now holds it.
        commands.append(["exec", QUERY % (MARK, [f.path for f in todo.copy], [])])
    said = mpremote(port, commands) if commands else ""
    if todo.copy:
        after, _ = parse_query(said)
        wrong = [f.path for f in todo.copy if after.get(f.path) not in (f.sha256, "?")]
        if wrong:
            raise FlashError(f"the board holds other bytes than were copied: {', '.join(wrong)}")
    report = FlashReport(todo.copy, todo.same, todo.remove, rom)
    if reset:
        soft_reset(port)
        report.reset = True
    report.seconds = time.monotonic() - started
    if out is not None:
        show(report, port, build_dir, record, out)
    return report


def show(report: FlashReport, port: str, build_dir: Path, record: dict[str, Any],
         out: TextIO) -> None:  # fmt: skip
    target = record.get("target", "?")
    print(f"wren flash: {build_dir} ({target}, mpy v{record.get('mpy', '?')}) -> {port}", file=out)
    rows: list[tuple[str, str, int | None]] = [("copied", f.path, f.size) for f in report.copied]
    rows += [("unchanged", f.path, f.size) for f in report.unchanged]
    rows += [("removed", path, None) for path in report.removed]
    if report.romfs is not None:
        image, deployed = report.romfs
        rows.append(("deployed" if deployed else "unchanged", "ROMFS " + image.path, image.size))
    width = max((len(r[1]) for r in rows), default=0)
    for what, path, size in sorted(rows, key=lambda r: r[1]):
        shown = f"{size:>9,}" if size is not None else ""
        print(f"  {what:<9}  {path:<{width}}  {shown}", file=out)
    same = sum(f.size for f in report.unchanged)
    n = len(report.copied)
    print(
        f"copied {n} file{'s' * (n != 1)} ({report.bytes_copied:,} bytes), skipped "
        f"{len(report.unchanged)} unchanged ({same:,} bytes), removed {len(report.removed)}, "
        f"in {report.seconds:.1f} s"
        + ("; soft reset: the board runs main.py" if report.reset else ""),
        file=out,
    )


# --- the command line ---------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """Register `wren flash` on the `wren` subparsers."""
    f = sub.add_parser(
        "flash",
        help="copy a build (and settings.json) to a board with mpremote: only what changed",
        description=__doc__.split("\n\n")[0],
    )
    f.add_argument(
        "--port",
        required=True,
        help="the board's serial port as mpremote takes it: /dev/ttyUSB0, /dev/ttyACM0, "
        "COM3, or a pyserial URL (socket://HOST:PORT, rfc2217://HOST:PORT)",
    )
    f.add_argument(
        "--build", type=Path, metavar="DIR", help="a `wren build` output; with --target, "
        "where to build (default then: a temporary directory)"
    )  # fmt: skip
    f.add_argument(
        "--target",
        help="build for this target first (wren build --target), into a temporary directory "
        "unless --build names one",
    )
    f.add_argument("--agent", type=Path, metavar="PATH", help="with --target: the agent to build")
    f.add_argument(
        "--settings",
        type=Path,
        metavar="FILE",
        help="a settings.json to copy too, checked first (`wren provision` writes one for you)",
    )
    f.add_argument(
        "--no-reset", action="store_true", help="leave the board as it is after the copy"
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Carry out `wren flash`; 1 with one line on stderr when it failed."""
    out = out or sys.stdout
    try:
        if args.agent is not None and args.target is None:
            raise FlashError("--agent needs --target (the build to make)")
        with tempfile.TemporaryDirectory(prefix="wren-flash-") as tmp:
            build_dir = args.build
            if args.target is not None:
                from tools import build as build_mod

                build_dir = build_dir or Path(tmp) / "build"
                try:
                    build_mod.build(args.target, build_dir, args.agent)
                except (build_mod.BuildError, OSError) as e:
                    raise FlashError(str(e)) from None
            if build_dir is None:
                raise FlashError("name the build: --build DIR, or --target T to build one")
            flash(args.port, build_dir, args.settings, not args.no_reset, out)
    except FlashError as e:
        print(f"wren flash: {e}", file=sys.stderr)
        return 1
    return 0
