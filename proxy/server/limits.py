"""Read timeouts and a connection's own errors: a slow, stalled or departed client never starves the others.

A client that has not sent a request's line and headers `header_timeout_s` after connecting or after
its previous answer is disconnected (aiohttp's keep-alive timer runs from exactly those moments and
covers a half-sent request); a body that has not arrived `body_timeout_s` after its headers is
answered 408 and its connection closed. Errors the HTTP parser answers itself (an oversize request
line, bad headers) come back as JSON that both the OpenAI and the Anthropic SDKs parse, not as
aiohttp's plain text. A client that leaves before its answer is one log line, never a proxy failure.
How many connections each client may hold: `proxy.server.connections`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from aiohttp import web

from proxy.errors import ProxyError, error_body

log = logging.getLogger("harness_rl.proxy")
LINGER_S = 1.0  # after an early error, how long the rest of an unread request body is drained before closing
_ENCODER = msgspec.json.Encoder()


class RequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering the parser's own errors in JSON instead of plain text."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already under way; the connection is dropped")
        if status >= 500:
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
