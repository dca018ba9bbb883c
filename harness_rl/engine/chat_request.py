"""A chat body → its prompt ids and sampling, one code path for the chat, render and derender routes,
so `/v1/chat/completions/render` gives exactly the ids and sampling `/v1/chat/completions` uses."""

import asyncio
from dataclasses import dataclass

from harness_rl.engine.chat_render import render_chat
from harness_rl.engine.engine import Engine
from harness_rl.engine.errors import ApiError
from harness_rl.engine.protocol import ChatCompletionRequest
from harness_rl.engine.request_params import check_model, sampling_params
from harness_rl.engine.sampling import SamplingParams


def parses_tools(body: ChatCompletionRequest) -> bool:
    """Tool calls are parsed for `tool_choice` auto (the default with tools), never for none."""
    if not body.tools:
        return False
    choice = body.tool_choice or "auto"
    if choice == "auto":
        return True
    if choice == "none":
        return False
    raise ApiError(400, f"tool_choice {choice!r} is not supported (only 'auto' and 'none').", param="tool_choice")


@dataclass(frozen=True)
class PreparedChat:
    """What a chat body asks the engine for: prompt ids, sampling, tool parsing, top logprobs."""

    prompt_ids: list[int]
    params: SamplingParams
    parse_tools: bool
    top_logprobs: int


async def prepare_chat(engine: Engine, body: ChatCompletionRequest) -> PreparedChat:
    """Validate `body` and render its messages with the engine's template (400/404 as vLLM)."""
    check_model(body.model, engine.served_model_name)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(
            400, "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)", "top_logprobs"
        )
    parse_tools = parses_tools(body)
    prompt_ids = await asyncio.to_thread(
        render_chat,
        engine.tokenizer,
        body.messages,
        tools=body.tools,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    top = (body.top_logprobs or 0) if body.logprobs else 0
    params = sampling_params(
        body,
        stream=bool(body.stream),
        prompt_len=len(prompt_ids),
        max_model_len=engine.max_model_len,
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        default_max_tokens=None,
        logprobs=top if body.logprobs else None,
    )
    return PreparedChat(prompt_ids, params, parse_tools, top)
