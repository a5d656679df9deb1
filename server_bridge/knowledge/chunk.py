"""A `Document` to chunks of at most `size` characters with `overlap` carried over.

Cuts come at headings first (a chunk never spans two sections, so its heading path
says where all of it came from), then between paragraphs, then between sentences,
then between words, and only for a word longer than the chunk itself in the middle
of it. The next chunk of the same section starts with the last `overlap` characters
of the one before (from a word boundary), so a sentence cut in two is whole in one of
them.

Defaults: 1,000 characters is about 170 English words, under MiniLM's 256 tokens
(recall.MAX_TOKENS: past them the embedder reads nothing), with room for the heading
path that is embedded with the text. 150 of overlap is one or two sentences. The
quality table (benchmarks/bench_knowledge_quality.py, DESIGN "Knowledge") confirms
them: within a search's default 8,000 characters, 1000/150 hybrid finds the answer
to 93.9% of the questions, the best of every chunking tried (600/100 89.6%, 1000/0
93.4%, 1000/300 93.4%, 1200/150 92.5%, 1500/200 90.6%, 2000/250 87.7%). Larger
chunks rank better at a fixed k (1500/200: MRR@10 0.669 against 0.617), but each of
their hits is half as long again, and the embedder does not read a chunk's end past
its 256 tokens; a caller who wants them passes chunk_size.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import InvalidOption
from .extract import Document

__all__ = ["DEFAULT_OVERLAP", "DEFAULT_SIZE", "Chunk", "chunk", "recipe"]

DEFAULT_SIZE = 1000
DEFAULT_OVERLAP = 150
_MIN_SIZE = 100
_MAX_SIZE = 20_000

_SENTENCE = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Chunk:
    index: int
    headings: tuple[str, ...]
    text: str

    def context(self) -> str:
        """What is embedded and indexed: the heading path, then the text."""
        if not self.headings:
            return self.text
        return " > ".join(self.headings) + "\n" + self.text


def recipe(size: int, overlap: int) -> str:
    """Names the chunking: a source chunked another way is re-chunked on ingest."""
    return f"chunk1:{size}/{overlap}"


def check(size: int, overlap: int) -> None:
    if not _MIN_SIZE <= size <= _MAX_SIZE:
        raise InvalidOption(f"chunk size {size} is outside {_MIN_SIZE}..{_MAX_SIZE}")
    if not 0 <= overlap <= size // 2:
        raise InvalidOption(f"overlap {overlap} is outside 0..{size // 2} (half the size)")


def _pieces(paragraph: str, size: int) -> Iterator[str]:
    """The paragraph in pieces of at most `size`: sentences, else words, else cut."""
    if len(paragraph) <= size:
        yield paragraph
        return
    for sentence in _SENTENCE.split(paragraph):
        if len(sentence) <= size:
            yield sentence
            continue
        line = ""
        for word in sentence.split(" "):
            while len(word) > size:
                if line:
                    yield line
                    line = ""
                yield word[:size]
                word = word[size:]
            if line and len(line) + 1 + len(word) > size:
                yield line
                line = ""
            line = f"{line} {word}" if line else word
        if line:
            yield line


def _tail(text: str, overlap: int) -> str:
    if overlap <= 0 or len(text) <= overlap:
        return text if overlap > 0 else ""
    cut = text[-overlap:]
    space = cut.find(" ")
    return cut[space + 1 :] if 0 <= space < len(cut) - 1 else cut


def chunk(doc: Document, size: int = DEFAULT_SIZE, overlap: int = DEFAULT_OVERLAP) -> list[Chunk]:
    check(size, overlap)
    out: list[Chunk] = []
    for section in doc.sections:
        current = ""
        fresh = True  # `current` holds only carried-over overlap, nothing new
        for para in section.paragraphs:
            # Room for the carried overlap and the space after it.
            for piece in _pieces(para, size - overlap - 1 if overlap else size):
                sep = "\n\n" if piece is para else " "
                joined = f"{current}{sep}{piece}" if current else piece
                if len(joined) <= size:
                    current, fresh = joined, False
                    continue
                if not fresh:
                    out.append(Chunk(len(out), section.headings, current))
                carried = _tail(current, overlap) if not fresh else ""
                current = f"{carried} {piece}" if carried else piece
                fresh = False
        if current and not fresh:
            out.append(Chunk(len(out), section.headings, current))
    return out
