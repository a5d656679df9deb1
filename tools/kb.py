"""`wren kb`: document knowledge from the command line (server_bridge.knowledge).

wren kb ingest PATH... --tenant T --collection C [--tag TAG]... [--prune] [--max-mb MB]
               [--nice N] [--threads N] [--idle] [--no-embed]
wren kb search QUERY --tenant T [--collection C]... [--source S]... [--tag TAG]... [--k N]
               [--mode dense|keyword|hybrid] [--max-age AGE] [--max-chars N] [--json]
wren kb list --tenant T [--collection C]
wren kb show --tenant T --collection C --source S [--full]
wren kb delete --tenant T --collection C [--source S]

The store is one SQLite file, by default beside the registry (.wren/knowledge.sqlite3);
--store names another, or a fleet's PostgreSQL (postgresql://...). A folder is ingested
recursively by extension, each file's source id its path relative to that folder; a file
given on its own is its name. With --prune the collection then mirrors the paths given:
its sources they no longer hold (files deleted since the last ingest) are removed, while
one that failed this time keeps its last good version. `show` prints one source as
stored: its version, tags and chunks (each chunk's whole text with --full).

An ingest is polite to a bridge on the same machine: it lowers its own CPU priority
(`--nice`, default NICE) before the model loads, and embeds on a bounded number of
onnxruntime threads (`--threads`, default THREADS), so the boards' runs keep their
latency while it works (benchmarks/bench_ingest_load.py measures it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from server_bridge.pgstore import location

# Beside the registry `wren tenant add` makes (.wren/registry.json), so one folder
# holds a checkout's bridge state.
DEFAULT_STORE = Path(".wren/knowledge.sqlite3")
# A terminal's progress line is redrawn at most this often: more is flicker and cost.
REDRAW_S = 0.1
# The niceness an ingest adds to its own (0 leaves it): an ingest is a batch job that
# takes as long as it takes, while a bridge on the same machine streams boards' runs.
# Measured in benchmarks/bench_ingest_load.py (DESIGN "Knowledge").
NICE = 10
# Embedding threads (onnxruntime intra-op) of an ingest, bounded: measured on 2 cores
# (benchmarks/bench_ingest_load.py), 2 threads at NICE embed 24 chunks/s against 16 on
# one, and the boards' first deltas kept their figure (1.04x), while the same 2 threads
# at normal priority cost them 1.21x. The bridge's own recall keeps its 1.
THREADS = 2


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """Register `wren kb` and its actions on the `wren` subparsers."""
    from server_bridge.knowledge import DEFAULT_MAX_CHARS, DEFAULT_MAX_FILE_BYTES, MAX_K

    kb = sub.add_parser("kb", help="document knowledge: ingest, search, list, show, delete")
    ksub = kb.add_subparsers(dest="action", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tenant", required=True, help="whose knowledge")
        p.add_argument("--store", type=location, default=DEFAULT_STORE,
                       help="the knowledge store file, or the PostgreSQL URL "
                       "(postgresql://...) of a fleet's")  # fmt: skip

    i = ksub.add_parser("ingest", help="ingest files and folders (.txt .md .html .pdf)")
    i.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files or folders")
    common(i)
    i.add_argument("--collection", required=True, help="the collection to ingest into")
    i.add_argument(
        "--tag", action="append", default=[], help="a tag for every source (repeat; default none)"
    )
    i.add_argument(
        "--max-mb",
        type=float,
        default=DEFAULT_MAX_FILE_BYTES / 1e6,
        help="skip files larger than this many MB",
    )
    i.add_argument(
        "--prune",
        action="store_true",
        help="then remove the collection's sources these paths no longer hold (files deleted "
        "since the last ingest), so the collection mirrors them",
    )
    i.add_argument(
        "--nice",
        type=int,
        default=NICE,
        help=f"lower this process's CPU priority by N while ingesting, so a bridge on the "
        f"same machine keeps its latency (default {NICE}; 0 leaves it)",
    )
    i.add_argument(
        "--threads",
        type=int,
        default=THREADS,
        help=f"onnxruntime threads for embedding (default {THREADS}; with --nice 0 on a "
        f"small machine, 1 leaves a core to a bridge beside it)",
    )
    i.add_argument(
        "--idle",
        action="store_true",
        help="also run in Linux's SCHED_IDLE class: only on CPU time nothing else wants",
    )
    i.add_argument(
        "--no-embed",
        action="store_true",
        help="keyword index only (fast; dense search finds these sources once re-ingested "
        "with the model)",
    )

    s = ksub.add_parser("search", help="the best passages for a question")
    s.add_argument("query", help="the question (at most 8,192 characters)")
    common(s)
    for flag, what in (
        ("--collection", "only these collections (repeat; default all)"),
        ("--source", "only these sources (repeat; default all)"),
        ("--tag", "only sources with every tag given (repeat; default any)"),
    ):
        s.add_argument(flag, action="append", default=[], help=what)
    s.add_argument("--k", type=int, default=5, help=f"hits, 1..{MAX_K}")
    s.add_argument("--mode", choices=("dense", "keyword", "hybrid"), default="hybrid")
    s.add_argument(
        "--max-age",
        type=_age,
        metavar="AGE",
        help="only sources ingested (in their current version) within AGE: seconds, or "
        "with a unit, 90m, 12h, 7d",
    )
    s.add_argument(
        "--max-chars", type=int, default=DEFAULT_MAX_CHARS, help="characters of passage text in all"
    )
    s.add_argument("--json", action="store_true", help="one JSON object per hit")

    li = ksub.add_parser("list", help="the tenant's collections, or one collection's sources")
    common(li)
    li.add_argument("--collection", help="list this collection's sources")

    sh = ksub.add_parser("show", help="one source as stored: its version, tags and chunks")
    common(sh)
    sh.add_argument("--collection", required=True)
    sh.add_argument("--source", required=True, help="its id as `wren kb list` shows it")
    sh.add_argument("--full", action="store_true", help="each chunk's whole text")

    d = ksub.add_parser("delete", help="delete a collection, or one source of it")
    common(d)
    d.add_argument("--collection", required=True)
    d.add_argument("--source", help="only this source (its id as `wren kb list` shows it)")


class _ProgressLine:
    """One line redrawn in place on a terminal; a plain line per file elsewhere (a log
    or a pipe wants every file, not carriage returns)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.last = 0.0
        self.width = 0

    def __call__(self, p: Any) -> None:
        result = p.result
        if not self.tty:
            if result is not None:
                self.out.write(_file_line(result) + "\n")
            return
        if result is not None and result.status == "failed":
            self._clear()
            self.out.write(_file_line(result) + "\n")
        now = time.monotonic()
        if now - self.last < REDRAW_S and p.files_done < p.files_total:
            return
        self.last = now
        rate = p.chunks / p.seconds if p.seconds > 0 else 0.0
        eta = ""
        if p.files_done and p.files_done < p.files_total:
            left = p.seconds / p.files_done * (p.files_total - p.files_done)
            eta = f"  ETA {int(left) // 60}:{int(left) % 60:02d}"
        line = (
            f"files {p.files_done}/{p.files_total}  chunks {p.chunks}  embedded {p.embedded}"
            f"  {rate:.0f} chunks/s{eta}  {p.current}"
        )[:120]
        self.out.write("\r" + line.ljust(self.width))
        self.width = len(line)
        self.out.flush()

    def _clear(self) -> None:
        if self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.width = 0

    def done(self) -> None:
        if self.tty and self.width:
            self.out.write("\n")


def _file_line(r: Any) -> str:
    if r.status == "failed":
        return f"failed     {r.source}: {r.reason}"
    return f"{r.status:<10} {r.source}" + (f" ({r.chunks} chunks)" if r.chunks else "")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Carry out a `wren kb` action; 1 with one line on stderr when refused."""
    from server_bridge.knowledge import KnowledgeError

    out = out or sys.stdout
    try:
        if args.action == "ingest":
            return _ingest(args, out)
        if args.action == "search":
            return _search(args, out)
        if args.action == "list":
            return _list(args, out)
        if args.action == "show":
            return _show(args, out)
        if args.action == "delete":
            return _delete(args, out)
    except KnowledgeError as e:
        print(f"wren kb {args.action}: {e}", file=sys.stderr)
        return 1
    return 2


def _open(args: argparse.Namespace, *, create: bool = False, embed: bool = True) -> Any:
    from server_bridge.knowledge import KnowledgeBase, NotFound

    store = args.store
    if isinstance(store, str):
        # A fleet's knowledge on PostgreSQL: the bridges read what this writes.
        from server_bridge.pgstore.knowledge import PgKnowledgeStore

        store = PgKnowledgeStore(store)
    elif not create and not store.exists():
        # Not created on the way: a mistyped --store would otherwise look empty.
        raise NotFound(f"no knowledge store at {store} (`wren kb ingest` makes one)")
    kw: dict[str, Any] = {}
    if not embed:
        kw["embedder"] = None
    elif getattr(args, "threads", 1) != 1:
        # 1 is recall's shared default embedder; any other count is a session of its own.
        kw["embedder"] = _embedder(args.threads)
    if getattr(args, "max_mb", None) is not None:
        kw["max_file_bytes"] = max(1, int(args.max_mb * 1e6))
    return KnowledgeBase(store, **kw)


def be_polite(nice: int, idle: bool = False) -> str:
    """Lower this process's CPU priority for a batch job: `nice` more niceness (where the
    platform has os.nice), and with `idle` Linux's SCHED_IDLE class. Returns what was
    done, for the log. Linux keeps a priority per thread and a new thread inherits its
    creator's, so this is called before anything starts threads (onnxruntime, sqlite).
    A refusal (a container without the right) leaves the priority as it was."""
    done: list[str] = []
    if nice > 0 and hasattr(os, "nice"):
        try:
            done.append(f"nice {os.nice(nice)}")
        except OSError as e:
            done.append(f"nice refused ({e.strerror})")
    if idle:
        if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                done.append("SCHED_IDLE")
            except OSError as e:
                done.append(f"SCHED_IDLE refused ({e.strerror})")
        else:
            done.append("SCHED_IDLE unavailable")
    return ", ".join(done) or "normal priority"


def _embedder(threads: int) -> Any:
    """Recall's MiniLM on `threads` onnxruntime threads, or "auto" (its default embedder,
    or none with its logged reason) when it cannot be built."""
    from server_bridge.memory.recall import MiniLMEmbedder, ModelFileError

    try:
        return MiniLMEmbedder(threads=max(1, threads))
    except (ImportError, ModelFileError):
        return "auto"


def _ingest(args: argparse.Namespace, out: TextIO) -> int:
    from server_bridge.knowledge import Connector, FileList, Folder

    be_polite(args.nice, args.idle)

    connectors: list[Connector] = []
    files: list[Path] = []
    for p in args.paths:
        if p.is_dir():
            connectors.append(Folder(p))
        else:
            files.append(p)  # a missing file is listed as failed, with the reason
    if files:
        connectors.append(FileList(files))
    progress = _ProgressLine(out)
    with _open(args, create=True, embed=not args.no_embed) as kb:
        summary = kb.ingest(
            connectors,
            tenant=args.tenant,
            collection=args.collection,
            tags=args.tag,
            progress=progress,
            prune=args.prune,
        )
    # Every failed file has had its line already (on a terminal, above the live line).
    progress.done()
    out.write(summary.line() + "\n")
    return 1 if summary.failed else 0


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _age(text: str) -> float:
    """`--max-age`: seconds, or a number with s, m, h or d; an argparse type."""
    unit = _AGE_UNITS.get(text[-1:].lower())
    number = text[:-1] if unit is not None else text
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an age like 3600, 90m, 12h or 7d, not {text!r}"
        ) from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"an age must be positive, not {text!r}")
    return value


def _search(args: argparse.Namespace, out: TextIO) -> int:
    with _open(args) as kb:
        result = kb.retrieve(
            args.tenant,
            args.query,
            k=args.k,
            mode=args.mode,
            collections=args.collection,
            sources=args.source,
            tags=args.tag,
            max_chars=args.max_chars,
            max_age_s=args.max_age,
        )
    if result.note:
        print(f"wren kb search: {result.note}", file=sys.stderr)
    for n, h in enumerate(result.hits, start=1):
        if args.json:
            out.write(
                json.dumps(
                    {
                        "collection": h.collection,
                        "source": h.source,
                        "version": h.version,
                        "chunk": h.chunk,
                        "headings": list(h.headings),
                        "score": h.score,
                        "mode": result.mode,
                        "text": h.text,
                        "truncated": h.truncated,
                    }
                )
                + "\n"
            )
            continue
        where = " > ".join(h.headings)
        out.write(
            f"{n}. {h.collection}/{h.source}  version {h.version[:12]}  chunk {h.chunk}"
            f"{'  ' + where if where else ''}  {result.mode} {h.score:.3f}\n"
        )
        text = h.text.replace("\n", "\n   ")
        out.write(f"   {text}{' [cut]' if h.truncated else ''}\n")
    if not result.hits and not args.json:
        out.write("no passages found\n")
    return 0


def _list(args: argparse.Namespace, out: TextIO) -> int:
    with _open(args) as kb:
        if args.collection is None:
            rows = kb.collections(args.tenant)
            for c in rows:
                out.write(f"{c.name}\t{c.sources} sources\t{c.chunks} chunks\t{c.bytes} bytes\n")
            if not rows:
                out.write(f"tenant {args.tenant} has no collections\n")
            return 0
        for s in kb.sources(args.tenant, args.collection):
            tags = ",".join(s.tags) or "-"
            out.write(
                f"{s.source}\tversion {s.version[:12]}\t{s.chunks} chunks\t"
                f"{'embedded' if s.embedder else 'keyword only'}\ttags {tags}\n"
            )
    return 0


def _show(args: argparse.Namespace, out: TextIO) -> int:
    # What a retrieval can return of the source: each chunk with the heading path it was
    # embedded and indexed with.
    with _open(args) as kb:
        row, chunks = kb.show(args.tenant, args.collection, args.source)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.ingested))
    out.write(f"{row.source} in {row.collection}: version {row.version}, {row.bytes} bytes, "
              f"{row.chunks} chunks, ingested {when}, "
              f"{'embedded by ' + row.embedder if row.embedder else 'keyword only'}, "
              f"tags {','.join(row.tags) or '-'}\n")  # fmt: skip
    for c in chunks:
        text = c.text if args.full else _preview(c.text)
        out.write(f"[{c.index}] {' > '.join(c.headings) or '-'}\n    {text}\n")
    return 0


def _preview(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _delete(args: argparse.Namespace, out: TextIO) -> int:
    with _open(args) as kb:
        if args.source is not None:
            n = kb.delete_source(args.tenant, args.collection, args.source)
            out.write(f"deleted source {args.source} of {args.collection} ({n} chunks)\n")
        else:
            n = kb.delete_collection(args.tenant, args.collection)
            out.write(f"deleted collection {args.collection} ({n} chunks)\n")
    return 0
