"""`harness-rl serve proxy`: the intercept proxy in front of one engine or several (never imports torch).

Its flags are generated from `proxy.config.ProxyConfig`, the same settings a training run's `[proxy]`
section holds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from harness_rl.flags import Flag, add_flags, flags_of
from proxy.config import ProxyConfig

DEFAULT_PORT = 8100
ADMIN_TOKEN_ENV = "HARNESS_RL_ADMIN_TOKEN"
_NAMES = {"--proxy-host": "--host", "--proxy-port": "--port"}
FLAGS = [dataclasses.replace(f, name=_NAMES.get(f.name, f.name)) for f in flags_of(ProxyConfig, internal=True)]


def _default_text(flag: Flag) -> str:
    return str(DEFAULT_PORT) if flag.name == "--port" else flag.default_text


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "proxy", help="run the intercept proxy that records agents' model calls as training traces",
        description="Record every model call agents make (OpenAI Chat and Responses, Anthropic Messages, Google "
                    "Gemini) with the engine's exact token ids, behaviour logprobs and loss masks. At start it "
                    "checks that the engine can capture exactly (as `harness-rl doctor` does) and refuses one "
                    "that cannot, naming each fix. Prints its URL on start; the admin token comes from "
                    f"--admin-token-file or ${ADMIN_TOKEN_ENV} (else a fresh one is written to the store).")
    add_flags(parser, FLAGS, _default_text)
    parser.add_argument("--admin-token-file", metavar="FILE",
                        help=f"file holding the control-API token (default: ${ADMIN_TOKEN_ENV}, else a fresh token "
                             "written to STORE/admin-token, mode 0600)")
    parser.add_argument("--engine-check", action=argparse.BooleanOptionalAction, default=True,
                        help="check at start that the engine can capture exactly (token ids, processed logprobs, "
                             "tool parser, context, token-in routes), and refuse it otherwise (default: on)")
    parser.add_argument("--engine-wait", type=float, default=300.0, metavar="SECONDS",
                        help="how long to wait for an engine that does not answer yet (default: 300)")
    parser.set_defaults(run=run)


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    """uvloop's `run` when installed (about half the proxy's per-request CPU), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run
    return uvloop.run


def _raise_open_file_limit() -> None:
    """One log file and a few sockets per live session: allow as many open files as the system lets us."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _admin_token(args: argparse.Namespace, store: str) -> tuple[str, str]:
    """The admin token and where it came from; a fresh one is written (0600) where only its owner reads it."""
    import secrets
    from pathlib import Path

    if args.admin_token_file:
        return Path(args.admin_token_file).read_text().strip(), args.admin_token_file
    if os.environ.get(ADMIN_TOKEN_ENV):
        return os.environ[ADMIN_TOKEN_ENV], f"${ADMIN_TOKEN_ENV}"
    path = Path(store) / "admin-token"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")
    return token, str(path)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import gc
    import signal

    import msgspec

    from harness_rl.flags import collect, flag_for_path
    from harness_rl.settings import ConfigError
    from harness_rl.tools.doctor import MIN_RUN_CONTEXT, EngineNotExact, require_exact_capture
    from proxy.server import start_proxy

    settings = {"port": DEFAULT_PORT, **collect(args, FLAGS)}
    try:
        config = msgspec.convert(settings, ProxyConfig)
        if not config.upstream:
            raise ConfigError("--upstream", "required: the engine's base URL (vLLM or `harness-rl serve engine`); "
                                            "repeat it for several engines")
        token, source = _admin_token(args, config.store_dir)
    except msgspec.ValidationError as exc:
        text, _, where = str(exc).partition(" - at `")
        print(f"harness-rl serve proxy: {flag_for_path(FLAGS, where.rstrip('`'))}: {text}", file=sys.stderr)
        return 2
    except (ConfigError, OSError) as exc:
        print(f"harness-rl serve proxy: {exc}", file=sys.stderr)
        return 2
    config = msgspec.structs.replace(config, admin_token=token)
    if args.engine_check:
        try:
            for upstream in config.upstream:
                require_exact_capture(upstream, model=config.upstream_model, min_context=MIN_RUN_CONTEXT,
                                      weight_sync="none", wait_s=args.engine_wait)
        except EngineNotExact as exc:
            print(f"harness-rl serve proxy: {exc}", file=sys.stderr)
            return 1
    _raise_open_file_limit()

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        running = await start_proxy(config)
        gc.collect()
        gc.freeze()  # start-up objects (imports, recovered sessions) never need scanning again
        # Full collections scan every live turn; defer them (100x rarer) to the pauses of weight syncs,
        # where the proxy collects while agents are held (ProxyConfig.collect_on_pause).
        gen0, gen1, _ = gc.get_threshold()
        gc.set_threshold(gen0, gen1, 1000)
        sessions = len(running.proxy.registry.by_id)
        print(f"harness-rl proxy on {running.url} -> {', '.join(config.upstream)} (store {config.store_dir}, "
              f"{sessions} sessions recovered; admin token from {source}, {token[:4]}…)", flush=True)
        await stop.wait()
        await running.stop()
        print("harness-rl proxy stopped", flush=True)

    try:
        _event_loop_runner()(serve())
    except OSError as exc:
        print(f"harness-rl serve proxy: {exc}", file=sys.stderr)
        return 1
    return 0
