"""Bytes to a `Document`: text in sections, each under its heading path.

Plain text, Markdown, HTML (text only, with the standard library's html.parser) and
PDF (pypdf, imported only when a PDF comes, so the bridge runs without it). Every
refusal is a `SkipFile` whose message the ingest summary shows: empty, binary content
behind a text extension, text that is not UTF-8, a broken or encrypted PDF, a PDF
without a text layer, extracted text over the limit.
"""

from __future__ import annotations

import codecs
import io
import logging
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

from .errors import SkipFile

__all__ = ["Document", "Section", "extract", "pdf_available"]

log = logging.getLogger("wren.bridge.knowledge")


@dataclass
class Section:
    """Paragraphs under one heading path (outermost heading first)."""

    headings: tuple[str, ...]
    paragraphs: list[str] = field(default_factory=list)


@dataclass
class Document:
    sections: list[Section]

    @property
    def chars(self) -> int:
        return sum(len(p) for s in self.sections for p in s.paragraphs)


# --- text ------------------------------------------------------------------------------

# How much of the start is checked for NUL bytes: text files have none, and nearly
# every binary format has some in its first few KiB.
_SNIFF = 8192
_BLANK = re.compile(r"\n[ \t]*\n+")
_SPACES = re.compile(r"[ \t\r\f\v]+")


def _decode(data: bytes) -> str:
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        # UTF-16 is text with NUL bytes: its byte order mark says so.
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise SkipFile(f"not valid UTF-16 (at byte {e.start})") from e
    if b"\x00" in data[:_SNIFF]:
        raise SkipFile("binary content (NUL bytes) behind a text extension")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SkipFile(
            f"not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from e


def _paragraphs(text: str) -> list[str]:
    out = []
    for block in _BLANK.split(text.replace("\r\n", "\n")):
        para = _SPACES.sub(" ", block).strip()
        if para:
            out.append(para)
    return out


def _plain(text: str) -> Document:
    return Document([Section((), _paragraphs(text))])


# --- Markdown ----------------------------------------------------------------------------

_ATX = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")


def _markdown(text: str) -> Document:
    sections: list[Section] = []
    path: list[tuple[int, str]] = []  # (level, title)
    lines: list[str] = []
    fence: str | None = None

    def flush(headings: tuple[str, ...]) -> None:
        paras = _paragraphs("\n".join(lines))
        lines.clear()
        if paras:
            sections.append(Section(headings, paras))

    def heading(level: int, title: str) -> None:
        flush(tuple(t for _, t in path))
        while path and path[-1][0] >= level:
            path.pop()
        path.append((level, title.strip()))

    for line in text.replace("\r\n", "\n").split("\n"):
        if fence is not None:
            lines.append(line)
            if line.strip().startswith(fence):
                fence = None
            continue
        m = _FENCE.match(line)
        if m:
            fence = m.group(1)
            lines.append(line)
            continue
        m = _ATX.match(line)
        if m:
            heading(len(m.group(1)), m.group(2))
            continue
        m = _SETEXT.match(line)
        # A setext underline makes a heading of the one line above it (a longer
        # paragraph above a --- is a paragraph and a rule, as CommonMark reads it).
        if m and lines and lines[-1].strip() and (len(lines) == 1 or not lines[-2].strip()):
            title = lines.pop()
            heading(1 if m.group(1)[0] == "=" else 2, title)
            continue
        lines.append(line)
    flush(tuple(t for _, t in path))
    return Document(sections)


# --- HTML --------------------------------------------------------------------------------

_BLOCK = frozenset(
    "p div li ul ol dl dt dd tr table section article aside header footer nav main "
    "blockquote pre figure figcaption br hr form fieldset address details summary".split()
)
_HIDDEN = frozenset({"script", "style", "noscript", "template", "head", "svg"})
_HEADING = {f"h{i}": i for i in range(1, 7)}


class _HTMLText(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[Section] = []
        self.path: list[tuple[int, str]] = []
        self.paras: list[str] = []
        self.buf: list[str] = []
        self.hidden = 0
        self.in_heading: int | None = None
        self.title: list[str] = []

    def _end_para(self) -> None:
        para = _SPACES.sub(" ", " ".join(self.buf).replace("\n", " ")).strip()
        self.buf.clear()
        if para:
            self.paras.append(para)

    def _end_section(self) -> None:
        self._end_para()
        if self.paras:
            self.sections.append(Section(tuple(t for _, t in self.path), self.paras))
        self.paras = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _HIDDEN:
            self.hidden += 1
        elif tag in _HEADING:
            self._end_section()
            self.in_heading = _HEADING[tag]
            self.title = []
        elif tag in _BLOCK:
            self._end_para()

    def handle_endtag(self, tag: str) -> None:
        if tag in _HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in _HEADING and self.in_heading is not None:
            level = self.in_heading
            self.in_heading = None
            title = _SPACES.sub(" ", " ".join(self.title)).strip()
            while self.path and self.path[-1][0] >= level:
                self.path.pop()
            if title:
                self.path.append((level, title))
        elif tag in _BLOCK:
            self._end_para()

    def handle_data(self, data: str) -> None:
        if self.hidden:
            return
        (self.title if self.in_heading is not None else self.buf).append(data)


def _html(text: str) -> Document:
    parser = _HTMLText()
    parser.feed(text)
    parser.close()
    parser._end_section()
    return Document(parser.sections)


# --- PDF ---------------------------------------------------------------------------------


def pdf_available() -> bool:
    try:
        import pypdf  # noqa: F401
    except ImportError:
        return False
    return True


def _pdf(data: bytes, max_chars: int) -> Document:
    try:
        import pypdf
        from pypdf.errors import PdfReadError
    except ImportError as e:
        raise SkipFile("PDF support is not installed (pip install 'wren[knowledge]')") from e
    if not data.lstrip()[:5].startswith(b"%PDF-"):
        raise SkipFile("broken PDF: no %PDF- header")
    sections: list[Section] = []
    total = 0
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            # Many PDFs are encrypted with an empty user password (permissions only),
            # and every viewer opens them: so does this.
            try:
                opened = reader.decrypt("")
            except Exception as e:  # noqa: BLE001 - pypdf's crypto raises several kinds
                raise SkipFile(f"encrypted PDF that cannot be opened ({e})") from e
            if not opened:
                raise SkipFile("encrypted PDF (it needs a password)")
        for number, page in enumerate(reader.pages, start=1):
            text = page.extract_text() or ""
            total += len(text)
            if total > max_chars:
                raise SkipFile(f"PDF text over the limit ({max_chars:,} characters)")
            paras = _paragraphs(text)
            if paras:
                sections.append(Section((f"page {number}",), paras))
    except SkipFile:
        raise
    except PdfReadError as e:
        raise SkipFile(f"broken PDF: {e}") from e
    except Exception as e:  # noqa: BLE001 - a malformed file can fail anywhere in pypdf
        raise SkipFile(f"broken PDF: {type(e).__name__}: {e}") from e
    if not sections:
        raise SkipFile("PDF has no text layer (a scanned PDF needs OCR first)")
    return Document(sections)


# ---------------------------------------------------------------------------------------

KINDS = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
    ".pdf": "pdf",
}


def extract(data: bytes, kind: str, max_chars: int) -> Document:
    """The document in `data`, read as `kind` (a file extension, e.g. ".md")."""
    fmt = KINDS.get(kind.lower())
    if fmt is None:
        raise SkipFile(f"unsupported extension {kind or '(none)'!r}")
    if not data.strip():
        raise SkipFile("empty file")
    if fmt == "pdf":
        doc = _pdf(data, max_chars)
    else:
        text = _decode(data)
        if len(text) > max_chars:
            raise SkipFile(f"text over the limit ({max_chars:,} characters)")
        doc = {"text": _plain, "markdown": _markdown, "html": _html}[fmt](text)
    if not doc.chars:
        raise SkipFile("no text in it")
    return doc
