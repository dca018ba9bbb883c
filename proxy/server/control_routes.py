"""The control API (admin token): sessions, their traces, the weight-sync pause, the policy version, health.

Requests and replies are the Structs of `proxy.control_api`, shared with `ProxyClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from harness_rl.trace import FORMATS, TraceFormat, TraceFormatError, TraceValidationError
from proxy.capture.session import Session, SessionRegistry, TraceSnapshot
from proxy.config import ProxyConfig
from proxy.control_api import Deleted, Health, Paused, PolicyVersion, SessionCreate, SessionInfo, SessionList
from proxy.errors import ProxyError
from proxy.server.connections import ConnectionGuard
from proxy.server.limits import read_body
from proxy.server.pipeline import CapturePipeline
from proxy.upstream.pool import EnginePool

_ENCODER = msgspec.json.Encoder()
CONTEXT_QUERY_S = 5.0  # how long creating a capped session waits to learn the engine's context size


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_ENCODER.encode(data), content_type="application/json")


def _decode(data: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(data or b"{}", type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProxyError(400, f"bad {kind.__name__} request: {exc}") from None
    except RecursionError:
        raise ProxyError(400, f"bad {kind.__name__} request: JSON nested too deeply") from None


class ControlRoutes:
    def __init__(self, config: ProxyConfig, admin_token: str, registry: SessionRegistry, pipeline: CapturePipeline,
                 engines: EnginePool, base_url: Callable[[web.Request], str], guard: ConnectionGuard) -> None:
        self.config = config
        self.admin_token = admin_token
        self.registry = registry
        self.pipeline = pipeline
        self.engines = engines
        self.base_url = base_url
        self.guard = guard

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/", self.ok)
        router.add_get("/health", self.health)
        router.add_post("/sessions", self.create_session)
        router.add_get("/sessions", self.list_sessions)
        router.add_get("/sessions/{sid}", self.get_session)
        router.add_get("/sessions/{sid}/trace", self.get_trace)
        router.add_post("/sessions/{sid}/close", self.close_session)
        router.add_delete("/sessions/{sid}", self.delete_session)
        router.add_post("/admin/pause", self.pause)
        router.add_post("/admin/resume", self.resume)
        router.add_post("/admin/policy_version", self.set_policy_version)

    def _admin(self, request: web.Request) -> None:
        presented = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(presented, f"Bearer {self.admin_token}".encode()):
            raise ProxyError(401, "the control API needs 'Authorization: Bearer <admin token>'")
        self.guard.identify(request.transport, "admin")

    def _session(self, request: web.Request) -> Session:
        session = self.registry.by_id.get(request.match_info["sid"])
        if session is None:
            raise ProxyError(404, f"no session {request.match_info['sid']!r}")
        return session

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="harness-rl proxy\n")

    async def health(self, request: web.Request) -> web.Response:
        """200 while agents' calls can be served; 503 with the reason while none can (the same report)."""
        gate = self.pipeline.gate
        unavailable = self.engines.unavailable()
        health = Health(status="ok" if unavailable is None else "unavailable", reason=unavailable,
                        sessions=len(self.registry.by_id), paused=gate.paused, in_flight=gate.in_flight,
                        policy_version=self.pipeline.announced_version, engines=self.engines.health(),
                        recovery=self.registry.recovery, connections=self.guard.open,
                        connections_refused=self.guard.refused, connections_evicted=self.guard.evicted)
        return json_response(health, status=200 if unavailable is None else 503)

    async def create_session(self, request: web.Request) -> web.Response:
        self._admin(request)
        body: SessionCreate = _decode(await read_body(request, self.config.body_timeout_s), SessionCreate)
        cap = body.max_tokens_per_turn if body.max_tokens_per_turn is not None \
            else self.config.max_tokens_per_turn
        await self._check_cap(cap)
        session, key = self.registry.create(
            body.metadata, body.max_turns if body.max_turns is not None else self.config.max_turns, cap, body.seed)
        base = f"{self.base_url(request)}/s/{session.id}"
        return json_response(SessionInfo(id=session.id, key=key, openai_base_url=base + "/v1",
                                         anthropic_base_url=base, gemini_base_url=base), status=201)

    async def _check_cap(self, cap: int | None) -> None:
        """A max_tokens cap must leave room for a prompt in the engine's context (when the engine says its size)."""
        if cap is None:
            return
        engine = self.pipeline.engine
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(engine.served_model(), CONTEXT_QUERY_S)
        if engine.max_model_len is not None and cap >= engine.max_model_len:
            raise ProxyError(400, f"max_tokens_per_turn {cap} leaves no room for a prompt in the engine's "
                                  f"{engine.max_model_len}-token context")

    async def list_sessions(self, request: web.Request) -> web.Response:
        self._admin(request)
        return json_response(SessionList([s.summary() for s in self.registry.by_id.values()]))

    async def get_session(self, request: web.Request) -> web.Response:
        self._admin(request)
        return json_response(self._session(request).summary())

    async def get_trace(self, request: web.Request) -> web.Response:
        """The session's validated trace: `?format=full` (default), `delta` or `openenv`."""
        self._admin(request)
        fmt = request.query.get("format", "full")
        if fmt not in FORMATS:
            raise ProxyError(400, f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        snapshot = self._session(request).snapshot()
        body = await asyncio.to_thread(_validated_trace_json, snapshot, fmt)  # agents keep being served meanwhile
        return web.Response(body=body, content_type="application/json")

    async def close_session(self, request: web.Request) -> web.Response:
        """Seal the session: later calls get 409, a call in flight is answered 409 and not recorded."""
        self._admin(request)
        session = self._session(request)
        session.close()
        return json_response(session.summary())

    async def delete_session(self, request: web.Request) -> web.Response:
        """Forget the session and remove its log; a call in flight is answered 404 and writes nothing."""
        self._admin(request)
        self.registry.delete(self._session(request))
        return json_response(Deleted(request.match_info["sid"]))

    async def pause(self, request: web.Request) -> web.Response:
        """Hold new agent calls; answer once every call already at the engine has been recorded, or at once
        with `?drain=false` (the engine then pauses those calls itself, and they finish on the new weights)."""
        self._admin(request)
        await self.pipeline.gate.pause(drain=request.query.get("drain", "true").lower() != "false")
        if self.config.collect_on_pause:
            gc.collect()  # agents are held anyway: the collector's pause costs them nothing now
        return json_response(Paused(True, self.pipeline.gate.in_flight))

    async def resume(self, request: web.Request) -> web.Response:
        self._admin(request)
        self.pipeline.gate.resume()
        return json_response(Paused(False))

    async def set_policy_version(self, request: web.Request) -> web.Response:
        self._admin(request)
        body: PolicyVersion = _decode(await read_body(request, self.config.body_timeout_s), PolicyVersion)
        self.pipeline.announced_version = body.version
        await self.engines.announce(body.version)
        return json_response(body)


def _validated_trace_json(snapshot: TraceSnapshot, fmt: TraceFormat) -> bytes:
    try:
        trace = snapshot.build().validate()
    except (TraceFormatError, TraceValidationError) as exc:
        raise ProxyError(500, f"the captured trace does not validate: {exc}") from None
    return trace.to_json(fmt)
