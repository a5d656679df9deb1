"""Every benchmark still starts: its imports resolve against the packages as they are
now and its options parse (`--help`). The benchmarks themselves take minutes and print
figures rather than assert; this keeps them from rotting between the runs that do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("bench_*.py"))


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 5, BENCHMARKS


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_the_benchmark_starts(path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
