"""The tenant's document knowledge over HTTP (PROTOCOL.md "HTTP", knowledge rows): list
collections and sources, put a document, delete a source or a collection, search.

Who may do what is the registry's, per end user (the session token's user): a grant of
`kb:<collection>` to that user (`wren grant add --tenant T --user-id U --field
kb:C [--read-only]`), `read` to list and search, `write` also to put and delete. A
watcher's token grants nothing here: watching runs is not editing a tenant's manuals.
A collection the user holds no grant of is the same 404 as one that does not exist, and
the tenant is always the token's. Without a knowledge store (`wren bridge --knowledge`)
every path is 404 `unknown_collection`.

A put is ingested on a worker thread, one at a time per bridge: embedding is the
bridge's heaviest work (about 90 ms per KiB with the default model on two cores), so a
second put while one runs is refused 503 `busy` with `Retry-After`, never queued
without bound; a text is at most PUT_MAX_BYTES. A folder of manuals belongs to `wren kb
ingest`, which runs niced in a process of its own.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server_bridge import tokens
from server_bridge.knowledge import (
    DEFAULT_MAX_CHARS,
    KnowledgeBase,
    KnowledgeError,
    NotFound,
    QueryTooLarge,
    Record,
    Records,
)
from server_bridge.memory.grants import READ, WRITE, Grants

from .errors import Refused

if TYPE_CHECKING:
    from server_bridge.bridge import Bridge

__all__ = ["PUT_MAX_BYTES", "routes"]

#: The largest document one put takes (a longer one: several sources, or `wren kb`).
PUT_MAX_BYTES = 256 << 10
# Source ids a host names: as a board's (knowledge/calls.py), and longer, since hosts
# name documents by paths.
_SRC = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/ -]{0,255}")
_SRC_RULE = ("a source id is 1-256 characters of letters, digits, space and . _ : / -, "
             "starting with a letter or digit")
_KINDS = {"txt": ".txt", "md": ".md", "html": ".html"}
# A put's JSON: the text plus its envelope and tags.
_BODY_MAX = PUT_MAX_BYTES + (8 << 10)

Session = Callable[[Request], tuple[str, tokens.Session]]
BodyOf = Callable[..., Awaitable[dict[str, Any]]]


def routes(bridge: Bridge, session: Session, body_of: BodyOf) -> list[Route]:
    """The knowledge paths of the app (app.py adds them to its own)."""
    putting = threading.Lock()

    def store() -> KnowledgeBase:
        if bridge.knowledge is None:
            raise Refused(404, "unknown_collection", "this bridge holds no knowledge store")
        return bridge.knowledge

    def grants(sess: tokens.Session) -> Grants:
        return bridge.registry.user_grants_of(sess.tenant, sess.user)

    def may(sess: tokens.Session, collection: str, access: str) -> None:
        got = grants(sess).knowledge(collection)
        if got is None:
            # Not told apart from a collection that does not exist.
            raise Refused(404, "unknown_collection", f"no collection {collection[:64]!r}")
        if access == WRITE and got != WRITE:
            raise Refused(403, "forbidden", f"a read-only grant of collection {collection!r}")

    async def collections(request: Request) -> Response:
        _, sess = session(request)
        kb = store()
        granted = grants(sess).knowledge_collections(READ)
        held = {c.name: c for c in await run_in_threadpool(kb.collections, sess.tenant)}
        out = []
        for name in granted:
            c = held.get(name)
            out.append({"collection": name, "access": grants(sess).knowledge(name),
                        "sources": c.sources if c else 0, "chunks": c.chunks if c else 0,
                        "bytes": c.bytes if c else 0})  # fmt: skip
        return JSONResponse({"collections": out})

    async def sources(request: Request) -> Response:
        _, sess = session(request)
        kb = store()
        collection = request.path_params["collection"]
        may(sess, collection, READ)
        rows = await run_in_threadpool(_knowledge_call, kb.sources, sess.tenant, collection)
        return JSONResponse({"collection": collection, "sources": [
            {"src": r.source, "ver": r.version, "chunks": r.chunks, "bytes": r.bytes,
             "tags": list(r.tags), "ingested": r.ingested} for r in rows]})  # fmt: skip

    async def put_source(request: Request) -> Response:
        _, sess = session(request)
        kb = store()
        collection, src = request.path_params["collection"], request.path_params["src"]
        may(sess, collection, WRITE)
        if not _SRC.fullmatch(src):
            raise Refused(400, "bad_envelope", _SRC_RULE)
        body = await body_of(request, _BODY_MAX)
        text, kind, tags = body.get("text"), body.get("kind", "txt"), body.get("tags", [])
        if not isinstance(text, str) or not text.strip():
            raise Refused(400, "bad_envelope", "text is a str with something in it")
        data = text.encode("utf-8")
        if len(data) > PUT_MAX_BYTES:
            raise Refused(413, "too_large", f"a text of {len(data):,} bytes: at most "
                          f"{PUT_MAX_BYTES:,} (split it, or `wren kb ingest` it)")  # fmt: skip
        if kind not in _KINDS:
            raise Refused(400, "bad_envelope", f"kind is one of {', '.join(_KINDS)}")
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise Refused(400, "bad_envelope", "tags is a list of str")
        if not putting.acquire(blocking=False):
            raise Refused(503, "busy", "another document is being ingested; try again")
        try:
            summary = await run_in_threadpool(
                _knowledge_call, kb.ingest, Records([Record(src, text, _KINDS[kind])]),
                tenant=sess.tenant, collection=collection, tags=[*tags, f"usr:{sess.user}"],
            )  # fmt: skip
        finally:
            putting.release()
        (result,) = summary.files
        if result.status == "failed":
            raise Refused(400, "bad_envelope", f"{src}: {result.reason}")
        return JSONResponse({"src": src, "ver": hashlib.sha256(data).hexdigest(),
                             "status": result.status, "chunks": result.chunks})  # fmt: skip

    async def delete_source(request: Request) -> Response:
        _, sess = session(request)
        kb = store()
        collection, src = request.path_params["collection"], request.path_params["src"]
        may(sess, collection, WRITE)
        gone = await run_in_threadpool(_knowledge_call, kb.delete_source, sess.tenant,
                                       collection, src)  # fmt: skip
        return JSONResponse({"src": src, "chunks": gone})

    async def delete_collection(request: Request) -> Response:
        _, sess = session(request)
        kb = store()
        collection = request.path_params["collection"]
        may(sess, collection, WRITE)
        gone = await run_in_threadpool(_knowledge_call, kb.delete_collection, sess.tenant,
                                       collection)  # fmt: skip
        return JSONResponse({"collection": collection, "chunks": gone})

    async def search(request: Request) -> Response:
        _, sess = session(request)
        kb = store()
        body = await body_of(request)
        query = body.get("query")
        if not isinstance(query, str) or not query.strip():
            raise Refused(400, "bad_envelope", "query is a str with something in it")
        readable = grants(sess).knowledge_collections(READ)
        named = body.get("collections")
        if named is None:
            wanted = readable
        elif isinstance(named, list) and all(isinstance(c, str) for c in named):
            for c in named:
                may(sess, c, READ)
            wanted = named
        else:
            raise Refused(400, "bad_envelope", "collections is a list of str")
        if not wanted:
            return JSONResponse({"hits": [], "mode": body.get("mode", "hybrid")})
        options: dict[str, Any] = {}
        for key, kinds in (("k", int), ("mode", str), ("max_chars", int),
                           ("max_age_s", (int, float)), ("tags", list),
                           ("sources", list)):  # fmt: skip
            if key in body:
                if isinstance(body[key], bool) or not isinstance(body[key], kinds):
                    raise Refused(400, "bad_envelope", f"{key} has the wrong type")
                options[key] = body[key]
        options.setdefault("max_chars", DEFAULT_MAX_CHARS)
        got = await run_in_threadpool(_knowledge_call, kb.retrieve, sess.tenant, query,
                                      collections=wanted, **options)  # fmt: skip
        return JSONResponse({
            "mode": got.mode,
            "note": got.note or None,
            "hits": [{"collection": h.collection, "src": h.source, "ver": h.version,
                      "chunk": h.chunk, "headings": list(h.headings), "score": h.score,
                      "text": h.text, "truncated": h.truncated} for h in got.hits],
        })  # fmt: skip

    return [
        Route("/v1/knowledge", collections),
        Route("/v1/knowledge/search", search, methods=["POST"]),
        Route("/v1/knowledge/{collection}", delete_collection, methods=["DELETE"]),
        Route("/v1/knowledge/{collection}/sources", sources),
        Route("/v1/knowledge/{collection}/sources/{src:path}", put_source, methods=["PUT"]),
        Route("/v1/knowledge/{collection}/sources/{src:path}", delete_source,
              methods=["DELETE"]),  # fmt: skip
    ]


def _knowledge_call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """A knowledge service call, its refusals as the API's."""
    try:
        return fn(*args, **kw)
    except NotFound as e:
        raise Refused(404, "unknown_collection", str(e)) from None
    except QueryTooLarge as e:
        raise Refused(413, "too_large", str(e)) from None
    except KnowledgeError as e:
        raise Refused(400, "bad_envelope", str(e)) from None
