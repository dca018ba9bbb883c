"""vLLM's dev-mode control routes (and the proxy's admin routes) on loopback, for the weight-sync tests."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_sync import free_port

PUSH_ORDER = ["POST /pause?mode=wait", "POST /start_weight_update", "POST /update_weights",
              "POST /finish_weight_update", "POST /reset_prefix_cache", "POST /resume"]


class FakeVllm:
    """vLLM's dev-mode control routes on loopback. `/update_weights` and `/init_weight_transfer_engine`
    block until the trainer's side of the transfer has started, as the real ones block on NCCL."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.bodies: dict[str, object] = {}
        self.fail: dict[str, int] = {}
        self.hang: set[str] = set()
        self.transfer_backend: str | None = None  # what /server_info says vLLM was started with (None: no answer)
        self.trainer_joined = threading.Event()
        self.server_joined = threading.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.Response:
        route = request.path
        self.calls.append(f"{request.method} {route}" + (f"?{request.query_string}" if request.query_string else ""))
        self.authorization = request.headers.get("Authorization")
        if request.can_read_body:
            self.bodies[route] = await request.json()
        if route in self.hang:
            await asyncio.sleep(2.5)
        if route in self.fail:
            return web.json_response({"error": f"{route} exploded"}, status=self.fail[route])
        if route in ("/update_weights", "/init_weight_transfer_engine"):
            self.server_joined.set()
            joined = await asyncio.to_thread(self.trainer_joined.wait, 5)
            self.trainer_joined.clear()
            if not joined:
                return web.json_response({"error": "trainer never joined"}, status=500)
        if route == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if route == "/server_info" and self.transfer_backend is not None:
            return web.json_response({"vllm_config": {"weight_transfer_config": {"backend": self.transfer_backend}}})
        if route == "/get_world_size":
            return web.json_response({"world_size": 2})
        if route == "/admin/pause":
            return web.json_response({"paused": True, "in_flight": 0})
        if route == "/admin/resume":
            return web.json_response({"paused": False})
        if route == "/admin/policy_version":
            return web.json_response(self.bodies[route])
        return web.json_response({"status": "ok"})

    def start(self) -> None:
        self.loop = BackgroundLoop("fake-vllm")
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)

        async def serve() -> None:
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        self.loop.run(serve())

    def stop(self) -> None:
        self.loop.run(self.runner.cleanup(), timeout=10)
        self.loop.close()
