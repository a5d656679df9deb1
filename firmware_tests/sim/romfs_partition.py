# A simulated ROMFS partition: what a MicroPython firmware built with ROMFS (v1.25 and
# later, MICROPY_VFS_ROM with a partition) gives a board, for the unix port, which has
# `vfs.VfsRom` but no partition to find one in (no `vfs.rom_ioctl`). Tests only: the
# board on a pseudo-terminal (tools/pty_board.py, PtyBoard(romfs=...)) imports it at each
# boot; it is never on a board's flash.
#
# boot() does what such a firmware does at its start: the `vfs` module gains rom_ioctl
# (this module stands in for it in sys.modules, with the built-in's names), and an image
# in the partition is mounted at /rom, with /rom and /rom/lib appended to sys.path after
# the flash. The partition is a file (WREN_SIM_ROMFS: its path, then its size, as
# "PATH:SIZE"), read into one buffer of its size at boot; a write changes the buffer,
# and the write's completion puts it back in the file, so it holds across reboots as a
# flash partition does. mpremote's `romfs query` and `romfs deploy` work on it as on a
# board's (the ioctls mpremote uses: 1 segments, 2 the segment, 3 prepare, 4 write,
# 5 complete, 6 block size).
import os
import sys

import vfs as _builtin

VfsRom = _builtin.VfsRom
VfsPosix = _builtin.VfsPosix
mount = _builtin.mount
umount = _builtin.umount

_BLOCK = 4096
_EINVAL = 22
_part = None
_path = None


def _load():
    global _part, _path
    where, size = os.getenv("WREN_SIM_ROMFS").rsplit(":", 1)
    _path = where
    _part = bytearray(int(size))
    try:
        with open(where, "rb") as f:
            f.readinto(_part)
    except OSError:
        # An erased partition, as flash reads.
        for i in range(len(_part)):
            _part[i] = 0xFF


def rom_ioctl(op, *args):
    if op == 1:
        return 1
    if not args or args[0] != 0:
        return -_EINVAL
    if op == 2:
        return memoryview(_part)
    if op == 6:
        return _BLOCK
    if op == 3:
        # Prepare (erase) a range; a write may be any size.
        offset, length = (0, args[1]) if len(args) == 2 else (args[1], args[2])
        if offset < 0 or offset + length > len(_part):
            return -_EINVAL
        for i in range(offset, offset + length):
            _part[i] = 0xFF
        return 4
    if op == 4:
        offset, data = args[1], args[2]
        if offset < 0 or offset + len(data) > len(_part):
            return -_EINVAL
        _part[offset : offset + len(data)] = data
        return 0
    if op == 5:
        with open(_path, "wb") as f:
            f.write(_part)
        return 0
    return -_EINVAL


def boot():
    _load()
    sys.modules["vfs"] = sys.modules[__name__]
    try:
        mount(VfsRom(memoryview(_part)), "/rom")
    except OSError:
        return  # no image in the partition: nothing mounted, as a firmware does
    sys.path.append("/rom")
    sys.path.append("/rom/lib")
