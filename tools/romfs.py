"""A board's modules as a ROMFS image, and the unix port booting with one.

ROMFS (MicroPython v1.25 and later, where a firmware enables it) is a read-only file
system in a flash partition of its own. A `.mpy` imported from it is not copied into the
heap: its bytecode runs where it lies, and its string and bytes constants are used in
place, as a frozen module's are. So a board whose firmware has a ROMFS partition gets
nearly a frozen firmware's heap without building a firmware: `wren build --romfs` writes
the image, `mpremote romfs deploy` (or `wren flash --romfs`) puts it on the board.

The image is written with mpremote's `VfsRomWriter`, the reference writer of the format
(mpremote is already what flashes a board). At boot a ROMFS firmware mounts it at /rom and
appends `/rom` and `/rom/lib` to `sys.path`, after the flash's root: a flash copy of a
module shadows the ROM's (`wren flash` removes such copies).

The unix port can mount an image (`vfs.VfsRom`) but has no partition to find one in. A
virtual board with a `romfs.img` in its flash directory boots with `boot_code()`: the image
is read into one buffer at the bottom of the heap, mounted as a firmware would, and
main.py runs. The heap a board is given (`heap_for`) is then the heap beyond the image, as
on a board, where the image is flash.
"""

from __future__ import annotations

from pathlib import Path

IMAGE = "romfs.img"
# What a ROMFS firmware puts on sys.path after the flash root (extmod/vfs.c).
MOUNT = "/rom"
# What a board runs once booted, for `-c` on the unix port: main.py, as a script.
RUN_MAIN = "with open('main.py') as _f:\n    _main = _f.read()\ndel _f\nexec(_main)\n"
# The GC's cost of a heap block beyond its bytes: two bits in the allocation table and one
# in the finaliser table (py/gc.c), in bytes.
_GC_TABLE_BYTES_PER_BLOCK = 3 / 8


class RomfsError(Exception):
    """An image that cannot be written or booted (a name ROMFS cannot hold, a CPython
    board); the message is the one line the user sees."""


def image_of(root: Path) -> bytes:
    """The ROMFS image of the files under `root`, directories included, in name order (so
    the same files give the same bytes)."""
    try:
        from mpremote.romfs import VfsRomWriter
    except ImportError as e:
        raise RomfsError(
            f"mpremote's ROMFS writer is not installed ({e}): pip install mpremote"
        ) from None
    writer = VfsRomWriter()

    def add(folder: Path) -> None:
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            if not entry.name.isascii():
                raise RomfsError(f"{entry}: a ROMFS name is ASCII")
            if entry.is_dir():
                writer.opendir(entry.name)
                add(entry)
                writer.closedir()
            else:
                writer.mkfile(entry.name, entry.read_bytes())

    add(root)
    return bytes(writer.finalise())


def boot_code(then: str | None = None, image: str = IMAGE) -> str:
    """The unix port's stand-in for a ROMFS firmware's boot, then main.py (or the code
    `then`): `image` (in the working directory) read into one buffer of its exact size, so
    nothing is left behind it in the heap, mounted at /rom, and /rom and /rom/lib put on
    sys.path."""
    run = RUN_MAIN if then is None else f"exec({then!r})\n"
    return (
        "import os, sys, vfs\n"
        f"_rom = bytearray(os.stat({image!r})[6])\n"
        f"with open({image!r}, 'rb') as _f:\n"
        "    _f.readinto(_rom)\n"
        f"vfs.mount(vfs.VfsRom(_rom), {MOUNT!r})\n"
        f"sys.path.append({MOUNT!r})\n"
        f"sys.path.append({MOUNT + '/lib'!r})\n"
        "del _rom, _f, os, sys, vfs\n" + run
    )


def heap_for(block: int, heap_bytes: int, image_bytes: int) -> int:
    """The `-X heapsize` that leaves `heap_bytes` beyond an image of `image_bytes` on a
    binary whose GC blocks are `block` bytes (tools/virtual_board.py gc_block_bytes): the
    image's buffer's blocks (the object's header and its data), their share of the GC's
    tables, and one block for the data's alignment."""
    blocks = -(-image_bytes // block) + 2
    return heap_bytes + int(blocks * (block + _GC_TABLE_BYTES_PER_BLOCK)) + block
