"""Chat messages → prompt token ids, as vLLM renders them (template text, then encode without
special tokens; assistant tool-call arguments are parsed from JSON first, anything but a JSON object
becoming `{}`, as vLLM 0.32 does)."""

import json
from typing import Any

from harness_rl.engine.errors import ApiError


def _normalise(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        function["arguments"] = _arguments(function.get("arguments"))
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _arguments(arguments: Any) -> Any:
    """A JSON object, as vLLM 0.32 hands arguments to the template: parsed from their text; missing, empty, not
    JSON or not an object, an empty object (vLLM keeps the conversation going rather than fail every turn)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else None
    except json.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {}


def _normalise_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as vLLM 0.32 hands it to the template: `description` and `parameters` always present
    (null when absent), `strict` only when given, other keys dropped."""
    function = tool.get("function") or {}
    shaped = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        shaped["strict"] = function["strict"]
    return {"type": tool.get("type", "function"), "function": shaped}


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt ids for `messages` (400 on messages the template cannot render)."""
    if not messages:
        raise ApiError(400, "Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true.")
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{index}] has no `role`.", param="messages")
    try:
        text = tokenizer.apply_chat_template(
            [_normalise(m) for m in messages],
            tools=[_normalise_tool(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except Exception as error:  # template errors are the caller's messages being malformed
        raise ApiError(400, f"Could not render the chat template: {error}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)
