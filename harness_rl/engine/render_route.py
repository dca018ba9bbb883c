"""`POST /v1/chat/completions/render`: a chat body → the `/inference/v1/generate` request it implies.

Shaped as vLLM 0.32 answers it (`GenerateRequest`): the prompt ids the chat route would sample from
and the chat body's sampling as vLLM `SamplingParams` (`max_tokens` = the room left when the body
sets none; `logprobs` = `top_logprobs` when the body asks for logprobs; `skip_special_tokens: false`
when tools are parsed, as vLLM's hermes parser adjusts it). The answer can be posted to generate as
is, with vLLM's own pitfall: `max_tokens: 16` is its default, so it is left out, and generate then
runs to the end of the context: a caller should always set `max_tokens` itself.
"""

from typing import Any

from aiohttp import web

from harness_rl.engine.chat_request import PreparedChat, prepare_chat
from harness_rl.engine.protocol import ChatCompletionRequest, decode_body
from harness_rl.engine.server_context import CONTEXT
from harness_rl.engine.token_protocol import short_id

# vLLM writes `SamplingParams` leaving out fields at their default; its `max_tokens` default is 16, so a
# body asking for exactly 16 renders without `max_tokens`, and generate then fills the room left.
VLLM_DEFAULT_MAX_TOKENS = 16
# vLLM's RequestOutputKind: what generate streams (DELTA) or answers once (FINAL_ONLY).
OUTPUT_KIND_DELTA = 1
OUTPUT_KIND_FINAL_ONLY = 2


def vllm_sampling(body: ChatCompletionRequest, chat: PreparedChat) -> dict[str, Any]:
    """The `sampling_params` vLLM writes for this chat body, key for key (defaults it omits, omitted)."""
    params = chat.params
    fields: dict[str, Any] = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": params.temperature,
    }
    if not params.greedy:  # vLLM resets (and then omits) the filters of a greedy request
        fields["top_p"] = params.top_p
        if body.top_k:  # as given: -1 stays -1
            fields["top_k"] = body.top_k
        fields["min_p"] = 0.0
    if params.seed is not None:
        fields["seed"] = params.seed
    fields["stop"] = list(params.stop)
    fields["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        fields["ignore_eos"] = True
    if params.max_tokens != VLLM_DEFAULT_MAX_TOKENS:
        fields["max_tokens"] = params.max_tokens
    if params.logprobs is not None:
        fields["logprobs"] = params.logprobs
    if params.prompt_logprobs is not None:
        fields["prompt_logprobs"] = params.prompt_logprobs
    if chat.parse_tools:
        fields["skip_special_tokens"] = False
    fields["output_kind"] = OUTPUT_KIND_DELTA if body.stream else OUTPUT_KIND_FINAL_ONLY
    fields.update(skip_clone=True, bad_words=[], skip_reading_prefix_cache=params.prompt_logprobs is not None)
    return fields


async def render_chat_completion(request: web.Request) -> web.Response:
    engine = request.app[CONTEXT].engine
    body = decode_body(await request.read(), ChatCompletionRequest)
    chat = await prepare_chat(engine, body)
    stream = bool(body.stream)
    options = body.stream_options
    return web.json_response(
        {
            "request_id": f"chatcmpl-{short_id()}",
            "token_ids": chat.prompt_ids,
            "token_offsets": None,
            "features": None,
            "content_parts": None,
            "sampling_params": vllm_sampling(body, chat),
            "model": body.model,
            "reasoning_ended": None,
            "reasoning_parser_kwargs": None,
            "return_token_ids": None,
            "output_mode": "tokens",
            "stream": stream,
            "stream_options": (
                {"include_usage": options.include_usage, "continuous_usage_stats": options.continuous_usage_stats}
                if stream and options is not None
                else None
            ),
            "cache_salt": None,
            "priority": 0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
        }
    )
