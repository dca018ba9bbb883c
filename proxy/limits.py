"""Connection limits and read timeouts: a slow, stalled or greedy client never starves the others.

Every connection is counted, per client address and in all, from the moment it opens until it
closes. A request arriving on a connection beyond either limit is answered 503 (in the agent's
dialect, with `Retry-After`) and its connection closed. A client that has not sent a request's line
and headers `header_timeout_s` after connecting or after its previous answer is disconnected
(aiohttp's keep-alive timer runs from exactly those moments and covers a half-sent request); a body
that has not arrived `body_timeout_s` after its headers is answered 408 and its connection closed.
Errors the HTTP parser answers itself (an oversize request line, bad headers) come back as JSON
that both the OpenAI and the Anthropic SDKs parse, not as aiohttp's plain text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from proxy.errors import ProxyError, error_body

log = logging.getLogger("harness_rl.proxy")
LINGER_S = 1.0  # after an early error, how long the rest of an unread request body is drained before closing
RETRY_AFTER_S = "1"
_ENCODER = msgspec.json.Encoder()


class ConnectionGuard:
    """Counts open connections per client address and in all; knows which ones are beyond a limit."""

    def __init__(self, max_total: int, max_per_client: int) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.open = 0
        self._per_client: dict[str, int] = {}
        self._over: dict[asyncio.BaseTransport, str] = {}

    def protocol_factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A factory for `loop.create_server` whose connections are counted by this guard."""
        return lambda: _Counted(self, inner())

    def opened(self, transport: asyncio.BaseTransport) -> None:
        client = _client(transport)
        count = self._per_client[client] = self._per_client.get(client, 0) + 1
        self.open += 1
        if count > self.max_per_client:
            self._over[transport] = f"{count} open connections from {client} (limit {self.max_per_client})"
        elif self.open > self.max_total:
            self._over[transport] = f"{self.open} open connections (limit {self.max_total})"

    def closed(self, transport: asyncio.BaseTransport) -> None:
        client = _client(transport)
        count = self._per_client.get(client, 1) - 1
        if count:
            self._per_client[client] = count
        else:
            self._per_client.pop(client, None)
        self.open -= 1
        self._over.pop(transport, None)

    def refusal(self, transport: asyncio.BaseTransport | None) -> ProxyError | None:
        """The 503 for a request on a connection beyond a limit, or None."""
        reason = self._over.get(transport) if transport is not None else None
        if reason is None:
            return None
        return ProxyError(503, f"the proxy is at its connection limit: {reason}; retry shortly",
                          headers={"Retry-After": RETRY_AFTER_S}, close_connection=True)


def _client(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


class _Counted(asyncio.Protocol):
    """The HTTP protocol of one connection, reported to the guard as it opens and closes."""

    __slots__ = ("_guard", "_inner", "_transport")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._guard.opened(transport)
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._guard.closed(self._transport)
            self._transport = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class RequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering the parser's own errors in JSON instead of plain text."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already under way; the connection is dropped")
        if isinstance(exc, ConnectionError) and client_left(request):
            log_left(request)
        elif status >= 500:
            self.log_exception("proxy failure on a request from %s", request.remote, exc_info=exc)
        else:  # a client's malformed request: its own business, and cheap to send in bulk
            self.log_debug("malformed request from %s: %s", request.remote, message or exc)
        text = (message or str(exc or "") or f"HTTP {status}").strip().splitlines()[0][:500]
        response = web.Response(status=status, body=_ENCODER.encode(either_error_body(status, text)),
                                content_type="application/json")
        response.force_close()
        return response


def client_left(request: web.BaseRequest) -> bool:
    """Whether the client's connection is gone (so a ConnectionError is its leaving, not a proxy fault)."""
    return request.transport is None or request.transport.is_closing()


def log_left(request: web.BaseRequest) -> None:
    """One line, no traceback: a client leaving before its answer is its own business, not a proxy failure."""
    log.info("client %s left before the answer to %s %s was sent", request.remote, request.method, request.path)


def either_error_body(status: int, message: str) -> dict[str, Any]:
    """One error body both SDKs parse, for replies written before the request's dialect is known."""
    anthropic = error_body("anthropic", status, message)
    openai = error_body("openai", status, message)["error"]
    return {**anthropic, "error": {**anthropic["error"], "param": openai["param"], "code": openai["code"]}}


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's whole body, or a 408 (closing the connection) if it has not arrived within `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise ProxyError(408, f"the request body did not arrive within {timeout_s:g} s",
                         close_connection=True) from None


async def send_and_close(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Send an error and close its connection at once (no draining of a body that may never come)."""
    response.force_close()
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        log_left(request)
    protocol = request.protocol
    if isinstance(protocol, web.RequestHandler):
        protocol.force_close()
    return response
