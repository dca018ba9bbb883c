"""The proxy process: its state, the aiohttp app (control routes + agent routes), errors, and starting it.

Each model call is admitted against its session's budget, held while the learner syncs weights, sent
to the engine with capture on, recorded durably, and only then answered in the agent's dialect
(`pipeline`, `agent_routes`). The control API lives in `control_routes`; connection limits and read
timeouts in `limits`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.capture.recovery import recover_store
from proxy.capture.session import SessionRegistry
from proxy.config import ProxyConfig
from proxy.errors import Dialect, ProxyError, error_body
from proxy.server.agent_routes import AgentRoutes
from proxy.server.connections import ConnectionGuard
from proxy.server.control_routes import ControlRoutes
from proxy.server.limits import LINGER_S, RequestHandler, client_left, log_left, send_and_close
from proxy.server.pipeline import CapturePipeline
from proxy.upstream.pool import EnginePool

log = logging.getLogger("harness_rl.proxy")


class Proxy:
    """The running proxy's state: sessions, the engines (`upstream.pool`), the capture pipeline and its pause gate."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.admin_token = config.admin_token or secrets.token_urlsafe(24)
        self.registry = SessionRegistry(Path(config.store_dir), fsync=config.fsync,
                                        whole_turn_every=config.whole_turn_every)
        self.engine = EnginePool(config.upstream, check_s=config.engine_check_s, timeout_s=config.request_timeout_s,
                                 retries=config.retries, model=config.upstream_model,
                                 max_reply_bytes=int(config.max_reply_mb * 2**20), vocab_size=config.vocab_size)
        self.advertise_url = config.advertise_url
        self.guard = ConnectionGuard(config.max_connections, config.max_connections_per_client)
        self.pipeline = CapturePipeline(config, self.engine)
        self.control = ControlRoutes(config, self.admin_token, self.registry, self.pipeline, self.engine,
                                     self._base_url, self.guard)
        self.agents = AgentRoutes(config, self.registry, self.engine, self.pipeline, self.guard)
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=int(self.config.max_body_mb * 2**20), middlewares=[self._errors])
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        self.control.add_to(app.router)
        self.agents.add_to(app.router)
        return app

    def _base_url(self, request: web.Request) -> str:
        return (self.advertise_url or f"{request.scheme}://{request.host}").rstrip("/")

    async def _on_startup(self, app: web.Application) -> None:
        recovery = recover_store(self.registry)
        if recovery.lost_turns or recovery.quarantined_lines or recovery.unreadable_files:
            log.warning("store %s: %d sessions, %d turns recovered; %d turns lost, %d damaged lines quarantined, "
                        "%d unreadable files", self.config.store_dir, recovery.sessions, recovery.turns,
                        recovery.lost_turns, recovery.quarantined_lines, recovery.unreadable_files)
        await self.engine.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.engine.close()
        self.registry.close_all()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProxyError as exc:
            response = error_response(dialect_of(request), exc)
            return await send_and_close(request, response) if exc.close_connection else response
        except RecursionError:
            return error_response(dialect_of(request), ProxyError(400, "the request's JSON is nested too deeply"))
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_body_mb
            return error_response(dialect_of(request), ProxyError(413, f"request body exceeds {limit:g} MB"))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = f"{exc.reason}: {request.method} {request.path}"
            return error_response(dialect_of(request), ProxyError(exc.status, message))
        except Exception as exc:
            if isinstance(exc, ConnectionError) and client_left(request):
                log_left(request)  # one line: a client leaving is no proxy failure
                return web.Response(status=499)  # never sent: no one is there to read it
            log.exception("proxy failure on %s %s", request.method, request.path)
            return error_response(dialect_of(request), ProxyError(500, f"proxy failure: {exc!r}"))
        finally:
            self.guard.finished(request.transport)


def dialect_of(request: web.Request) -> Dialect:
    """The error shape a caller of this path parses: Google's for `.../models/{model}:{method}`."""
    path = request.path
    if "/v1/messages" in path:
        return "anthropic"
    if "/models/" in path.lower() and ":" in path.rpartition("/")[2]:
        return "google"
    return "openai"


def error_response(dialect: Dialect, exc: ProxyError) -> web.Response:
    from proxy.server.control_routes import json_response

    response = json_response(error_body(dialect, exc.status, exc.message), status=exc.status)
    response.headers.update(exc.headers)
    return response


@dataclass
class RunningProxy:
    """A started proxy: where it listens, its admin token, and how to stop it."""

    url: str
    admin_token: str
    proxy: Proxy
    runner: web.AppRunner
    server: asyncio.Server

    async def stop(self) -> None:
        self.server.close()
        await self.runner.cleanup()
        await self.proxy.agents.cancel_captures()


async def start_proxy(config: ProxyConfig, waiting: str | None = None) -> RunningProxy:
    """Start the proxy inside the running event loop, its connections counted and timed (`proxy.server.limits`).

    With `waiting`, it listens but sends no call (each is answered 503 with that reason) until
    `proxy.engine.open()`: `harness-rl serve proxy` waits so for its engine and checks it. Either way it says
    which tokenizer files it renders prompts with once its engine answers (`PromptMaker.settle_source`).
    """
    proxy = Proxy(config)
    proxy.engine.waiting = waiting
    runner = web.AppRunner(proxy.app, handle_signals=False)
    await runner.setup()
    loop = asyncio.get_running_loop()
    manager = runner.server
    assert manager is not None

    def handler() -> RequestHandler:
        return RequestHandler(manager, loop=loop, keepalive_timeout=config.header_timeout_s, lingering_time=LINGER_S,
                              access_log=None)  # type: ignore[arg-type]  # None: no access log (aiohttp's documented way)

    try:
        server = await loop.create_server(proxy.guard.protocol_factory(handler), config.host or None, config.port,
                                          backlog=1024, reuse_address=True)
    except BaseException:
        await runner.cleanup()  # a port in use: close the engine client and the store before saying so
        raise
    port = server.sockets[0].getsockname()[1]
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    url = f"http://{host}:{port}"
    if proxy.advertise_url is None:
        proxy.advertise_url = url
    if waiting is None:
        await proxy.pipeline.prompts.settle_source()
    return RunningProxy(url, proxy.admin_token, proxy, runner, server)
