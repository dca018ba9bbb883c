"""Which tools the agent called and which of their results failed, read from a trace by TRL's rules.

Calls: the tool calls in the replies of the agent's turns (TRL's `_tool_call_counts_by_name`).
Failures: tool results (`tool` messages) whose text mentions `error`, `failed`, `traceback` or
`exception` (any case), the same tool and first 200 characters counted once (TRL's
`_tool_failures_by_name`). TRL reads the last request only; a rollout with a subagent or a compaction
holds its tool results in several conversations, so every agent request is read, and the same rule
of counting a tool and its first 200 characters once keeps a result that every later request repeats
from counting twice. A result's tool is its `name`, else that of the call its `tool_call_id` answers.
"""

from __future__ import annotations

from typing import Any

import msgspec

from harness_rl.trace.training_trace import TrainingTrace

FAILURE_WORDS = ("error", "failed", "traceback", "exception")
DEDUP_CHARS = 200


class ToolUsage(msgspec.Struct, kw_only=True, frozen=True):
    calls_by_name: dict[str, int] = {}
    failures_by_name: dict[str, int] = {}

    @property
    def call_count(self) -> int:
        return sum(self.calls_by_name.values())

    @property
    def failure_count(self) -> int:
        return sum(self.failures_by_name.values())


def tool_usage(trace: TrainingTrace) -> ToolUsage:
    """Tool calls and failed tool results by tool name, over the trace's agent turns."""
    calls: dict[str, int] = {}
    failures: dict[str, int] = {}
    seen: set[tuple[str | None, str]] = set()
    for turn in trace.turns:
        if turn.role != "agent":
            continue
        for call in turn.reply.tool_calls if turn.reply is not None else ():
            if call.name:
                calls[call.name] = calls.get(call.name, 0) + 1
        messages = turn.request.messages or []
        names = {call.get("id"): (call.get("function") or call).get("name")
                 for message in messages if message.get("role") == "assistant"
                 for call in message.get("tool_calls") or () if isinstance(call, dict)}
        for message in messages:
            if message.get("role") != "tool":
                continue
            name = message.get("name") or names.get(message.get("tool_call_id"))
            text = _text(message.get("content"))
            key = (name, text[:DEDUP_CHARS])
            if key in seen:
                continue
            seen.add(key)
            if any(word in text.lower() for word in FAILURE_WORDS):
                failures[str(name)] = failures.get(str(name), 0) + 1
    return ToolUsage(calls_by_name=calls, failures_by_name=failures)


def _text(content: Any) -> str:
    """A message's text: the string, or its text parts joined (as TRL's `str(content)` reads a string)."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)
