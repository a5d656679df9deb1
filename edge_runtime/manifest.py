# Wren's board package for a firmware of your own: MicroPython's manifest format, read by
# its makemanifest when a port is built, never by a board (`wren build` and the virtual
# board leave this file off a board's flash, and nothing imports it). Include it from
# your board's manifest, after the port's own:
#
#     include("$(PORT_DIR)/boards/manifest.py")
#     include("/path/to/wren/edge_runtime/manifest.py")
#
# or let `wren build --target esp32 --frozen-manifest manifest.py` write that manifest,
# with your agent frozen in too.
#
# No metadata() line, unlike a micropython-lib package: an include()d manifest shares the
# including one's metadata (a second metadata() call is an error there), and with a
# version makemanifest appends `__version__ = "<version>"` to every module it freezes,
# one more name in each module's dict on the board's heap. package.json carries the
# version for mip.

# Makemanifest runs this file with CPython on the build machine, from this directory.
import os

# Every module of the package but this file, each frozen as edge_runtime.x. opt=3: no
# line-number tables and no asserts, as the .mpy files `wren build` makes
# (-X no-source-lines): a traceback names the module and the function.
package(
    "edge_runtime",
    files=sorted(f for f in os.listdir(".") if f.endswith(".py") and f != "manifest.py"),
    base_path="..",
    opt=3,
)
