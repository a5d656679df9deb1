"""`wren kb` as a user runs it: a subprocess in a fresh folder, on real files, with the
store where the CLI puts it by default (.wren/knowledge.sqlite3)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.kbfiles import make_pdf
from tools import kb as kb_cli

ROOT = Path(__file__).resolve().parent.parent


def wren(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def test_ingest_search_list_delete_a_folder(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "guide").mkdir(parents=True)
    (docs / "guide" / "kiosk.md").write_text(
        "# Kiosk\n\n## Reset\n\nHold the power button for ten seconds.\n"
    )
    (docs / "sheet.pdf").write_bytes(make_pdf([["Wear gloves with the reagent."]]))
    (docs / "empty.txt").write_text("")
    ing = wren(tmp_path, "kb", "ingest", "docs", "--tenant", "acme", "--collection", "manuals",
               "--tag", "v1")
    # A skipped file makes the exit 1; stdout (not a terminal) has a plain line per file.
    assert ing.returncode == 1, ing.stderr
    lines = ing.stdout.splitlines()
    assert "failed     empty.txt: empty file" in lines
    assert "new        guide/kiosk.md (1 chunks)" in lines
    assert "new        sheet.pdf (1 chunks)" in lines
    assert "\r" not in ing.stdout
    assert lines[-1].startswith("sources: 2 new, 0 changed, 0 unchanged, 1 failed; 2 chunks in ")
    assert (tmp_path / ".wren" / "knowledge.sqlite3").is_file()

    again = wren(tmp_path, "kb", "ingest", "docs/guide/kiosk.md", "docs/sheet.pdf",
                 "--tenant", "acme", "--collection", "manuals", "--tag", "v1")
    # Single files are sources by name: kiosk.md is new, sheet.pdf unchanged.
    assert again.returncode == 0, again.stdout + again.stderr
    assert "sources: 1 new, 0 changed, 1 unchanged, 0 failed" in again.stdout

    # --prune: the collection mirrors the paths given; the single kiosk.md goes again.
    mirror = wren(tmp_path, "kb", "ingest", "docs", "--tenant", "acme", "--collection", "manuals",
                  "--tag", "v1", "--prune")
    assert "removed    kiosk.md (1 chunks)" in mirror.stdout.splitlines(), mirror.stdout
    assert ", 1 removed; " in mirror.stdout
    again = wren(tmp_path, "kb", "ingest", "docs/guide/kiosk.md", "--tenant", "acme",
                 "--collection", "manuals", "--tag", "v1")
    assert again.returncode == 0, again.stdout + again.stderr

    found = wren(tmp_path, "kb", "search", "how do I reset it", "--tenant", "acme", "--k", "2",
                 "--mode", "keyword", "--json")
    assert found.returncode == 0, found.stderr
    hits = [json.loads(line) for line in found.stdout.splitlines()]
    assert hits[0]["source"] in ("guide/kiosk.md", "kiosk.md")
    assert hits[0]["headings"] == ["Kiosk", "Reset"] and hits[0]["collection"] == "manuals"
    assert len(hits[0]["version"]) == 64 and hits[0]["chunk"] == 0

    # Everything was ingested just now: within a week, and an age that is no age refused.
    recent = wren(tmp_path, "kb", "search", "how do I reset it", "--tenant", "acme",
                  "--mode", "keyword", "--max-age", "7d", "--json")
    first = [json.loads(line)["source"] for line in recent.stdout.splitlines()][:1]
    assert first == [hits[0]["source"]], recent.stdout + recent.stderr
    bad_age = wren(tmp_path, "kb", "search", "reset", "--tenant", "acme", "--max-age", "soon")
    assert bad_age.returncode == 2 and "expected an age like" in bad_age.stderr

    other = wren(tmp_path, "kb", "search", "reset", "--tenant", "beta")
    assert other.returncode == 0 and other.stdout == "no passages found\n"
    listed = wren(tmp_path, "kb", "list", "--tenant", "acme", "--collection", "manuals")
    assert [ln.split("\t")[0] for ln in listed.stdout.splitlines()] == [
        "guide/kiosk.md", "kiosk.md", "sheet.pdf"
    ]

    shown = wren(tmp_path, "kb", "show", "--tenant", "acme", "--collection", "manuals",
                 "--source", "guide/kiosk.md", "--full")  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    head, *chunks = shown.stdout.splitlines()
    assert head.startswith("guide/kiosk.md in manuals: version ") and "1 chunks" in head
    assert "tags v1" in head
    assert chunks[0] == "[0] Kiosk > Reset"
    assert "Hold the power button for ten seconds." in chunks[1]
    none = wren(tmp_path, "kb", "show", "--tenant", "acme", "--collection", "manuals",
                "--source", "nope.md")  # fmt: skip
    assert none.returncode == 1 and "no source 'nope.md'" in none.stderr
    bad_k = wren(tmp_path, "kb", "search", "reset", "--tenant", "acme", "--k", "0")
    assert bad_k.returncode == 1
    assert bad_k.stderr.strip() == "wren kb search: k 0 is outside 1..100"

    gone = wren(tmp_path, "kb", "delete", "--tenant", "acme", "--collection", "manuals",
                "--source", "kiosk.md")
    assert gone.stdout == "deleted source kiosk.md of manuals (1 chunks)\n"
    gone = wren(tmp_path, "kb", "delete", "--tenant", "acme", "--collection", "manuals")
    assert gone.stdout == "deleted collection manuals (2 chunks)\n"
    after = wren(tmp_path, "kb", "search", "reset", "--tenant", "acme")
    assert after.stdout == "no passages found\n"
    missing = wren(tmp_path, "kb", "delete", "--tenant", "acme", "--collection", "manuals")
    assert missing.returncode == 1 and "no collection 'manuals'" in missing.stderr


def test_search_without_a_store_says_so(tmp_path: Path) -> None:
    r = wren(tmp_path, "kb", "search", "q", "--tenant", "t", "--store", "nope.sqlite3")
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "wren kb search: no knowledge store at nope.sqlite3 (`wren kb ingest` makes one)"
    )
    assert not (tmp_path / "nope.sqlite3").exists()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_live_line() -> None:
    out = _Tty()
    line = kb_cli._ProgressLine(out)
    ok = SimpleNamespace(status="new", source="a.md", chunks=3, reason="")
    bad = SimpleNamespace(status="failed", source="b.txt", chunks=0, reason="empty file")
    line(SimpleNamespace(files_done=1, files_total=2, chunks=3, embedded=3, seconds=1.0,
                         current="a.md", result=ok))
    line(SimpleNamespace(files_done=2, files_total=2, chunks=3, embedded=3, seconds=2.0,
                         current="b.txt", result=bad))
    line.done()
    text = out.getvalue()
    assert text.startswith("\rfiles 1/2  chunks 3  embedded 3  3 chunks/s  ETA 0:01  a.md")
    assert "failed     b.txt: empty file\n" in text  # failures stay on screen
    assert text.endswith("\rfiles 2/2  chunks 3  embedded 3  2 chunks/s  b.txt\n")
