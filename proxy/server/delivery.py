"""How an answer reaches the agent: in one send where it can, and a turn the agent never received marked so (mask 0)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.capture.session import Session
from proxy.live import Finished, StreamEvent
from proxy.server.limits import log_left

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def deliver(request: web.Request, response: web.StreamResponse, last: bytes, node_id: str | None,
                  session: Session) -> web.StreamResponse:
    """End `response` with `last` (a whole `web.Response` carries its body, headers and body in one send); an agent
    gone by then leaves the turn undelivered (mask 0)."""
    try:
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the agent disconnected before its answer was ready")
        if not response.prepared:
            await response.prepare(request)
        await response.write_eof(last)
    except ConnectionResetError:
        log_left(request)
        if node_id is not None:
            session.mark_undelivered(node_id)
    except asyncio.CancelledError:
        if node_id is not None:
            session.mark_undelivered(node_id)
        raise
    return response


class EventStream(web.StreamResponse):
    """A stream whose headers go with its first events, in one send (aiohttp's opt-in, as its `web.Response` has)."""

    _send_headers_immediately = False


async def end_stream(request: web.Request, response: web.StreamResponse | None, last: bytes, node_id: str | None,
                     session: Session) -> web.StreamResponse:
    """End a stream with `last`; when nothing of it was sent yet, as one whole response."""
    if response is None:
        return await deliver(request, web.Response(body=last, headers=SSE_HEADERS), b"", node_id, session)
    return await deliver(request, response, last, node_id, session)


def waiting(events: asyncio.Queue[StreamEvent | Exception]) -> list[StreamEvent | Exception]:
    """The events already in the queue, taken without waiting."""
    taken: list[StreamEvent | Exception] = []
    while not events.empty():
        taken.append(events.get_nowait())
    return taken


def undelivered(events: asyncio.Queue[StreamEvent | Exception], session: Session) -> None:
    """After the agent left: the turn the capture recorded, if any, was never delivered."""
    while not events.empty():
        event = events.get_nowait()
        if isinstance(event, Finished) and event.node_id is not None:
            session.mark_undelivered(event.node_id)
