"""Harbor's `BaseEnvironment` over a harness-rl sandbox: every call travels to the host that owns it.

Runs in the runner (Python >= 3.12, Harbor installed). The sandbox itself (local, bubblewrap, e2b,
or one of Harbor's own environments driven from the host) was started by the rollout and is
stopped by it, so `start` and `stop` do nothing here. Commands run as the sandbox's own user:
Harbor's `user` argument (root for system packages, the task's agent user otherwise) is not
honoured, which is why the bridge installs agents beforehand instead of letting Harbor `apt-get`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from adapters.harbor_bridge.protocol import REPLIES, Done, Exec, ExecDone, Get, Put, Reply, receive, send

ENVIRONMENT_TYPE = "harness-rl"


class Channel:
    """Requests to the host, answered by id; several may be in flight (Harbor agents exec concurrently)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        self._lock = asyncio.Lock()
        self._listener = asyncio.create_task(self._listen())

    def next_id(self) -> int:
        return next(self._ids)

    async def call(self, request: Exec | Put | Get) -> Reply:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[request.id] = future
        async with self._lock:
            await send(self.writer, request)
        return await future

    async def _listen(self) -> None:
        while (reply := await receive(self.reader, REPLIES)) is not None:
            future = self._waiting.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result(reply)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ConnectionError("the harness-rl host closed the bridge"))


class BridgedEnvironment(BaseEnvironment):
    """The rollout's sandbox, as Harbor's agents expect an environment to behave."""

    def __init__(self, channel: Channel, scratch: Path, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._channel = channel
        (scratch / "environment").mkdir(parents=True, exist_ok=True)
        super().__init__(environment_dir=scratch / "environment", environment_name=ENVIRONMENT_TYPE,
                         session_id=ENVIRONMENT_TYPE, trial_paths=TrialPaths(trial_dir=scratch / "trial"),
                         task_env_config=EnvironmentConfig(), logger=logger, **kwargs)

    @staticmethod
    def type() -> str:
        return ENVIRONMENT_TYPE

    def _validate_definition(self) -> None:
        """The sandbox was built from the task by harness-rl; there is no definition to check here."""

    async def start(self, force_build: bool) -> None:
        return None

    async def stop(self, delete: bool) -> None:
        return None

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        request = Exec(id=self._channel.next_id(), command=command, cwd=cwd, env=self._merge_env(env),
                       timeout_s=None if timeout_sec is None else float(timeout_sec))
        reply = await self._channel.call(request)
        if not isinstance(reply, ExecDone):
            raise RuntimeError(f"the host answered an exec with {type(reply).__name__}")
        if reply.timed_out:  # as Harbor's docker environment reports it
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=reply.stdout, stderr=reply.stderr,
                          return_code=-1 if reply.exit_code is None else reply.exit_code)

    async def _transfer(self, request: Put | Get) -> None:
        reply = await self._channel.call(request)
        if not isinstance(reply, Done):
            raise RuntimeError(f"the host answered a transfer with {type(reply).__name__}")
        if reply.error is not None:
            raise FileNotFoundError(reply.error) if "does not exist" in reply.error else RuntimeError(reply.error)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._transfer(Put(id=self._channel.next_id(), source=str(Path(source_path).resolve()),
                                 target=target_path))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._transfer(Put(id=self._channel.next_id(), source=str(Path(source_dir).resolve()),
                                 target=target_dir))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self._transfer(Get(id=self._channel.next_id(), source=source_path,
                                 target=str(Path(target_path).resolve())))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._transfer(Get(id=self._channel.next_id(), source=source_dir,
                                 target=str(Path(target_dir).resolve())))
