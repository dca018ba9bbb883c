"""`<harbor-venv>/bin/python -m adapters.harbor_bridge.runner SOCKET`: one Harbor agent run, as Harbor's Trial runs it
(`... runner --check SPEC`: only build the agent, as preflight does).

Connects to the host's Unix socket, reads the `RunSpec`, builds Harbor's agent class for the named
agent with the endpoint override Harbor itself offers (`base_url`, `model_api_key_name`,
`model_api_format`, the key in `extra_env`), then does what `harbor.trial.Trial` does around an
agent: `setup` and `run` with the agent's env scoped onto every exec, the agent's logs brought back
from the sandbox, `populate_context_post_run` (which writes the ATIF trajectory for agents that
convert one). It ends by sending `Finished` with Harbor's own error, if any, verbatim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from adapters.harbor_bridge.environment import BridgedEnvironment, Channel
from adapters.harbor_bridge.protocol import MAX_LINE, REFUSAL, SPECS, Finished, Outcome, RunSpec, receive, send

log = logging.getLogger("harness_rl.harbor_bridge")


def build_agent(spec: RunSpec, logs_dir: Path) -> Any:
    """Harbor's agent for the spec, with Harbor's own endpoint override; Harbor validates options and connection."""
    from harbor.agents.factory import AgentFactory
    from harbor.models.agent.name import AgentName

    connection = {"base_url": spec.base_url, "model_api_key_name": spec.api_key_env}
    if spec.api_format is not None:
        connection["model_api_format"] = spec.api_format
    return AgentFactory.create_agent_from_name(
        AgentName(spec.agent), logs_dir=logs_dir, model_name=spec.model_name,
        extra_env={spec.api_key_env: spec.api_key}, **connection, **spec.kwargs)


async def run_agent(spec: RunSpec, channel: Channel, scratch: Path) -> Outcome:
    from harbor.agents.installed.base import BaseInstalledAgent
    from harbor.models.agent.context import AgentContext

    logs_dir = Path(spec.logs_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    phase = "setup"
    try:
        agent = build_agent(spec, logs_dir)
        environment = BridgedEnvironment(channel, scratch, logger=log)
        context = AgentContext()
        with environment.scoped_exec_env(agent.extra_env):
            await agent.setup(environment=environment)
            phase = "run"
            try:
                await asyncio.wait_for(agent.run(spec.instruction, environment, context), spec.timeout_s)
            finally:
                if isinstance(agent, BaseInstalledAgent) and not spec.logs_mounted:  # terminus-2 logs on the host
                    with contextlib.suppress(FileNotFoundError):
                        await environment.download_dir(spec.agent_logs_dir, logs_dir)
        phase = "trajectory"
        log.info("Harbor's %s ran; its context holds %s", spec.agent, sorted(context.model_dump(exclude_none=True)))
        if context.is_empty():
            agent.populate_context_post_run(context)
    except TimeoutError:
        return Outcome(error=f"the agent ran past its {spec.timeout_s} s limit", error_type="TimeoutError",
                       phase=phase, timed_out=True, trajectory=_trajectory(logs_dir))
    except Exception as error:  # Harbor's own error is the answer, whatever its type
        log.exception("Harbor's %s failed in %s", spec.agent, phase)
        return Outcome(error=str(error), error_type=type(error).__name__, phase=phase,
                       trajectory=_trajectory(logs_dir))
    return Outcome(version=agent.version(), n_input_tokens=context.n_input_tokens,
                   n_output_tokens=context.n_output_tokens, trajectory=_trajectory(logs_dir))


def _trajectory(logs_dir: Path) -> str | None:
    path = logs_dir / "trajectory.json"
    return str(path) if path.is_file() else None


async def main(socket_path: str) -> None:
    logging.basicConfig(level=os.environ.get("HARNESS_RL_HARBOR_LOG", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    reader, writer = await asyncio.open_unix_connection(socket_path, limit=MAX_LINE)
    spec = await receive(reader, SPECS)
    if spec is None:
        raise SystemExit("the host closed the bridge before sending the run")
    channel = Channel(reader, writer)
    with tempfile.TemporaryDirectory(prefix="harness-rl-harbor-") as scratch:
        outcome = await run_agent(spec, channel, Path(scratch))
    await send(writer, Finished(outcome=outcome))
    writer.close()


def check(spec_json: str) -> None:
    """`--check SPEC`: build the agent as a run would, and exit 1 with Harbor's own error if Harbor refuses it."""
    spec = SPECS.decode(spec_json)
    with tempfile.TemporaryDirectory(prefix="harness-rl-harbor-check-") as logs_dir:
        try:
            build_agent(spec, Path(logs_dir))
        except Exception as error:
            print(f"{REFUSAL} {type(error).__name__}: {error}", file=sys.stderr)
            raise SystemExit(1) from None


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        check(sys.argv[2])
    else:
        asyncio.run(main(sys.argv[1]))
