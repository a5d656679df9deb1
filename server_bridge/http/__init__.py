"""The hosts' HTTP API (issue "Hosts over HTTP"; DESIGN.md "Host", PROTOCOL.md "HTTP"):
devices, requests, a run's snapshot and its events as SSE that resume with
Last-Event-ID, conversations, on Starlette served by uvicorn in the bridge's process
(server.py), beside the MQTT path. hub.py hands the streams the events live; it
imports nothing of the ASGI stack, so the bridge runs without it installed."""
