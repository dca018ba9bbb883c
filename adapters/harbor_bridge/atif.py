"""The part of Harbor's ATIF trajectory (`trajectory.json`) harness-rl reads: each step's source, text and tool calls.

Read on the host (Python 3.11, no Harbor), for the run's tool-call counts and final text, and for
cross-checking a capture: every model call Harbor's trajectory records is a step from the agent.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import msgspec


class AtifToolCall(msgspec.Struct, kw_only=True):
    function_name: str
    arguments: dict[str, Any] = {}


class AtifStep(msgspec.Struct, kw_only=True):
    source: str  # system | user | agent
    message: str | list[dict[str, Any]] = ""
    tool_calls: list[AtifToolCall] | None = None
    is_copied_context: bool | None = None

    @property
    def text(self) -> str:
        """The step's message as plain text (the text parts of a multimodal message)."""
        if isinstance(self.message, str):
            return self.message
        return "".join(str(part.get("text", "")) for part in self.message if part.get("type") == "text")


class AtifTrajectory(msgspec.Struct, kw_only=True):
    schema_version: str = ""
    steps: list[AtifStep] = []

    @property
    def model_calls(self) -> list[AtifStep]:
        """The agent's own steps, one per model call (context copied from an earlier trajectory left out)."""
        return [step for step in self.steps if step.source == "agent" and not step.is_copied_context]

    def tool_calls_by_name(self) -> dict[str, int]:
        return dict(Counter(call.function_name for step in self.model_calls for call in step.tool_calls or ()))

    def final_text(self) -> str:
        calls = self.model_calls
        return calls[-1].text.strip() if calls else ""


def read_trajectory(path: str | Path) -> AtifTrajectory:
    return msgspec.json.decode(Path(path).read_bytes(), type=AtifTrajectory)
