"""The HTTP API's OpenAPI 3.1 document, served at /openapi.json. Written by hand, as
the contract; tests/test_http_api.py checks that it names exactly the app's routes, and
tests/test_http_fuzz.py that every answer to calls generated from it matches its schemas."""

from __future__ import annotations

from typing import Any

__all__ = ["document"]

_ERROR = {
    "type": "object",
    "required": ["error", "message"],
    "properties": {"error": {"type": "string"}, "message": {"type": "string"}},
}
_ID = {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]{0,63}$"}
_HOST_ID = {"type": "string", "minLength": 1, "maxLength": 64}


def _errors(*codes: int) -> dict[str, Any]:
    words = {400: "a malformed call", 401: "no valid session token", 403: "not yours",
             404: "no such device, run, request or conversation (of this tenant)",
             409: "the device is offline", 413: "too large", 429: "over the tenant's rate",
             503: "the tenant's lane is full"}  # fmt: skip
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(c): {"description": words[c], "content": error} for c in codes}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _device_param() -> dict[str, Any]:
    return {"name": "device", "in": "path", "required": True, "schema": _ID}


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": _HOST_ID}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _sse(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"text/event-stream": {"schema": {"type": "string"}}}}  # fmt: skip


def _resume_params() -> list[dict[str, Any]]:
    # Where a stream goes on from: `?after=<id>`, or the header EventSource sends.
    return [_query("after", {"type": "integer", "minimum": 0}),
            {"name": "Last-Event-ID", "in": "header", "required": False,
             "schema": {"type": "string"}}]  # fmt: skip


def _control(op: str, body: dict[str, Any], summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "operationId": op,
            "parameters": [_device_param(), _path_param("run")],
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "202": _json({"type": "object", "properties": {"sent": {"type": "string"}},
                              "required": ["sent"]}, "sent to the board"),  # fmt: skip
                **_errors(400, 401, 403, 404, 429, 503),
            },
        }
    }


def document() -> dict[str, Any]:
    snapshot = {"type": "object", "required": ["run", "status", "rows", "lastId"],
                "properties": {"run": {"type": "string"}, "status": {"type": "string"},
                               "rows": {"type": "array", "items": {"type": "object"}},
                               "lastId": {"type": "integer"}}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Wren bridge: hosts over HTTP",
            "version": "1",
            "description": "Every path but /v1/health and /openapi.json needs a session "
            "token: `Authorization: Bearer <token>` (or `?access_token=` for EventSource).",
        },
        "components": {
            "schemas": {"Error": _ERROR, "Snapshot": snapshot},
            "securitySchemes": {"session": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"session": []}],
        "paths": {
            "/v1/health": {"get": {
                "summary": "Whether the bridge is connected to its broker",
                "operationId": "health", "security": [],
                "responses": {"200": _json({"type": "object", "required": ["bridge"],
                                            "properties": {"bridge": {"type": "string"}}},
                                           "the bridge's state")},
            }},
            "/openapi.json": {"get": {
                "summary": "This document", "operationId": "openapi", "security": [],
                "responses": {"200": _json({"type": "object"}, "the OpenAPI document")},
            }},
            "/v1/devices": {"get": {
                "summary": "The tenant's devices with their presence",
                "operationId": "devices",
                "responses": {
                    "200": _json({"type": "object", "required": ["devices"], "properties": {
                        "devices": {"type": "array", "items": {
                            "type": "object", "required": ["device", "agent", "presence"],
                            "properties": {"device": {"type": "string"},
                                           "agent": {"type": "string"},
                                           "presence": {"type": ["object", "null"]},
                                           # Runs in flight the token may read.
                                           "runs": {"type": "array",
                                                    "items": {"type": "string"}},
                                           # The tools its last hello announced.
                                           "tools": {"type": "array", "items": {
                                               "type": "object", "required": ["name"],
                                               "properties": {
                                                   "name": {"type": "string"},
                                                   "description": {"type": "string"},
                                                   "args": {"type": "object"},
                                                   "client": {"type": "boolean"},
                                                   "approval": {"type": "boolean"}}}}}}}}},
                                 "devices"),
                    **_errors(401),
                },
            }},
            "/v1/devices/{device}/requests": {"post": {
                "summary": "Start a run on a device (the MQTT req's checks and limits)",
                "operationId": "startRequest",
                "parameters": [_device_param()],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["input"], "properties": {
                        "input": {"type": "string"}, "conv": _HOST_ID, "req": _HOST_ID,
                        "ttl": {"type": "integer"}}}}}},
                "responses": {
                    "202": _json({"type": "object", "required": ["req", "device"],
                                  "properties": {"req": {"type": "string"},
                                                 "device": {"type": "string"}}},
                                 "sent to the board"),
                    **_errors(400, 401, 404, 409, 413, 429, 503),
                },
            }},
            "/v1/devices/{device}/requests/{req}": {"get": {
                "summary": "The run a request started (null until its run.started)",
                "operationId": "requestStatus",
                "parameters": [_device_param(), _path_param("req")],
                "responses": {
                    "200": _json({"type": "object", "required": ["req", "run"], "properties": {
                        "req": {"type": "string"}, "run": {"type": ["string", "null"]}}},
                        "the request"),
                    **_errors(401, 403, 404),
                },
            }},
            "/v1/devices/{device}/requests/{req}/events": {"get": {
                "summary": "The events of the run a request started, as SSE, once it starts",
                "operationId": "requestEvents",
                "parameters": [_device_param(), _path_param("req"), *_resume_params()],
                "responses": {"200": _sse("the events, one SSE frame each"),
                              **_errors(400, 401, 403, 404)},
            }},
            "/v1/devices/{device}/runs/{run}": {"get": {
                "summary": "A run's snapshot, from the window and the event log",
                "operationId": "runSnapshot",
                "parameters": [_device_param(), _path_param("run")],
                "responses": {"200": _json({"$ref": "#/components/schemas/Snapshot"},
                                           "the snapshot"),
                              **_errors(401, 403, 404)},
            }},
            "/v1/devices/{device}/runs/{run}/events": {"get": {
                "summary": "A run's events as SSE; Last-Event-ID `<run>:<id>` resumes",
                "operationId": "runEvents",
                "parameters": [_device_param(), _path_param("run"), *_resume_params()],
                "responses": {"200": _sse("the events, one SSE frame each"),
                              **_errors(400, 401, 403, 404)},
            }},
            "/v1/devices/{device}/runs/{run}/cancel": _control(
                "cancel", {"type": "object", "properties": {"reason": {"type": "string"}}},
                "Cancel a run"),
            "/v1/devices/{device}/runs/{run}/tool": _control(
                "answerTool", {"type": "object", "required": ["call", "output"], "properties": {
                    "call": _HOST_ID, "output": {}, "failed": {"type": "boolean"}}},
                "Answer a client tool call the run waits on"),
            "/v1/devices/{device}/runs/{run}/approve": _control(
                "approve", {"type": "object", "required": ["call", "ok"], "properties": {
                    "call": _HOST_ID, "ok": {"type": "boolean"}}},
                "Approve or deny a tool call the run waits on"),
            "/v1/devices/{device}/agui": {"post": {
                "summary": "Run the device's agent as an AG-UI agent: a RunAgentInput in, "
                "AG-UI events out as SSE (`resume` answers interrupts; Last-Event-ID resumes)",
                "operationId": "agui",
                "parameters": [_device_param(),
                               {"name": "Last-Event-ID", "in": "header", "required": False,
                                "schema": {"type": "string"}}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["threadId", "runId", "messages"],
                    "properties": {"threadId": _HOST_ID, "runId": _HOST_ID,
                                   "messages": {"type": "array", "items": {"type": "object"}},
                                   "state": {}, "tools": {"type": "array"},
                                   "context": {"type": "array"}, "forwardedProps": {},
                                   "resume": {"type": "array", "items": {"type": "object"}}}}}}},
                "responses": {"200": _sse("AG-UI events, one `data:` frame each"),
                              **_errors(400, 401, 403, 404, 409, 413, 429, 503)},
            }},
            "/v1/conversations": {"get": {
                "summary": "The user's conversations, the most recently active first",
                "operationId": "conversations",
                "parameters": [_query("device", _ID),
                               _query("agent", _HOST_ID),
                               _query("status", {"enum": ["running", "paused", "done",
                                                          "failed", "cancelled"]}),
                               _query("since", {"type": "integer", "minimum": 0}),
                               _query("until", {"type": "integer", "minimum": 0}),
                               _query("limit", {"type": "integer", "minimum": 1, "maximum": 200}),
                               _query("offset", {"type": "integer", "minimum": 0}),
                               _query("user", _HOST_ID)],
                "responses": {
                    "200": _json({"type": "object", "required": ["conversations", "total"],
                                  "properties": {"conversations": {"type": "array"},
                                                 "total": {"type": "integer"}}},
                                 "a page of conversations"),
                    **_errors(400, 401, 403),
                },
            }},
            "/v1/conversations/{conv}": {"get": {
                "summary": "A conversation's rows, a window from the tail",
                "operationId": "conversation",
                "parameters": [_path_param("conv"),
                               _query("limit", {"type": "integer", "minimum": 1, "maximum": 500}),
                               _query("before", {"type": "integer", "minimum": -1}),
                               _query("user", _HOST_ID)],
                "responses": {
                    "200": _json({"type": "object",
                                  "required": ["conv", "runs", "rows", "from", "hasEarlier"],
                                  "properties": {"rows": {"type": "array"},
                                                 "hasEarlier": {"type": "boolean"}}},
                                 "rows, oldest first"),
                    **_errors(400, 401, 403, 404),
                },
            }},
            "/v1/knowledge": {"get": {
                "summary": "The knowledge collections the token's user holds a grant of",
                "operationId": "knowledgeCollections",
                "responses": {"200": _json({"type": "object", "required": ["collections"],
                                            "properties": {"collections": {"type": "array"}}},
                                           "collections with their access and sizes"),
                              **_errors(401, 404)},
            }},
            "/v1/knowledge/search": {"post": {
                "summary": "Search the collections the user may read (or those named)",
                "operationId": "knowledgeSearch",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["query"], "properties": {
                        "query": {"type": "string"},
                        "collections": {"type": "array", "items": {"type": "string"}},
                        "k": {"type": "integer"}, "mode": {"type": "string"},
                        "max_chars": {"type": "integer"}, "max_age_s": {"type": "number"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "sources": {"type": "array", "items": {"type": "string"}}}}}}},
                "responses": {"200": _json({"type": "object", "required": ["hits", "mode"],
                                            "properties": {"hits": {"type": "array"},
                                                           "mode": {"type": "string"}}},
                                           "hits with provenance, best first"),
                              **_errors(400, 401, 403, 404, 413)},
            }},
            "/v1/knowledge/{collection}": {"delete": {
                "summary": "Delete a collection and every source in it (write grant)",
                "operationId": "knowledgeDeleteCollection",
                "parameters": [_path_param("collection")],
                "responses": {"200": _json({"type": "object", "required": ["collection",
                                                                           "chunks"]},
                                           "how many chunks went"),
                              **_errors(400, 401, 403, 404)},
            }},
            "/v1/knowledge/{collection}/sources": {"get": {
                "summary": "A collection's sources (read grant)",
                "operationId": "knowledgeSources",
                "parameters": [_path_param("collection")],
                "responses": {"200": _json({"type": "object", "required": ["collection",
                                                                           "sources"]},
                                           "sources with version, chunks, tags"),
                              **_errors(400, 401, 404)},
            }},
            "/v1/knowledge/{collection}/sources/{src}": {
                "put": {
                    "summary": "Put a document: ingested, or replaced when its text changed "
                               "(write grant)",
                    "operationId": "knowledgePut",
                    "parameters": [_path_param("collection"), _path_param("src")],
                    "requestBody": {"required": True, "content": {"application/json": {
                        "schema": {"type": "object", "required": ["text"], "properties": {
                            "text": {"type": "string"},
                            "kind": {"enum": ["txt", "md", "html"]},
                            "tags": {"type": "array", "items": {"type": "string"}}}}}}},
                    "responses": {"200": _json({"type": "object", "required": [
                        "src", "ver", "status", "chunks"]}, "new, changed or unchanged"),
                        **_errors(400, 401, 403, 404, 413, 503)},
                },
                "delete": {
                    "summary": "Delete a source (write grant)",
                    "operationId": "knowledgeDeleteSource",
                    "parameters": [_path_param("collection"), _path_param("src")],
                    "responses": {"200": _json({"type": "object", "required": ["src",
                                                                               "chunks"]},
                                               "how many chunks went"),
                                  **_errors(400, 401, 403, 404)},
                },
            },
            "/v1/conversations/{conv}/events": {"get": {
                "summary": "A conversation's events as SSE, its runs in order, then new "
                           "runs live; Last-Event-ID `<run>:<id>` resumes",
                "operationId": "conversationEvents",
                "parameters": [_path_param("conv"), _query("user", _HOST_ID),
                               {"name": "Last-Event-ID", "in": "header", "required": False,
                                "schema": {"type": "string"}}],
                "responses": {"200": _sse("the events, one SSE frame each"),
                              **_errors(400, 401, 403, 404)},
            }},
        },
    }
