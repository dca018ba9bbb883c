"""The host side of the bridge: answer a runner's sandbox requests on the rollout's own sandbox.

Each request is served in its own task (Harbor agents exec concurrently, terminus-2 polls its tmux
pane while a command runs), and answered with its id; the conversation ends with the runner's
`Finished`, whose outcome is returned. A request that fails is answered with the failure, so the
runner raises it where Harbor's agent made the call.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from adapters.harbor_bridge.protocol import (
    REQUESTS,
    Done,
    Exec,
    ExecDone,
    Finished,
    Get,
    Outcome,
    Put,
    receive,
    send,
)
from adapters.sandboxes.base import Sandbox


class RunnerGone(ConnectionError):
    """The runner closed the socket without saying how the agent ended (it crashed or was killed)."""


async def serve_runner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sandbox: Sandbox,
                       env: dict[str, str]) -> Outcome:
    """Serve one runner until it finishes; `env` goes under every command's own environment."""
    lock = asyncio.Lock()
    pending: set[asyncio.Task[None]] = set()

    async def answer(request: Exec | Put | Get) -> None:
        reply: ExecDone | Done
        if isinstance(request, Exec):
            result = await sandbox.exec(request.command, env={**env, **(request.env or {})},
                                        timeout=request.timeout_s, cwd=request.cwd)
            reply = ExecDone(id=request.id, exit_code=result.exit_code, stdout=result.stdout, stderr=result.stderr,
                             timed_out=result.timed_out)
        else:
            try:
                if isinstance(request, Put):
                    await sandbox.upload(Path(request.source), request.target)
                else:
                    await sandbox.download(request.source, Path(request.target))
                reply = Done(id=request.id)
            except (OSError, RuntimeError) as error:
                reply = Done(id=request.id, error=str(error))
        async with lock:
            await send(writer, reply)

    try:
        while (request := await receive(reader, REQUESTS)) is not None:
            if isinstance(request, Finished):
                return request.outcome
            task = asyncio.create_task(answer(request))
            pending.add(task)
            task.add_done_callback(pending.discard)
        raise RunnerGone("the Harbor runner exited without reporting how the agent ended")
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
