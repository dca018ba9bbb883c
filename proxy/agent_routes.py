"""The routes agents call: each dialect's body decoded into a `ChatCall`, captured, and answered in kind.

Agents reach their session by path (`/s/{id}/v1/...`, `/s/{id}/v1beta/models/...`) or by presenting the
session key as their API key on the plain paths; the key is required either way. A streaming agent whose
engine call is slow gets its stream opened early with keep-alives; the capture runs to its end even if the
agent leaves, and a completion the agent never received stays in the trace with mask 0.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from proxy import anthropic, gemini, openai_chat, openai_responses
from proxy.chat import Answer, ChatCall
from proxy.config import ProxyConfig
from proxy.errors import ProxyError, error_body
from proxy.limits import read_body
from proxy.pipeline import CapturePipeline, budget_answer
from proxy.session import Session, SessionRegistry
from proxy.upstream import EngineClient

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
HARNESS_SESSION_HEADERS = ("x-session-id", "proxy-x-session-id", "x-claude-code-session-id")
SSE_COMMENT = b": keepalive\n\n"
# Google's generate routes, any case: `/v1beta/models/{model}:{method}` (v1 and v1alpha too)
GEMINI_PATH = r"/{gemini:(?i:v1(?:beta|alpha)?/models/[^/:]+:[a-z]+)}"
_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True)
class Renderer:
    """How one dialect writes an answer: whole, as its stream, an error after the stream opened, and the
    bytes that keep a stream alive while the engine works (an SSE comment; Google's SDKs choke on those)."""

    whole: Callable[[Answer, ChatCall], bytes]
    stream: Callable[[Answer, ChatCall], bytes]
    stream_error: Callable[[ProxyError], bytes]
    keepalive: bytes = SSE_COMMENT


def _openai_stream_error(exc: ProxyError) -> bytes:
    return b"data: " + _ENCODER.encode(error_body("openai", exc.status, exc.message)) + b"\n\ndata: [DONE]\n\n"


def _anthropic_stream_error(exc: ProxyError) -> bytes:
    return b"event: error\ndata: " + _ENCODER.encode(error_body("anthropic", exc.status, exc.message)) + b"\n\n"


RENDERERS = {
    "openai_chat": Renderer(lambda a, c: openai_chat.completion(a),
                            lambda a, c: openai_chat.sse_events(a, c.include_usage), _openai_stream_error),
    "anthropic_messages": Renderer(lambda a, c: anthropic.message(a), lambda a, c: anthropic.sse_events(a),
                                   _anthropic_stream_error),
    "openai_responses": Renderer(openai_responses.response, openai_responses.sse_events,
                                 openai_responses.stream_error),
    "google_gemini": Renderer(lambda a, c: gemini.response(a), lambda a, c: gemini.sse_events(a),
                              gemini.stream_error, keepalive=b"\n"),
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
                 pipeline: CapturePipeline) -> None:
        self.config = config
        self.registry = registry
        self.engine = engine
        self.pipeline = pipeline
        self.responses_memory = openai_responses.ResponseMemory()

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
        """The exact prompt length of a call, from the engine's own chat template."""
        return await self.engine.count_chat_tokens([msgspec.to_builtins(m) for m in call.messages],
                                                   msgspec.to_builtins(call.tools) if call.tools else None)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        session = self.session_of(request)
        body, ignored = openai_responses.decode_body(await self._body(request),
                                                     accept_images=self.config.accept_images)
        history = self.responses_memory.history(session, body.previous_response_id)
        call, conversation = openai_responses.to_call(body, ignored, history)
        return await self._answer(request, session, call, harness_headers(request, None),
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
                      named: Callable[[Answer], Answer] | None = None) -> web.StreamResponse:
        """Capture the call and answer it; `named` may give the answer the id its dialect refers back to."""
        renderer = RENDERERS[call.dialect]
        gate = self.pipeline.gate
        await gate.enter()
        if not session.admit():
            gate.leave()
            session.record_budget_stop()
            answer = budget_answer(call)
            return await self._reply(request, call, renderer, named(answer) if named else answer, None, None, session)
        capture = asyncio.ensure_future(self.pipeline.capture(session, call, harness))  # runs on if the agent leaves

        def done(task: asyncio.Future) -> None:
            if task.cancelled() or task.exception() is not None:
                session.release()
            gate.leave()

        capture.add_done_callback(done)
        stream = await self._keep_alive(request, capture, renderer.keepalive) if call.stream else None
        try:
            answer, node_id = await capture
        except Exception as exc:
            if stream is None:
                raise
            error = exc if isinstance(exc, ProxyError) else ProxyError(500, f"proxy failure: {exc!r}")
            with contextlib.suppress(ConnectionResetError):
                await stream.write(renderer.stream_error(error))
                await stream.write_eof()
            return stream
        return await self._reply(request, call, renderer, named(answer) if named else answer, node_id, stream,
                                 session)

    async def _keep_alive(self, request: web.Request, capture: asyncio.Future,
                          keepalive: bytes) -> web.StreamResponse | None:
        """While a slow engine call runs, open the agent's stream and send SSE comments so it does not time out."""
        done, _ = await asyncio.wait({capture}, timeout=self.config.keepalive_s)
        if done:
            return None
        stream = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await stream.prepare(request)
            while not capture.done():
                await stream.write(keepalive)
                await asyncio.wait({capture}, timeout=self.config.keepalive_s)
        except ConnectionResetError:
            pass  # the agent left; the turn is still recorded, then marked undelivered
        return stream

    async def _reply(self, request: web.Request, call: ChatCall, renderer: Renderer, answer: Answer,
                     node_id: str | None, stream: web.StreamResponse | None, session: Session) -> web.StreamResponse:
        """Send the answer (on `stream` if keep-alives already opened it); an undelivered turn keeps mask 0."""
        response: web.StreamResponse
        if call.stream:
            response = stream or web.StreamResponse(headers=SSE_HEADERS)
            payload = renderer.stream(answer, call)
        else:
            response = web.Response(body=renderer.whole(answer, call), content_type="application/json")
        try:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the agent disconnected before its answer was ready")
            if not response.prepared:
                await response.prepare(request)
            if call.stream:
                await response.write(payload)
            await response.write_eof()
        except ConnectionResetError:
            if node_id is not None:
                session.mark_undelivered(node_id)
        except asyncio.CancelledError:
            if node_id is not None:
                session.mark_undelivered(node_id)
            raise
        return response
