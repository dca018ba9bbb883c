"""`harness-rl serve proxy`: the intercept proxy in front of one engine or several (never imports torch).

Its flags are generated from `proxy.config.ProxyConfig`, the same settings a training run's `[proxy]`
section holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from harness_rl.commands.help_layout import PROXY_GROUPS
from harness_rl.flags import Flag, add_flag_groups, flags_of
from harness_rl.settings import ConfigError
from harness_rl.wire import ADMIN_TOKEN_ENV
from proxy.config import ProxyConfig

if TYPE_CHECKING:
    from proxy.server.app import RunningProxy

DEFAULT_PORT = 8100
WAIT_LINE_S = 30.0  # how often the wait for the engine is said
ASK_AGAIN_S = 2.0  # how often an engine that does not answer yet is asked again
_NAMES = {"--proxy-host": "--host", "--proxy-port": "--port"}
FLAGS = [dataclasses.replace(f, name=_NAMES.get(f.name, f.name)) for f in flags_of(ProxyConfig, internal=True)]


def _default_text(flag: Flag) -> str:
    return {"--port": f"default: {DEFAULT_PORT}", "--upstream": "required"}.get(flag.name, flag.default_text)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "proxy", help="run the intercept proxy that records agents' model calls as training traces",
        usage="%(prog)s --upstream URL [FLAG ...]",
        description="Record every model call agents make (OpenAI Chat and Responses, Anthropic Messages, Google "
                    "Gemini) with the engine's exact token ids, behaviour logprobs and loss masks. It listens at "
                    "once; until its engine answers (--engine-wait) and passes the check that it can capture "
                    "exactly (as `harness-rl doctor` does), /health and agents get 503 with the reason, and an "
                    "engine that cannot is refused, naming each fix. The admin token comes from "
                    f"--admin-token-file or ${ADMIN_TOKEN_ENV}, else from STORE/admin-token (made once, kept "
                    "across restarts).")
    engines, address, *_ = add_flag_groups(parser, FLAGS, PROXY_GROUPS, _default_text)
    address.add_argument("--admin-token-file", metavar="FILE",
                         help=f"file holding the control-API token (default: ${ADMIN_TOKEN_ENV}, else "
                              "STORE/admin-token, made once with mode 0600 and kept across restarts)")
    address.add_argument("--rotate-admin-token", action="store_true",
                         help="replace STORE/admin-token with a fresh token (clients holding the old one get 401)")
    engines.add_argument("--engine-check", action=argparse.BooleanOptionalAction, default=True,
                         help="check at start that the engine can capture exactly (token ids, processed logprobs, "
                              "tool parser, context, token-in routes), and refuse it otherwise (default: on)")
    engines.add_argument("--engine-wait", type=float, default=300.0, metavar="SECONDS",
                         help="how long to wait for an engine that does not answer yet (default: 300)")
    parser.set_defaults(run=run)


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    """uvloop's `run` when installed (about half the proxy's per-request CPU), else asyncio's."""
    try:
        import uvloop
    except ImportError:
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
    """The admin token and where it came from. The store's own is made once (0600, where only its owner reads
    it) and kept, so clients holding it outlive a restart; `--rotate-admin-token` replaces it."""
    import secrets
    from pathlib import Path

    if args.admin_token_file or os.environ.get(ADMIN_TOKEN_ENV):
        if args.rotate_admin_token:
            raise ConfigError("--rotate-admin-token", f"rotates STORE/admin-token, but the token comes from "
                                                      f"--admin-token-file or ${ADMIN_TOKEN_ENV}: drop one of them")
        if args.admin_token_file:
            return Path(args.admin_token_file).read_text().strip(), args.admin_token_file
        return os.environ[ADMIN_TOKEN_ENV], f"${ADMIN_TOKEN_ENV}"
    path = Path(store) / "admin-token"
    kept = "" if args.rotate_admin_token or not path.exists() else path.read_text().strip()
    if kept:
        return kept, str(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(24)
    fresh = path.with_name(path.name + ".new")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")
    os.replace(fresh, path)  # whole or not at all: a crash never leaves an empty token
    return token, f"{path} (new)"


def _waiting(url: str, waited_s: float, wait_s: float) -> str:
    return f"waiting for the engine at {url}: {waited_s:.0f} of {wait_s:g} s"


async def _open_when_exact(running: RunningProxy, config: ProxyConfig, wait_s: float) -> None:
    """Wait for each engine to answer (saying so every WAIT_LINE_S, and in /health), refuse one that cannot
    capture exactly (`EngineNotExact`), then serve."""
    from harness_rl.tools.doctor import MIN_RUN_CONTEXT, diagnose

    for url in config.upstream:
        started, next_line = time.monotonic(), 0.0
        while True:
            report = await diagnose(url, model=config.upstream_model, min_context=MIN_RUN_CONTEXT, weight_sync="none")
            waited = time.monotonic() - started
            if report.answered or waited >= wait_s:
                break
            running.proxy.engine.waiting = _waiting(url, waited, wait_s)
            if waited >= next_line:
                print(f"harness-rl proxy on {running.url}, {running.proxy.engine.waiting}", flush=True)
                next_line += WAIT_LINE_S
            await asyncio.sleep(min(ASK_AGAIN_S, max(0.0, wait_s - waited)))
        report.require_exact()
    await running.proxy.engine.open()
    await running.proxy.pipeline.prompts.settle_source()


async def _unless_stopped(work: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run `work` to its end (True; its error raised), or until `stop` is set, which cancels it (False)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False
    task.result()
    return True


async def _serve(config: ProxyConfig, source: str, engine_check: bool, wait_s: float) -> None:
    """Listen at once; with `engine_check`, send no call until the engine answers and can capture exactly."""
    import gc
    import signal

    from proxy.server.app import start_proxy

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = await start_proxy(config, waiting=_waiting(config.upstream[0], 0, wait_s) if engine_check else None)
    try:
        if not engine_check or await _unless_stopped(_open_when_exact(running, config, wait_s), stop):
            gc.collect()
            gc.freeze()  # start-up objects (imports, recovered sessions) never need scanning again
            # Full collections scan every live turn; defer them (100x rarer) to the pauses of weight syncs,
            # where the proxy collects while agents are held (ProxyConfig.collect_on_pause).
            gen0, gen1, _ = gc.get_threshold()
            gc.set_threshold(gen0, gen1, 1000)
            sessions = len(running.proxy.registry.by_id)
            print(f"harness-rl proxy on {running.url} -> {', '.join(config.upstream)} (store {config.store_dir}, "
                  f"{sessions} sessions recovered; admin token from {source}, {running.admin_token[:4]}…)",
                  flush=True)
            if running.proxy.pipeline.prompts.said is not None:  # unsaid until the engine answers: at the first call
                print(f"harness-rl proxy: {running.proxy.pipeline.prompts.said}", flush=True)
            await stop.wait()
    finally:
        await running.stop()
    print("harness-rl proxy stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    import msgspec

    from harness_rl.flags import collect, flag_for_path
    from harness_rl.tools.doctor import EngineNotExact

    settings = {"port": DEFAULT_PORT, **collect(args, FLAGS)}
    try:
        config = msgspec.convert(settings, ProxyConfig)
        if not config.upstream:
            raise ConfigError("--upstream", "required: the engine's base URL (vLLM or `harness-rl serve engine`); "
                                            "repeat it for several engines")
        token, source = _admin_token(args, config.store_dir)
    except msgspec.ValidationError as exc:
        text, _, where = str(exc).partition(" - at `")
        flag = flag_for_path(FLAGS, where.rstrip("`")) if where else "--upstream"  # ProxyConfig's own checks
        print(f"harness-rl serve proxy: {flag}: {text}", file=sys.stderr)
        return 2
    except (ConfigError, OSError) as exc:
        print(f"harness-rl serve proxy: {exc}", file=sys.stderr)
        return 2
    config = msgspec.structs.replace(config, admin_token=token)
    _raise_open_file_limit()
    try:
        _event_loop_runner()(_serve(config, source, args.engine_check, args.engine_wait))
    except (EngineNotExact, OSError) as exc:
        print(f"harness-rl serve proxy: {exc}", file=sys.stderr)
        return 1
    return 0
