"""Running the engine's app: in a background thread (tests, the learner) or in the foreground (CLI).

A client that disconnects cancels its handler, and with it its generation (nobody is left to read
it). Stopping aborts every generation first (`create_app`'s shutdown hook), then waits at most
`SHUTDOWN_S` for handlers to answer, so SIGTERM ends a busy server within seconds.
"""

import asyncio
import signal
from dataclasses import dataclass, field

from aiohttp import web

from harness_rl.background import BackgroundLoop
from harness_rl.engine.app import create_app
from harness_rl.engine.engine import Engine

SHUTDOWN_S = 2.0


def make_runner(app: web.Application) -> web.AppRunner:
    """The engine's runner: handlers cancelled when their client leaves, a short shutdown."""
    return web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=SHUTDOWN_S)


@dataclass
class ServerHandle:
    """A server running on its own `BackgroundLoop`; `stop()` shuts it down."""

    url: str
    _loop: BackgroundLoop = field(repr=False)
    _runner: web.AppRunner = field(repr=False)

    def stop(self) -> None:
        if not self._loop.alive:
            return
        self._loop.run(self._runner.cleanup(), timeout=30)
        self._loop.close()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve_in_thread(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    forced_completions: bool = False,
    return_tokens_as_token_ids: bool = False,
) -> ServerHandle:
    """Serve `engine` on `host:port` (0 = a free port) from a background loop."""
    loop = BackgroundLoop("engine-server")
    app = create_app(
        engine, forced_completions=forced_completions, return_tokens_as_token_ids=return_tokens_as_token_ids
    )
    runner = make_runner(app)

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return int(runner.addresses[0][1])

    try:
        bound = loop.run(start(), timeout=60)
    except BaseException:
        loop.close()
        raise
    return ServerHandle(f"http://{host}:{bound}", loop, runner)


def serve_forever(app: web.Application, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then close connections and return."""

    async def main() -> None:
        runner = make_runner(app)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"harness-rl engine serving on http://{host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())
