"""What the host (Python 3.11, owns the sandbox) and the runner (Python 3.12, runs Harbor's agent) say.

One JSON message per line over a Unix socket. The host sends the `RunSpec` first; the runner then
asks for sandbox work (`Exec`, `Put`, `Get`), each answered by the host with the same `id`, and ends
with `Finished`. Both sides run on this machine, so files cross as host paths, not bytes.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")
MAX_LINE = 64 << 20  # an exec's output can be long; the sandbox keeps its last 4 MiB per stream
REFUSAL = "harbor-refused:"  # `runner --check` prints this before Harbor's own error


class RunSpec(msgspec.Struct, kw_only=True, frozen=True):
    """One agent run: which Harbor agent, pointed where, on what, with its logs written where."""

    agent: str  # Harbor's AgentName value
    model_name: str  # "<provider>/<model>" as Harbor parses it
    base_url: str  # the proxy session's URL in the agent's dialect
    api_key: str  # the session key, handed over through `api_key_env`
    api_key_env: str
    api_format: str | None  # Harbor's ModelApiFormat value; None where the agent takes no override
    instruction: str
    logs_dir: str  # host directory for Harbor's agent logs and the ATIF trajectory
    agent_logs_dir: str  # where inside the sandbox the agent writes its logs (Harbor's /logs/agent)
    logs_mounted: bool = False  # `logs_dir` is `agent_logs_dir` itself (the local sandbox), nothing to download
    kwargs: dict[str, Any] = {}  # Harbor agent options (skip_install, version, ...)
    timeout_s: float | None = None


class Exec(msgspec.Struct, tag="exec", kw_only=True, frozen=True):
    id: int
    command: str
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout_s: float | None = None


class Put(msgspec.Struct, tag="put", kw_only=True, frozen=True):
    """Copy a host file or directory into the sandbox."""

    id: int
    source: str
    target: str


class Get(msgspec.Struct, tag="get", kw_only=True, frozen=True):
    """Copy a sandbox file or directory to the host."""

    id: int
    source: str
    target: str


class Outcome(msgspec.Struct, kw_only=True, frozen=True):
    """How Harbor's agent ended: its error (type and message as Harbor raised it), version, usage, trajectory."""

    error: str | None = None
    error_type: str | None = None
    phase: str = "run"  # setup | run | trajectory: where the error arose
    timed_out: bool = False
    version: str | None = None
    n_input_tokens: int | None = None
    n_output_tokens: int | None = None
    trajectory: str | None = None  # host path of the ATIF trajectory.json, when Harbor wrote one


class Finished(msgspec.Struct, tag="finished", kw_only=True, frozen=True):
    outcome: Outcome


class ExecDone(msgspec.Struct, tag="exec_done", kw_only=True, frozen=True):
    id: int
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False


class Done(msgspec.Struct, tag="done", kw_only=True, frozen=True):
    """A `Put` or `Get` finished; `error` says why not."""

    id: int
    error: str | None = None


Request = Exec | Put | Get | Finished
Reply = ExecDone | Done

_encoder = msgspec.json.Encoder()
SPECS = msgspec.json.Decoder(RunSpec)
REQUESTS = msgspec.json.Decoder(Request)
REPLIES = msgspec.json.Decoder(Reply)


async def send(writer: asyncio.StreamWriter, message: msgspec.Struct) -> None:
    writer.write(_encoder.encode(message) + b"\n")
    await writer.drain()


async def receive(reader: asyncio.StreamReader, decoder: msgspec.json.Decoder[T]) -> T | None:
    """The next message, or None at the end of the stream."""
    line = await reader.readline()
    if not line:
        return None
    return decoder.decode(line)
