"""server_bridge.models.http11 byte for byte: a socket pair plays the server, so every
framing the provider may meet is checked exactly (the provider's own behaviour against
a real server is tests/test_openai_provider.py and tests/test_model_server.py)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from server_bridge.models import http11
from server_bridge.models.http11 import Connection, ProtocolError, Response, Unanswered


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, server = socket.socketpair()
    client.settimeout(5)
    yield client, server
    client.close()
    server.close()


def answer(pair: tuple[socket.socket, socket.socket], data: bytes, close: bool = False) -> Response:
    client, server = pair
    server.sendall(data)
    if close:
        server.shutdown(socket.SHUT_WR)
    return Response(client)


def lines(r: Response) -> list[bytes]:
    out = []
    while line := r.readline(1 << 20):
        out.append(line)
    return out


def test_a_request_is_one_write_with_host_length_and_identity(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    conn = Connection("127.0.0.1", 8080, 5)
    conn.sock = client
    conn.request("/v1/chat/completions", {"Content-Type": "application/json"}, b'{"a":1}')
    got = server.recv(65536)
    assert got == (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
        b"Accept-Encoding: identity\r\nContent-Type: application/json\r\n"
        b'Content-Length: 7\r\n\r\n{"a":1}'
    )
    assert Connection("::1", 8443, 5)._host_header == "[::1]:8443"
    assert Connection("example.com", 80, 5)._host_header == "example.com"


def test_a_chunked_stream_reads_line_by_line_and_ends_whole(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    body = b"data: one\n\ndata: two\n\n"
    chunked = b"6\r\ndata: \r\n4;ext=1\r\none\n\r\n" + b"%x\r\n%s\r\n" % (12, body[10:]) + b"0\r\n"
    r = answer(
        pair,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n"
        b"\r\n" + chunked + b"X-Trailer: 1\r\n\r\n",
    )
    assert (r.status, r.reason, r.headers["content-type"]) == (200, "OK", "text/event-stream")
    assert lines(r) == [b"data: one\n", b"\n", b"data: two\n", b"\n"]
    assert r.isclosed() and not r.will_close


def test_a_length_framed_answer_and_the_next_on_the_same_connection(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    server.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 5\r\n\r\nerror")
    r = Response(client)
    assert r.status == 500 and r.read(2) == b"er" and r.read() == b"ror" and r.isclosed()
    assert r.read() == b"" and r.readline() == b""
    server.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
    r = Response(client)
    assert r.status == 204 and r.isclosed() and r.read() == b""


def test_interim_answers_are_skipped_and_folded_headers_joined(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    r = answer(
        pair,
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nX-Long: a\r\n b\r\nContent-Length: 0\r\n\r\n",
    )
    assert r.status == 200 and r.headers["x-long"] == "a b" and r.isclosed()


def test_a_body_to_the_end_of_the_connection_and_who_closes(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    r = answer(pair, b"HTTP/1.0 200 OK\r\n\r\nline 1\nline 2", close=True)
    assert r.will_close and lines(r) == [b"line 1\n", b"line 2"] and r.isclosed()


@pytest.mark.parametrize(
    ("head", "closes"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", False),
    ],
)
def test_will_close(pair: tuple[socket.socket, socket.socket], head: bytes, closes: bool) -> None:
    assert answer(pair, head).will_close is closes


def test_a_chunked_body_cut_short_reads_as_its_end_and_spoils_the_connection(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    r = answer(
        pair,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab\ncd\r\n9\r\nef",
        close=True,
    )
    assert lines(r) == [b"ab\n", b"cdef"]  # a line runs on across chunks
    assert r.will_close


def test_readline_keeps_to_its_limit(pair: tuple[socket.socket, socket.socket]) -> None:
    r = answer(pair, b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n0123456789\n\n")
    assert r.readline(4) == b"0123" and r.readline(100) == b"456789\n" and r.readline() == b"\n"


def test_no_byte_of_an_answer_is_unanswered(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    server.shutdown(socket.SHUT_WR)
    with pytest.raises(Unanswered, match="closed without answering"):
        Response(client)


def test_a_reset_before_the_first_byte_is_unanswered() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    server.close()  # an RST
    try:
        with pytest.raises(Unanswered, match="reset"):
            Response(client)
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 twohundred OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * (http11.MAX_HEADERS + 1) + b"\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"y" * http11.MAX_LINE + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-",
    ],
)
def test_a_head_outside_the_grammar_is_a_protocol_error(
    pair: tuple[socket.socket, socket.socket], data: bytes
) -> None:
    with pytest.raises(ProtocolError):
        answer(pair, data, close=True)


def test_a_bad_chunk_size_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]) -> None:
    r = answer(pair, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n")
    with pytest.raises(ProtocolError, match="chunk size"):
        r.readline()
