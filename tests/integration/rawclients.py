"""Clients that misbehave on purpose, on raw sockets: they send, and never read what
the server sends back (a small receive buffer fills at once)."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import orjson


def connect(base_url: str, rcvbuf: int = 4096) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window stays small
    s.connect((host, int(port)))
    return s


def _read_head(s: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        if not chunk:
            raise ConnectionError(f"closed during the handshake: {head!r}")
        head += chunk
    return head


def ws_connect(base_url: str, rcvbuf: int = 4096) -> socket.socket:
    """A WebSocket handshake on a raw socket; then only `ws_send` is ever used."""
    s = connect(base_url, rcvbuf)
    host = base_url.removeprefix("http://")
    s.sendall(
        f"GET /v1/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = _read_head(s)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def ws_send(s: socket.socket, msg: dict[str, Any]) -> None:
    """One masked text frame, as clients must send them."""
    payload = orjson.dumps(msg)
    n = len(payload)
    if n < 126:
        header = struct.pack("!BB", 0x81, 0x80 | n)
    elif n < 65536:
        header = struct.pack("!BBH", 0x81, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
    mask = os.urandom(4)
    s.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def sse_post(base_url: str, path: str, body: dict[str, Any], rcvbuf: int = 4096) -> socket.socket:
    """POST a streamed request and never read the answer."""
    s = connect(base_url, rcvbuf)
    data = orjson.dumps(body | {"stream": True})
    host = base_url.removeprefix("http://")
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s
