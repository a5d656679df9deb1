"""The counters over HTTP: `wren bridge --metrics HOST:PORT` serves them at /metrics.

The server alone (server_bridge/metrics_http.py) with a text of the test's own, then the
real bridge against the session's Mosquitto, scraped with urllib as Prometheus would:
the text parses, a refusal shows in its counters, and the server stops with the bridge.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.publish as publish
import pytest

from server_bridge import service
from server_bridge.metrics_http import CONTENT_TYPE, MetricsServer
from tests.test_cli import Proc, wren
from tools.broker import MosquittoProcess, start_mosquitto

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60.0
TEXT = "# TYPE wren_evt_forwarded_total counter\nwren_evt_forwarded_total 3\n"

# The text format's lines (https://prometheus.io/docs/instrumenting/exposition_formats/):
# `# TYPE name kind`, and a sample `name{label="value",...} value`.
_TYPE = re.compile(r"# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)")
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(
    rf"([a-zA-Z_:][a-zA-Z0-9_:]*)((?:\{{{_LABEL}(?:,{_LABEL})*\}})?) "
    r"(-?[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?|NaN|[+-]Inf)"
)


def parse_prometheus(text: str) -> dict[str, float]:
    """The samples of a Prometheus text export, `name{labels}` to value; an
    AssertionError for a line that is not the format, or a sample with no # TYPE."""
    assert text.endswith("\n"), text
    kinds: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            m = _TYPE.fullmatch(line)
            assert m is not None, f"bad TYPE line: {line!r}"
            assert m.group(1) not in kinds, f"TYPE given twice: {line!r}"
            kinds[m.group(1)] = m.group(2)
        elif line.startswith("#"):
            assert line.startswith("# HELP "), f"unknown comment: {line!r}"
        else:
            m = _SAMPLE.fullmatch(line)
            assert m is not None, f"not a sample line: {line!r}"
            name, labels, value = m.groups()
            assert name in kinds, f"no # TYPE before {line!r}"
            if kinds[name] == "counter":
                assert name.endswith("_total"), line
            assert name + labels not in samples, f"sample given twice: {line!r}"
            samples[name + labels] = float(value)
    return samples


def test_the_parser_refuses_what_prometheus_would() -> None:
    assert parse_prometheus(TEXT) == {"wren_evt_forwarded_total": 3.0}
    for bad in (
        "wren_x_total 1\n",  # no TYPE
        "# TYPE wren_x_total counter\nwren_x_total one\n",
        '# TYPE wren_x_total counter\nwren_x_total{tenant=demo} 1\n',
        "# TYPE wren_x gauge\nwren_x 1",  # no newline at the end
    ):
        with pytest.raises(AssertionError):
            parse_prometheus(bad)


# --- the server alone -----------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    with MetricsServer(lambda: TEXT, "127.0.0.1", 0) as s:
        yield s


def _fetch(
    url: str, method: str = "GET", data: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request, an HTTP error status included."""
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def test_get_and_head_answer_the_text_and_nothing_goes_to_stderr(
    server: MetricsServer, capfd: pytest.CaptureFixture[str]
) -> None:
    host, port = server.address
    assert host == "127.0.0.1" and port > 0
    assert server.url == f"http://127.0.0.1:{port}/metrics"
    status, headers, body = _fetch(server.url)
    assert (status, headers["Content-Type"], body) == (200, CONTENT_TYPE, TEXT.encode())
    assert headers["Content-Length"] == str(len(TEXT))
    status, head_headers, body = _fetch(server.url, "HEAD")
    assert (status, body) == (200, b"")
    assert head_headers["Content-Type"] == CONTENT_TYPE
    assert head_headers["Content-Length"] == str(len(TEXT))
    # http.server writes a line per request to stderr unless told otherwise.
    assert capfd.readouterr().err == ""


def test_another_path_is_404_and_another_method_405(server: MetricsServer) -> None:
    base = server.url.removesuffix("/metrics")
    for path in ("/", "/metrics/", "/metricsx", "/stats"):
        assert _fetch(base + path)[0] == 404, path
        assert _fetch(base + path, "HEAD")[0] == 404, path
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        status, headers, _ = _fetch(server.url, method, data=b"x" * 1000)
        assert (status, headers.get("Allow")) == (405, "GET, HEAD"), method
    # A query string is still the resource.
    assert _fetch(server.url + "?name[]=x")[0] == 200


def test_a_failing_export_is_logged_and_answered_500_and_the_server_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def render() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("counter table gone")
        return TEXT

    caplog.set_level(logging.DEBUG, logger="wren.metrics_http")
    with MetricsServer(render, "127.0.0.1", 0) as s:
        assert _fetch(s.url)[0] == 500
        assert _fetch(s.url)[0] == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text
    assert errors[0].exc_info is not None and "counter table gone" in caplog.text


def test_stop_closes_the_port_at_once() -> None:
    s = MetricsServer(lambda: TEXT, "127.0.0.1", 0)
    s.start()
    assert _fetch(s.url)[0] == 200
    began = time.monotonic()
    s.stop()
    assert time.monotonic() - began < 1.0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(s.address, timeout=5).close()
    s.stop()  # again: nothing to do


def test_metrics_address_binds_loopback_unless_told() -> None:
    assert service.metrics_address(":9464") == ("127.0.0.1", 9464)
    assert service.metrics_address("0.0.0.0:0") == ("0.0.0.0", 0)
    assert service.metrics_address("[::1]:9464") == ("::1", 9464)
    assert service.metrics_address("metrics.local:65535") == ("metrics.local", 65535)
    for bad in ("9464", "127.0.0.1:", ":65536", ":-1", ":９４", "a b:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            service.metrics_address(bad)


# --- the bridge -----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _scrape(url: str) -> dict[str, float]:
    status, headers, body = _fetch(url)
    assert (status, headers["Content-Type"]) == (200, CONTENT_TYPE), body
    return parse_prometheus(body.decode("utf-8"))


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[MosquittoProcess]:
    """A broker of the test's own: on the session's, messages other tests left retained
    under wren/v1 reach this bridge too, and its refusal counters would count them."""
    b = start_mosquitto(tmp_path / "mosquitto")
    yield b
    b.stop()


def test_wren_bridge_serves_its_counters_at_metrics_until_it_stops(
    own_broker: MosquittoProcess, tmp_path: Path
) -> None:
    broker = own_broker
    bridge = Proc(
        wren("bridge", "--broker", broker.address, "--client-id", "metrics-http-test",
             "--tenant", "acme", "--device", "mh1", "--metrics", "127.0.0.1:0"),
        tmp_path,
    )  # fmt: skip
    try:
        bridge.wait_for("bridge: ")
        line = bridge.wait_for("metrics at ")
        m = re.fullmatch(r"metrics at (http://127\.0\.0\.1:([0-9]+)/metrics)", line)
        assert m is not None, line
        url, port = m.group(1), int(m.group(2))
        before = _scrape(url)
        assert before["wren_bridge_connected"] == 1
        assert before["wren_bridge_budget_bytes"] > 0
        assert 'wren_refused_bad_type_total{tenant="acme"}' not in before
        assert before.get("wren_refused_total", 0) == 0, before

        # A board of tenant acme sends what is not msgpack: refused bad_type, counted.
        publish.single("wren/v1/d/mh1/evt", b"\xc1", qos=1, hostname=broker.host,
                       port=broker.port)  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        while 'wren_refused_bad_type_total{tenant="acme"}' not in (after := _scrape(url)):
            assert time.monotonic() < deadline, after
            time.sleep(0.05)
        assert after['wren_refused_bad_type_total{tenant="acme"}'] == 1
        assert after["wren_refused_bad_type_total"] == 1
        assert after["wren_refused_total"] == 1, after

        assert _fetch(url.removesuffix("/metrics") + "/")[0] == 404
        assert _fetch(url, "POST", data=b"{}")[0] == 405

        began = time.monotonic()
        assert bridge.stop() == 130
        assert time.monotonic() - began < 10, "the bridge took long to stop"
        rest = []
        while True:
            try:
                rest.append(bridge.lines.get(timeout=2))
            except queue.Empty:
                break
        assert "stopped" in rest and not any("Traceback" in x for x in rest), rest
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        if bridge.proc.poll() is None:
            bridge.proc.kill()
            bridge.proc.wait(timeout=15)


def test_the_service_stops_serving_when_the_bridge_stops(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    """In-process, where a forgotten server would outlive run() (a process's exit
    closes its sockets whatever the code did)."""
    args = service.build_parser().parse_args(
        ["--broker", broker.address, "--client-id", "metrics-stop-test", "--tenant", "acme",
         "--registry", str(tmp_path / "registry.json"), "--stats-file",
         str(tmp_path / "bridge.prom"), "--metrics", ":0"]
    )  # fmt: skip
    stop = threading.Event()
    out = io.StringIO()
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(service.run(args, stop, out)))
    runner.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while (m := re.search(r"^metrics at (\S+)$", out.getvalue(), re.M)) is None:
            assert runner.is_alive() and time.monotonic() < deadline, out.getvalue()
            time.sleep(0.05)
        url = m.group(1)
        assert url.startswith("http://127.0.0.1:"), url
        assert _scrape(url)["wren_bridge_connected"] == 1
    finally:
        stop.set()
        runner.join(TIMEOUT_S)
    assert codes == [0]
    with pytest.raises(urllib.error.URLError) as refused:
        _fetch(url)
    assert isinstance(refused.value.reason, ConnectionRefusedError), refused.value


@pytest.mark.parametrize(
    "command", [["wren", "bridge"], ["python", "-m", "server_bridge"]], ids=["wren", "python-m"]
)
def test_a_metrics_port_in_use_is_one_line_and_exit_1(
    broker: MosquittoProcess, tmp_path: Path, command: list[str]
) -> None:
    argv = ["--broker", broker.address, "--client-id", "metrics-busy", "--tenant", "acme"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv += ["--metrics", f"127.0.0.1:{port}"]
        args = wren("bridge", *argv) if command[0] == "wren" else [
            sys.executable, "-m", "server_bridge", *argv
        ]  # fmt: skip
        proc = subprocess.run(
            args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr == (
        f"{' '.join(command)}: could not serve the metrics at 127.0.0.1:{port}: "
        "Address already in use\n"
    ), proc.stderr
