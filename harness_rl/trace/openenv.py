"""OpenEnv interop: our turns in the exact JSON shape of OpenEnv's `TrainingTrace`
(`openenv.core.harness.training`, openenv 0.10) and back, so traces move both ways between harness-rl
and TRL/OpenEnv.
"""

from __future__ import annotations

from typing import Any

import msgspec

from harness_rl.trace.turn import (
    OPENENV_SCHEMA_VERSION,
    Reply,
    Request,
    Sampling,
    ToolCall,
    TraceFormatError,
    Turn,
    TurnRecord,
    longest_prefix_parents,
    record_of,
)

OPENENV_DEFAULT_ID = "openenv"
OPENENV_TURN_KEYS = ("node_id", "prompt_token_ids", "completion_token_ids", "per_token_logps",
                     "loss_mask", "request", "response", "metadata")
OPENENV_META_KEY = "harness_rl"


class _HarnessRlExtra(TurnRecord, kw_only=True, omit_defaults=True):
    """Our fields that OpenEnv has no place for, carried in `metadata["harness_rl"]`: the turn's record and
    its place in the capture graph."""

    rollout_id: str | None = None
    parent_id: str | None = None
    role: str = "agent"
    completion_mask: list[int] | None = None  # the real mask of a turn exported untrainable


def openai_message(reply: Reply) -> dict[str, Any]:
    """A reply as an OpenAI chat assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        message["reasoning"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]
    return message


def _reply_from_openai(response: dict[str, Any]) -> Reply | None:
    """A `Reply` from an OpenAI-shaped response dict, or None when it holds no assistant message."""
    choices = response.get("choices") if isinstance(response, dict) else None
    message = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
        else None
    if not isinstance(message, dict):
        return None
    calls = [ToolCall(id=str(c.get("id", "")), name=str((c.get("function") or {}).get("name", "")),
                      arguments=str((c.get("function") or {}).get("arguments", "")))
             for c in message.get("tool_calls") or () if isinstance(c, dict)]
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    return Reply(content=message.get("content"), reasoning=reasoning, tool_calls=calls)


def to_openenv(rollout_id: str, turns: list[Turn]) -> dict[str, Any]:
    """OpenEnv's exact `TrainingTrace` JSON shape.

    Our extra fields travel under `metadata["harness_rl"]`. Auxiliary and discarded turns are kept
    for context with an all-zero mask (so an OpenEnv consumer never trains them); their own
    completion mask is kept in the namespace so `from_openenv` restores it exactly.
    """
    exported = []
    for turn in turns:
        extra = _HarnessRlExtra(**record_of(turn), rollout_id=rollout_id, parent_id=turn.parent_id, role=turn.role)
        mask = turn.loss_mask
        if turn.role != "agent":
            extra.completion_mask = turn.completion_mask
            mask = [0] * len(mask)
        response: dict[str, Any] = {}
        if turn.reply is not None:
            response = {"choices": [{"index": 0, "message": openai_message(turn.reply),
                                     "finish_reason": turn.finish_reason}]}
        exported.append({
            "node_id": turn.node_id,
            "prompt_token_ids": list(turn.prompt_token_ids),
            "completion_token_ids": list(turn.completion_token_ids),
            "per_token_logps": [float(x) for x in turn.per_token_logps],
            "loss_mask": list(mask),
            "request": msgspec.to_builtins(turn.request),
            "response": response,
            "metadata": {**turn.metadata, OPENENV_META_KEY: msgspec.to_builtins(extra)},
        })
    return {"schema_version": OPENENV_SCHEMA_VERSION, "turns": exported}


def from_openenv(data: dict[str, Any], rollout_id: str = OPENENV_DEFAULT_ID) -> tuple[str, list[Turn]]:
    """Read OpenEnv's `TrainingTrace` JSON (as a dict, or a pydantic model's `model_dump()`): its rollout id
    (ours, when the trace was exported by us; else `rollout_id`) and its turns.

    Fields we added come back from `metadata["harness_rl"]` when present. A trace made by OpenEnv
    itself has none, so parents are rebuilt by longest exact token prefix, every turn is `agent`,
    policy versions stay unknown, and the reply and sampling are read from its OpenAI-shaped
    `response` and its `sampling_params` metadata.
    """
    if not isinstance(data, dict) or "turns" not in data:
        raise TraceFormatError("not an OpenEnv TrainingTrace: expected an object with 'turns'")
    if data.get("schema_version") != OPENENV_SCHEMA_VERSION:
        raise TraceFormatError(f"unsupported OpenEnv schema_version {data.get('schema_version')!r}")
    turns: list[Turn] = []
    any_extra = False
    for i, raw in enumerate(data["turns"]):
        missing = [k for k in OPENENV_TURN_KEYS if k not in raw]
        if missing:
            raise TraceFormatError(f"OpenEnv turn {i} lacks {', '.join(missing)}")
        metadata = dict(raw["metadata"])
        try:
            extra = msgspec.convert(metadata.pop(OPENENV_META_KEY, None) or {}, _HarnessRlExtra)
            request = msgspec.convert(raw["request"] or {}, Request)
        except msgspec.ValidationError as exc:
            raise TraceFormatError(f"OpenEnv turn {i}: {exc}") from None
        any_extra = any_extra or extra.rollout_id is not None
        rollout_id = extra.rollout_id or rollout_id
        mask = list(raw["loss_mask"])
        if extra.completion_mask is not None:
            mask = mask[:len(raw["prompt_token_ids"])] + list(extra.completion_mask)
        reply = _reply_from_openai(raw["response"])
        record = record_of(extra)
        if extra.rollout_id is None:
            choices = raw["response"].get("choices") if isinstance(raw["response"], dict) else None
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                record["finish_reason"] = choices[0].get("finish_reason")
            record["sampling"] = _openenv_sampling(metadata)
        turns.append(Turn(
            **record, node_id=raw["node_id"], parent_id=extra.parent_id, role=extra.role,  # type: ignore[arg-type]
            prompt_token_ids=list(raw["prompt_token_ids"]),
            completion_token_ids=list(raw["completion_token_ids"]),
            per_token_logps=list(raw["per_token_logps"]), loss_mask=mask, request=request, reply=reply,
            metadata=metadata,
        ))
    if not any_extra:
        for turn, parent_id in zip(turns, longest_prefix_parents(turns), strict=True):
            turn.parent_id = parent_id
    return rollout_id, turns


def _openenv_sampling(metadata: dict[str, Any]) -> Sampling | None:
    """OpenEnv's `sampling_params` / `requested_sampling_params` metadata as a `Sampling`, when present."""
    applied = metadata.get("sampling_params")
    if not isinstance(applied, dict):
        return None
    requested = metadata.get("requested_sampling_params")
    temperature = applied.get("temperature")
    max_tokens = applied.get("max_tokens")
    return Sampling(temperature=float(temperature) if isinstance(temperature, int | float) else None,
                    max_tokens=max_tokens if type(max_tokens) is int else None,
                    requested=requested if isinstance(requested, dict) else {})
