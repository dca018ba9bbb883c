"""Bodies of vLLM 0.32's token-in routes (`/inference/v1/generate`, `/v1/chat/completions/derender`),
decoded once at the edge with msgspec. Unknown fields are ignored, as vLLM ignores them."""

import uuid
from typing import Any, Literal

import msgspec

from harness_rl.engine.protocol import ChatCompletionRequest, StreamOptions


def short_id() -> str:
    """vLLM's `random_uuid()`: 16 hex digits."""
    return uuid.uuid4().hex[:16]


class GenerateSampling(msgspec.Struct, kw_only=True):
    """vLLM `SamplingParams` fields. `max_tokens` absent or null means the room left in the context;
    the knobs this engine cannot honour must keep their neutral values (see `request_params`)."""

    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    include_stop_str_in_output: bool = False
    detokenize: bool = True


class GenerateBody(msgspec.Struct, kw_only=True):
    """`POST /inference/v1/generate` (vLLM's `GenerateRequest`; `render` answers exactly this)."""

    token_ids: list[int] | None = None  # required: checked with vLLM's wording
    sampling_params: GenerateSampling | None = None  # required: checked with vLLM's wording
    model: str | None = None
    request_id: str = msgspec.field(default_factory=short_id)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None


class AbortBody(msgspec.Struct, kw_only=True):
    """`POST /inference/v1/abort_requests`: the `request_id`s generate answered with."""

    request_ids: list[str]


class TokenLogprob(msgspec.Struct, kw_only=True):
    token_id: int
    logprob: float
    rank: int | None = None


class SampledLogprob(TokenLogprob, kw_only=True):
    top_logprobs: list[TokenLogprob] = []


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[SampledLogprob] | None = None


class GeneratedChoice(msgspec.Struct, kw_only=True):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    logprobs: ChoiceLogprobs | None = None


class GeneratedReply(msgspec.Struct, kw_only=True):
    """A generate answer as derender takes it back: only the `output_mode: tokens` form."""

    choices: list[GeneratedChoice]
    request_id: str = msgspec.field(default_factory=short_id)
    output_mode: Literal["tokens"] = "tokens"
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class ChunkUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class StreamedChoice(msgspec.Struct, kw_only=True):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class GeneratedChunk(msgspec.Struct, kw_only=True):
    """One streamed generate chunk as the streaming derender takes it (vLLM's `GenerateTokensStreamResponse`)."""

    choices: list[StreamedChoice]
    request_id: str = msgspec.field(default_factory=short_id)
    usage: ChunkUsage | None = None


class StreamState(msgspec.Struct, kw_only=True):
    """vLLM's `DerenderStreamState` on the parser path: every output id so far and each call's share of them
    (a read replays them), whether the role and tool calls went out, and the ids those calls were given. The
    detokenizer fields are carried as vLLM carries them (the parser path re-decodes from the prompt)."""

    prev_tokens: list[str] = []
    prefix_offset: int = 0
    read_offset: int = 0
    role_sent: bool = False
    logprob_context_token_ids: list[int] = []
    logprob_text_offset: int = 0
    output_token_ids: list[int] = []
    output_chunk_lens: list[int] = []
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = []


class DerenderBody(msgspec.Struct, kw_only=True):
    """`POST /v1/chat/completions/derender`: sampled ids (`generate_response`) → a chat completion, or, with
    `stream: true`, one generate chunk and the state the last call returned → one chat completion chunk."""

    generate_response: GeneratedReply | None = None  # required unless streaming
    generate_chunk: GeneratedChunk | None = None  # required when streaming
    stream_state: StreamState | None = None
    chat_request: ChatCompletionRequest | None = None
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = None
    model: str | None = None
    stream: bool = False
