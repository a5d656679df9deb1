"""Files and a test embedder for the knowledge tests: a PDF written byte by byte (so
the suite ships no binary), and a deterministic bag-of-words embedder that counts
what it is asked to embed."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from server_bridge.memory.recall import analyze


def make_pdf(pages: list[list[str]]) -> bytes:
    """A minimal PDF 1.4: one Helvetica text line per string, one page per list."""
    objs: list[bytes] = []

    def add(body: bytes) -> int:
        objs.append(body)
        return len(objs)

    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    # Each page takes two objects (content, page); the page tree comes after them.
    pages_id = len(objs) + 2 * len(pages) + 1
    kids = []
    for lines in pages:
        ops = ["BT /F1 12 Tf 72 720 Td 14 TL"]
        for line in lines:
            esc = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops.append(f"({esc}) Tj T*")
        ops.append("ET")
        stream = "\n".join(ops).encode("latin-1")
        content = add(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
        kids.append(add(
            b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Contents %d 0 R"
            b" /Resources << /Font << /F1 %d 0 R >> >> >>" % (pages_id, content, font)
        ))
    refs = b" ".join(b"%d 0 R" % k for k in kids)
    assert add(b"<< /Type /Pages /Kids [%s] /Count %d >>" % (refs, len(kids))) == pages_id
    catalog = add(b"<< /Type /Catalog /Pages %d 0 R >>" % pages_id)
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objs, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objs) + 1, catalog, xref,
    )
    return bytes(out)


def encrypt_pdf(data: bytes, user_password: str) -> bytes:
    import io

    import pypdf

    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm="RC4-128")
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


class HashEmbedder:
    """Stems hashed into 256 dimensions: texts sharing words are near. Deterministic,
    instant, and it counts the texts it embeds (`calls`, `texts`)."""

    name = "test-hash-256"
    dim = 256

    def __init__(self) -> None:
        self.calls = 0
        self.texts = 0

    def embed(self, texts: list[str]) -> Any:
        self.calls += 1
        self.texts += len(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for term in analyze(text):
                h = int.from_bytes(hashlib.blake2b(term.encode(), digest_size=4).digest(), "big")
                out[i, h % self.dim] += 1.0
            out[i] /= max(float(np.linalg.norm(out[i])), 1e-9)
        return out
