"""The routes agents call: each dialect's body decoded into a `ChatCall`, captured, and answered in kind.

Agents reach their session by path (`/s/{id}/v1/...`, `/s/{id}/v1beta/models/...`) or by presenting the
session key as their API key on the plain paths; the key is required either way. A streaming agent gets
its text as the engine samples it (`proxy.server.streaming`), and keep-alives while the engine is quiet. A call
runs on its own task: a whole answer is captured to its end even if the agent leaves; a streamed one is
cut short. Either way a completion the agent never received stays in the trace with mask 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from proxy.capture.session import Session, SessionRegistry
from proxy.chat import Answer, ChatCall
from proxy.config import ProxyConfig
from proxy.dialects import anthropic, gemini, openai_chat, openai_responses
from proxy.dialects.anthropic_stream import MessagesStream
from proxy.dialects.gemini_stream import GeminiStream
from proxy.dialects.openai_chat_stream import ChatStream
from proxy.dialects.openai_responses_stream import ResponsesStream
from proxy.errors import ProxyError, error_body
from proxy.live import AnswerHead, LiveStream, Opened, StreamEvent, Text, head_of, whole_stream
from proxy.sampling import check_max_tokens
from proxy.server.connections import ConnectionGuard
from proxy.server.delivery import SSE_HEADERS, EventStream, deliver, end_stream, undelivered, waiting
from proxy.server.limits import log_left, read_body
from proxy.server.pipeline import CapturePipeline, budget_answer, conversation_of
from proxy.server.streaming import capture_streamed
from proxy.upstream.client import EngineClient
from proxy.upstream.pool import bind_session

HARNESS_SESSION_HEADERS = ("x-session-id", "proxy-x-session-id", "x-claude-code-session-id")
SSE_COMMENT = b": keepalive\n\n"
POLL_S = 0.25  # how often a quiet stream checks that its agent is still there
# Google's generate routes, any case: `/v1beta/models/{model}:{method}` (v1 and v1alpha too)
GEMINI_PATH = r"/{gemini:(?i:v1(?:beta|alpha)?/models/[^/:]+:[a-z]+)}"
_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True)
class Renderer:
    """How one dialect writes an answer: whole, as a stream (`LiveStream`), an error after the stream opened, and
    the bytes that keep a stream alive while the engine works (an SSE comment; Google's SDKs choke on those)."""

    whole: Callable[[Answer, ChatCall], bytes]
    live: Callable[[AnswerHead, ChatCall], LiveStream]
    stream_error: Callable[[ProxyError], bytes]
    keepalive: bytes = SSE_COMMENT


def _openai_stream_error(exc: ProxyError) -> bytes:
    return b"data: " + _ENCODER.encode(error_body("openai", exc.status, exc.message)) + b"\n\ndata: [DONE]\n\n"


def _anthropic_stream_error(exc: ProxyError) -> bytes:
    return b"event: error\ndata: " + _ENCODER.encode(error_body("anthropic", exc.status, exc.message)) + b"\n\n"


RENDERERS = {
    "openai_chat": Renderer(lambda a, c: openai_chat.completion(a), lambda h, c: ChatStream(h, c.include_usage),
                            _openai_stream_error),
    "anthropic_messages": Renderer(lambda a, c: anthropic.message(a), lambda h, c: MessagesStream(h),
                                   _anthropic_stream_error),
    "openai_responses": Renderer(openai_responses.response, ResponsesStream, openai_responses.stream_error),
    "google_gemini": Renderer(lambda a, c: gemini.response(a), lambda h, c: GeminiStream(h), gemini.stream_error,
                              keepalive=b"\n"),
}


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return (request.headers.get("x-api-key") or request.headers.get("x-goog-api-key") or request.query.get("key")
            or None)


def harness_headers(request: web.Request, user: str | None) -> dict[str, str]:
    """Harness-side session markers, recorded only (never used for routing); API keys are never kept."""
    found = {name: request.headers[name] for name in HARNESS_SESSION_HEADERS if name in request.headers}
    if user:
        found["user"] = user
    agent = request.headers.get("User-Agent")
    if agent:
        found["user_agent"] = agent
    return found


class AgentRoutes:
    def __init__(self, config: ProxyConfig, registry: SessionRegistry, engine: EngineClient,
                 pipeline: CapturePipeline, guard: ConnectionGuard) -> None:
        self.config = config
        self.guard = guard
        self.registry = registry
        self.engine = engine
        self.pipeline = pipeline
        self.responses_memory = openai_responses.ResponseMemory()
        self.captures: set[asyncio.Future[Any]] = set()  # calls at the engine, some outliving their agents

    async def cancel_captures(self) -> None:
        """At shutdown: end the calls still at the engine (their agents have left; the engine client is closed)."""
        for capture in list(self.captures):
            capture.cancel()
        await asyncio.gather(*self.captures, return_exceptions=True)

    def add_to(self, router: web.UrlDispatcher) -> None:
        for prefix in ("/s/{sid}", ""):
            router.add_post(prefix + "/v1/chat/completions", self.chat_completions)
            router.add_post(prefix + "/v1/messages", self.messages)
            router.add_post(prefix + "/v1/messages/count_tokens", self.count_tokens)
            router.add_post(prefix + "/v1/responses", self.responses)
            router.add_post(prefix + "/v1/responses/input_tokens", self.responses_input_tokens)
            router.add_post(prefix + GEMINI_PATH, self.gemini)
            router.add_get(prefix + "/v1/models", self.models)
        for path in ("/s/{sid}", "/s/{sid}/", "/s/{sid}/v1"):
            router.add_get(path, self.probe)

    def session_of(self, request: web.Request) -> Session:
        """The session an agent call belongs to, by path or by key; its own key is always required."""
        presented = presented_key(request)
        if not presented:
            raise ProxyError(401, "missing API key: present the session key as 'Authorization: Bearer <key>', "
                                  "'x-api-key', 'x-goog-api-key' or '?key='")
        sid = request.match_info.get("sid")
        if sid is not None:
            session = self.registry.by_id.get(sid)
            if session is None:
                raise ProxyError(404, f"no session {sid!r}")
            if not session.accepts(presented):
                raise ProxyError(401, "this key does not belong to this session")
        else:
            found = self.registry.by_presented_key(presented)
            if found is None:
                raise ProxyError(401, "unknown API key: not a session key of this proxy")
            session = found
        self.guard.identify(request.transport, f"session {session.id}")
        if session.closed:
            raise ProxyError(409, f"session {session.id} is closed")
        return session

    async def probe(self, request: web.Request) -> web.Response:
        """Claude Code probes its base URL with HEAD before the first call."""
        if request.match_info["sid"] not in self.registry.by_id:
            raise ProxyError(404, f"no session {request.match_info['sid']!r}")
        return web.Response(text="harness-rl proxy session\n")

    async def models(self, request: web.Request) -> web.Response:
        self.session_of(request)
        model = await self.engine.served_model() or "policy"
        body = {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "harness-rl"}]}
        return web.Response(body=_ENCODER.encode(body), content_type="application/json")

    async def _body(self, request: web.Request) -> bytes:
        if request.content_type != "application/json":
            raise ProxyError(400, f"the request body must be JSON (Content-Type: application/json), not "
                                  f"{request.content_type!r}")
        limit = self.config.max_body_mb * 2**20
        if request.content_length is not None and request.content_length > limit:
            raise ProxyError(413, f"request body exceeds {self.config.max_body_mb:g} MB")
        return await read_body(request, self.config.body_timeout_s)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        session = self.session_of(request)
        body, ignored = openai_chat.decode_body(await self._body(request), accept_images=self.config.accept_images)
        return await self._answer(request, session, openai_chat.to_call(body, ignored),
                                  harness_headers(request, body.user))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        session = self.session_of(request)
        body, ignored = anthropic.decode_body(await self._body(request), accept_images=self.config.accept_images)
        return await self._answer(request, session, anthropic.to_call(body, ignored), harness_headers(request, None))

    async def count_tokens(self, request: web.Request) -> web.Response:
        self.session_of(request)
        body, _ = anthropic.decode_body(await self._body(request), count_only=True,
                                        accept_images=self.config.accept_images)
        count = await self._count(anthropic.to_call(body, []))
        return web.Response(body=_ENCODER.encode({"input_tokens": count}), content_type="application/json")

    async def _count(self, call: ChatCall) -> int:
        """The exact prompt length of a call as a first turn: the engine's own rendering of it (the route every
        prompt is made with, which renders harmony too; vLLM's `/tokenize` runs the chat template alone)."""
        return (await self.engine.render(conversation_of(call))).count

    async def responses(self, request: web.Request) -> web.StreamResponse:
        session = self.session_of(request)
        body, ignored = openai_responses.decode_body(await self._body(request),
                                                     accept_images=self.config.accept_images)
        history = self.responses_memory.history(session, body.previous_response_id)
        call, conversation = openai_responses.to_call(body, ignored, history)
        return await self._answer(request, session, call, harness_headers(request, None),
                                  openai_responses.new_response_id(),
                                  lambda answer: self.responses_memory.remember(session, conversation, answer))

    async def responses_input_tokens(self, request: web.Request) -> web.Response:
        """The exact prompt length the same `/v1/responses` request would have."""
        session = self.session_of(request)
        body, _ = openai_responses.decode_body(await self._body(request), accept_images=self.config.accept_images)
        call, _ = openai_responses.to_call(body, [], self.responses_memory.history(session, body.previous_response_id))
        body_out = {"object": "response.input_tokens", "input_tokens": await self._count(call)}
        return web.Response(body=_ENCODER.encode(body_out), content_type="application/json")

    async def gemini(self, request: web.Request) -> web.StreamResponse:
        """`:generateContent`, `:streamGenerateContent?alt=sse` and `:countTokens` of `models/{model}`."""
        session = self.session_of(request)
        model, _, named = request.match_info["gemini"].rpartition("/")[2].partition(":")
        method = named.lower()
        if method == "counttokens":
            body = gemini.decode_count_body(await self._body(request), accept_images=self.config.accept_images)
            count = await self._count(gemini.to_call(body, [], model=model, stream=False))
            return web.Response(body=_ENCODER.encode({"totalTokens": count}), content_type="application/json")
        if method not in ("generatecontent", "streamgeneratecontent"):
            raise ProxyError(404, f"models/{model}:{named} is not served here (generateContent, "
                                  "streamGenerateContent, countTokens are)")
        stream = method == "streamgeneratecontent"
        if stream and request.query.get("alt", "").lower() != "sse":
            raise ProxyError(400, "streamGenerateContent is served as server-sent events only: add ?alt=sse")
        body, ignored = gemini.decode_body(await self._body(request), accept_images=self.config.accept_images)
        return await self._answer(request, session, gemini.to_call(body, ignored, model=model, stream=stream),
                                  harness_headers(request, None))

    async def _answer(self, request: web.Request, session: Session, call: ChatCall, harness: dict[str, str],
                      answer_id: str | None = None,
                      answered: Callable[[Answer], None] | None = None) -> web.StreamResponse:
        """Capture the call and answer it, under the id its dialect refers back to (`answered` learns it)."""
        await self.engine.served_model()  # learns the engine's context size once it serves
        check_max_tokens(call, self.engine.max_model_len, session.opened.max_tokens_per_turn)
        renderer = RENDERERS[call.dialect]
        bind_session(session)  # this call's engine requests go to the session's engine (proxy.upstream.pool)
        gate = self.pipeline.gate
        await gate.enter()
        if not session.admit():
            gate.leave()
            session.record_budget_stop()
            answer = budget_answer(call, answer_id)
            if answered:
                answered(answer)
            return await self._reply(request, call, renderer, answer, None, session)

        def done(task: asyncio.Future) -> None:
            self.captures.discard(task)
            if task.cancelled() or task.exception() is not None:
                session.release()
            gate.leave()

        if call.stream:
            return await self._stream(request, session, call, harness, renderer, answer_id, answered, done)
        capture = asyncio.ensure_future(self.pipeline.capture(session, call, harness, answer_id))
        self.captures.add(capture)  # it runs on if the agent leaves
        capture.add_done_callback(done)
        answer, node_id = await capture
        if answered:
            answered(answer)
        return await self._reply(request, call, renderer, answer, node_id, session)

    async def _stream(self, request: web.Request, session: Session, call: ChatCall, harness: dict[str, str],
                      renderer: Renderer, answer_id: str | None, answered: Callable[[Answer], None] | None,
                      done: Callable[[asyncio.Future], None]) -> web.StreamResponse:
        """Stream the call's answer as the engine samples it. The capture runs on its own task; if the agent
        leaves, it is told (`left`), and the turn, recorded all the same, is marked undelivered (mask 0)."""
        events: asyncio.Queue[StreamEvent | Exception] = asyncio.Queue()
        left = asyncio.Event()

        async def run() -> None:
            try:
                await capture_streamed(self.pipeline, session, call, harness, events.put_nowait, left, answer_id)
            except Exception as exc:
                events.put_nowait(exc)
                raise

        capture = asyncio.ensure_future(run())
        self.captures.add(capture)
        capture.add_done_callback(done)
        response: web.StreamResponse | None = None
        writer: LiveStream | None = None
        unsent = bytearray()  # the stream's opening waits for its first text, so both go in one send
        texts = False  # whether `unsent` holds text
        try:
            while True:
                first = await self._next_event(request, events, renderer, response)
                if isinstance(first, web.StreamResponse):  # keep-alives opened the stream
                    response = first
                    continue
                for event in (first, *waiting(events)):  # the events already waiting go out in one send
                    if isinstance(event, Exception):
                        if response is None and writer is None:  # nothing started: an error status
                            raise event
                        error = event if isinstance(event, ProxyError) else ProxyError(500, f"proxy failure: {event!r}")
                        return await end_stream(request, response, bytes(unsent + renderer.stream_error(error)),
                                                None, session)
                    if isinstance(event, Opened):
                        writer = renderer.live(event.head, call)
                        unsent += writer.open()
                    elif isinstance(event, Text):
                        assert writer is not None
                        unsent += writer.text(event.kind, event.text)
                        texts = True
                    else:
                        assert writer is not None
                        if answered:
                            answered(event.answer)
                        return await end_stream(request, response, bytes(unsent + writer.finish(event.answer)),
                                                event.node_id, session)
                if texts or response is not None and unsent:
                    if response is None:
                        response = EventStream(headers=SSE_HEADERS)
                        await response.prepare(request)
                    await response.write(bytes(unsent))
                    unsent.clear()
                    texts = False
        except (ConnectionResetError, asyncio.CancelledError):
            left.set()  # the capture cuts the generation short; the turn it records was never delivered
            capture.add_done_callback(lambda _: undelivered(events, session))
            if response is None:
                raise  # the middleware says the agent left
            log_left(request)
            return response

    async def _next_event(self, request: web.Request, events: asyncio.Queue[StreamEvent | Exception],
                          renderer: Renderer, response: web.StreamResponse | None) -> Any:
        """The capture's next event; meanwhile, watch for the agent leaving and keep a quiet stream alive (the
        stream, opened for that, is returned once)."""
        quiet, tick = 0.0, min(POLL_S, self.config.keepalive_s)
        while True:
            try:
                async with asyncio.timeout(tick):
                    return await events.get()
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("the agent disconnected") from None
            quiet += tick
            if quiet >= self.config.keepalive_s:
                quiet = 0.0
                opened = response is None
                if response is None:
                    response = web.StreamResponse(headers=SSE_HEADERS)
                    await response.prepare(request)
                await response.write(renderer.keepalive)
                if opened:
                    return response

    async def _reply(self, request: web.Request, call: ChatCall, renderer: Renderer, answer: Answer,
                     node_id: str | None, session: Session) -> web.StreamResponse:
        """Send a finished answer (as a stream when the agent asked for one); an undelivered turn keeps mask 0."""
        if call.stream:
            return await end_stream(request, None, whole_stream(renderer.live(head_of(answer), call), answer), node_id,
                                    session)
        response = web.Response(body=renderer.whole(answer, call), content_type="application/json")
        return await deliver(request, response, b"", node_id, session)
