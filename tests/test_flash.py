"""`wren flash` against a board on a pseudo-terminal (tools/pty_board.py): the unix port
behind a serial console that mpremote opens as it opens a board's USB port.

A `wren build` output goes onto the board whole the first time, then only what changed
(the hashes are the board's, read back from it); the board reboots and runs main.py;
the same over pyserial's socket:// URL; a port that is not there is one line."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.broker import free_port
from tools.flash import BUILD_JSON, read_build
from tools.pty_board import PtyBoard
from tools.virtual_board import micropython_binary

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    micropython_binary() is None, reason="no MicroPython unix port on this platform"
)


def wren(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`wren build --target unix`: the demo thermostat, as .mpy."""
    out = tmp_path_factory.mktemp("build") / "unix"
    done = wren(ROOT, "build", "--target", "unix", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def board(tmp_path: Path) -> Iterator[PtyBoard]:
    """A blank board: an empty flash directory."""
    flash = tmp_path / "flash"
    flash.mkdir()
    with PtyBoard(flash) as b:
        yield b


def _copied(stdout: str) -> list[str]:
    return [line.split()[1] for line in stdout.splitlines() if line.startswith("  copied ")]


def _same_files(build: Path, flash: Path) -> None:
    files, _ = read_build(build)
    for f in files:
        on_board = flash / f.path
        assert on_board.is_file(), f.path
        assert hashlib.sha256(on_board.read_bytes()).hexdigest() == f.sha256, f.path


def test_a_full_flash_then_an_incremental_one_copies_only_what_changed(
    built: Path, board: PtyBoard, tmp_path: Path
) -> None:
    build = tmp_path / "build"
    shutil.copytree(built, build)
    files, _ = read_build(build)
    port = board.start()

    first = wren(tmp_path, "flash", "--port", port, "--build", str(build))
    assert first.returncode == 0, first.stderr
    assert sorted(_copied(first.stdout)) == sorted(f.path for f in files)
    total = sum(f.size for f in files)
    assert f"copied {len(files)} files ({total:,} bytes), skipped 0 unchanged" in first.stdout
    _same_files(build, board.flash)
    # Soft-reset from the friendly REPL: main.py ran (the demo, with no settings.json,
    # says it has no device id and ends).
    board.wait_for("settings.json has no device id")

    again = wren(tmp_path, "flash", "--port", port, "--build", str(build))
    assert again.returncode == 0, again.stderr
    assert _copied(again.stdout) == []
    assert f"copied 0 files (0 bytes), skipped {len(files)} unchanged" in again.stdout

    # One module changed: it alone goes.
    init = build / "edge_runtime" / "__init__.py"
    init.write_text(init.read_text() + "# changed\n")
    third = wren(tmp_path, "flash", "--port", port, "--build", str(build))
    assert third.returncode == 0, third.stderr
    assert _copied(third.stdout) == ["edge_runtime/__init__.py"]
    assert (board.flash / "edge_runtime" / "__init__.py").read_text().endswith("# changed\n")
    _same_files(build, board.flash)


def test_a_source_that_would_shadow_a_built_module_and_a_stale_one_are_removed(
    built: Path, board: PtyBoard, tmp_path: Path
) -> None:
    port = board.start()
    assert wren(tmp_path, "flash", "--port", port, "--build", str(built)).returncode == 0
    # MicroPython imports codec.py before codec.mpy: a leftover source would run instead.
    pkg = board.flash / "edge_runtime"
    (pkg / "codec.py").write_text("raise ImportError('stale')\n")
    (pkg / "gone.mpy").write_bytes(b"M\x06")
    (board.flash / "notes.txt").write_text("the user's own file, outside the package\n")
    done = wren(tmp_path, "flash", "--port", port, "--build", str(built), "--no-reset")
    assert done.returncode == 0, done.stderr
    assert "removed    edge_runtime/codec.py" in done.stdout
    assert "removed    edge_runtime/gone.mpy" in done.stdout
    assert not (pkg / "codec.py").exists() and not (pkg / "gone.mpy").exists()
    assert (board.flash / "notes.txt").exists()
    assert "removed 2," in done.stdout


def test_flash_over_a_socket_url_and_build_on_the_way(board: PtyBoard, tmp_path: Path) -> None:
    board.start()
    # --target: `wren build` first, then the flash, through pyserial's socket:// handler.
    done = wren(tmp_path, "flash", "--port", board.url, "--target", "unix")
    assert done.returncode == 0, done.stderr
    assert f"-> {board.url}" in done.stdout
    assert "copied 0 files" not in done.stdout
    assert (board.flash / "main.py").is_file()
    assert (board.flash / "edge_runtime" / "link.mpy").is_file()
    board.wait_for("settings.json has no device id")
    boots = board.boots
    again = wren(tmp_path, "flash", "--port", board.url, "--target", "unix")
    assert "copied 0 files (0 bytes)" in again.stdout, again.stderr
    # The flash's own soft reset (its query's, from the raw REPL, and the last one).
    assert board.boots >= boots + 2


def test_settings_are_checked_before_anything_is_copied(
    built: Path, board: PtyBoard, tmp_path: Path
) -> None:
    port = board.start()
    bad = tmp_path / "settings.json"
    bad.write_text('{"device": "d1", "port": "1883", "max_paylaod": 9000}')
    done = wren(tmp_path, "flash", "--port", port, "--build", str(built), "--settings", str(bad))
    assert done.returncode == 1
    assert "port: must be an integer, not str" in done.stderr
    assert "max_paylaod: the board reads no such key" in done.stderr
    assert list(board.flash.iterdir()) == []

    good = tmp_path / "good.json"
    good.write_text('{"device": "d1", "host": "127.0.0.1", "port": 1}')
    done = wren(tmp_path, "flash", "--port", port, "--build", str(built), "--settings", str(good),
                "--no-reset")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (board.flash / "settings.json").read_bytes() == good.read_bytes()


def test_a_romfs_build_is_deployed_once_and_the_board_runs_the_runtime_from_its_partition(
    tmp_path: Path,
) -> None:
    # A board whose firmware has a ROMFS partition (firmware_tests/sim/romfs_partition.py:
    # a file behind vfs.rom_ioctl, mounted at /rom at boot), written by mpremote's own
    # `romfs deploy` through the console, as on a board.
    out = tmp_path / "romfs"
    done = wren(ROOT, "build", "--target", "unix", "--romfs", "--out", str(out))
    assert done.returncode == 0, done.stderr
    image = (out / "romfs.img").read_bytes()
    flash = tmp_path / "flash"
    # A flash copy of the runtime from an earlier, plain flash: it would come before /rom.
    shutil.copytree(ROOT / "edge_runtime", flash / "edge_runtime")
    partition = tmp_path / "partition.bin"
    with PtyBoard(flash, romfs=partition) as board:
        port = board.start()
        done = wren(tmp_path, "flash", "--port", port, "--build", str(out))
        assert done.returncode == 0, done.stderr
        assert f"  deployed   ROMFS romfs.img  {len(image):>9,}" in done.stdout
        assert "  copied     main.py" in done.stdout
        assert "  removed    edge_runtime" in done.stdout
        assert partition.read_bytes()[: len(image)] == image
        assert sorted(p.name for p in flash.iterdir()) == ["main.py"]
        # The board boots into the runtime, found in its partition.
        board.wait_for("settings.json has no device id", timeout_s=30)
        where = subprocess.run(
            [sys.executable, "-m", "mpremote", "connect", port, "exec",
             "import edge_runtime.board as b; print(b.__file__)"],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        assert where.stdout.strip() == "/rom/edge_runtime/board.mpy", where.stdout + where.stderr
        # The same build again: the partition already holds the image, nothing is written.
        again = wren(tmp_path, "flash", "--port", port, "--build", str(out))
        assert again.returncode == 0, again.stderr
        assert "  unchanged  ROMFS romfs.img" in again.stdout
        assert "copied 0 files (0 bytes)" in again.stdout


def test_a_romfs_build_onto_a_board_without_romfs_is_refused_before_its_flash_changes(
    board: PtyBoard, tmp_path: Path
) -> None:
    # The unix port behind the pty has no ROMFS partition (no vfs.rom_ioctl), as stock
    # ESP32 and Pico W firmware have none: the flash says so and copies nothing.
    out = tmp_path / "romfs"
    done = wren(ROOT, "build", "--target", "unix", "--romfs", "--out", str(out))
    assert done.returncode == 0, done.stderr
    port = board.start()
    done = wren(tmp_path, "flash", "--port", port, "--build", str(out))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line == (
        "wren flash: the board's firmware has no ROMFS partition (vfs.rom_ioctl): flash a "
        "firmware with one, or build without --romfs"
    )
    assert list(board.flash.iterdir()) == []


@pytest.mark.parametrize("kind", ["path", "socket"])
def test_a_port_that_is_not_there_is_one_line(built: Path, tmp_path: Path, kind: str) -> None:
    port = "/dev/ttyWREN-NONE0" if kind == "path" else f"socket://127.0.0.1:{free_port()}"
    done = wren(tmp_path, "flash", "--port", port, "--build", str(built))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    why = "no such port" if kind == "path" else "Connection refused"
    assert line.startswith(f"wren flash: cannot open port {port}: ") and why in line


def test_a_directory_that_is_not_a_build_is_refused(tmp_path: Path) -> None:
    done = wren(tmp_path, "flash", "--port", "/dev/null", "--build", str(tmp_path))
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        == f"wren flash: no {BUILD_JSON} in {tmp_path}: not a `wren build` output"
    )
