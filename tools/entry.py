"""The `wren` command's entry point: Ctrl-C while the command line's modules are still
loading is the same one line as after (`stopped`, exit 130), not an import traceback."""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from tools.cli import main
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
