"""The HTTP/1.1 connection protocol `xlaserve serve` gives uvicorn: its h11 protocol, hardened.

uvicorn's own h11 protocol bounds request headers (16 KiB, `h11_max_incomplete_event_size`) but
answers an oversized head with a plain 400, and puts no time limit on a client that sends its
request head slowly, or never (slowloris). This subclass
  * answers 431 (Request Header Fields Too Large) for a request head over 16 KiB, however it
    arrives (h11 itself only bounds a head still incomplete after a read), and
  * gives every request head `header_timeout_s` seconds to arrive in full (from the connection's
    start, or from the first byte of a keep-alive connection's next request), else answers 408
    and closes the connection.
Request bodies get their own deadline in `BodyLimitMiddleware` (frontends/http/app.py).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontends.http.app import DEFAULT_HTTP_READ_TIMEOUT_S


def _plain_response(status: int, reason: str, text: str) -> bytes:
    body = text.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


MAX_HEAD_BYTES = 16 * 1024   # request line + headers (h11's and uvicorn's default bound)
_RESPONSE_431 = _plain_response(431, "Request Header Fields Too Large", "request header fields exceed the limit")
_RESPONSE_408 = _plain_response(408, "Request Timeout", "the request head did not arrive in time")


class HardenedH11Protocol(H11Protocol):
    header_timeout_s: float = DEFAULT_HTTP_READ_TIMEOUT_S
    max_head_bytes: int = MAX_HEAD_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._status_hint: Optional[int] = None
        self._head_timer: Optional[asyncio.TimerHandle] = None
        self._head_seen = 0          # bytes of the current request head received so far
        self._head_tail = b""        # its last 3 bytes (the blank line may straddle two reads)
        parse = self.conn.next_event

        def next_event() -> Any:  # remember why h11 refused the request (431 for a huge head)
            try:
                return parse()
            except h11.RemoteProtocolError as e:
                self._status_hint = e.error_status_hint
                raise

        self.conn.next_event = next_event  # type: ignore[method-assign]

    # -- oversized head ------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        if self._status_hint == 431:
            self._cancel_head_timer()
            self.transport.write(_RESPONSE_431)
            self.transport.close()
            return
        super().send_400_response(msg)

    # -- slow head -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self._cancel_head_timer()
            self.transport.write(_RESPONSE_431)
            self.transport.close()
            return
        super().data_received(data)
        if self.transport.is_closing():
            self._cancel_head_timer()
        elif self.conn.their_state is h11.IDLE:
            self._arm_head_timer()         # a request head is (still) on its way
        else:
            self._cancel_head_timer()      # the head is complete

    def _head_too_large(self, data: bytes) -> bool:
        """Count a request head's bytes up to its blank line (h11 alone bounds only a head that
        is still incomplete after a read, so a larger one arriving at once would pass)."""
        window = self._head_tail + data
        end = window.find(b"\r\n\r\n")
        if end >= 0:
            size = self._head_seen + end + 4 - len(self._head_tail)
            self._head_seen, self._head_tail = 0, b""
            return size > self.max_head_bytes
        self._head_seen += len(data)
        self._head_tail = window[-3:]
        return self._head_seen > self.max_head_bytes

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is None or self.cycle.response_complete:  # nothing of ours is being written
            self.transport.write(_RESPONSE_408)
        self.transport.close()


def hardened_h11_protocol(header_timeout_s: float = DEFAULT_HTTP_READ_TIMEOUT_S) -> type:
    """HardenedH11Protocol with its own head timeout (uvicorn.Config(http=...) takes a class)."""
    return type("HardenedH11Protocol", (HardenedH11Protocol,), {"header_timeout_s": float(header_timeout_s)})
