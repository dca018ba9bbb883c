"""The engine's token-in routes as typed Structs, decoded once at the edge (vLLM 0.32's shapes).

`/v1/chat/completions/render` turns messages into prompt ids, `/inference/v1/generate` samples from
ids (whole, or streamed step by step), `/v1/chat/completions/derender` turns sampled ids into a chat
message with the server's own tool and reasoning parsers (whole, or step by step with a carried state).
The embedded engine answers the same shapes.
"""

from __future__ import annotations

from typing import Any

import msgspec

NULL = msgspec.Raw(b"null")


class RenderReply(msgspec.Struct):
    """Prompt ids stay raw JSON: the capture graph uses their text as is (see proxy.tokens)."""

    token_ids: msgspec.Raw = NULL


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What `generate` samples with. The capture fields have no defaults, so they are always written."""

    logprobs: int  # 0: the sampled token's logprob only
    skip_special_tokens: bool  # False: tool-call markup must survive into derender
    temperature: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] | None = None

    @classmethod
    def capturing(cls, **knobs: Any) -> SamplingParams:
        return cls(logprobs=0, skip_special_tokens=False, **knobs)


class StreamOptions(msgspec.Struct):
    include_usage: bool


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    token_ids: msgspec.Raw  # the prompt's ids as a JSON array, spliced as bytes
    sampling_params: SamplingParams
    model: str | None = None
    stream: bool = False  # True: SSE, one `GenerateChunk` per engine step
    stream_options: StreamOptions | None = None


class SampledLogprob(msgspec.Struct):
    token_id: int
    logprob: float


class ChoiceLogprobs(msgspec.Struct):
    content: list[SampledLogprob] | None = None


class WeightVersionSpan(msgspec.Struct):
    version: str
    start: int
    end: int


class GeneratedChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class GenerateReply(msgspec.Struct):
    choices: list[GeneratedChoice]
    request_id: str = ""
    usage: Usage | None = None


class GenerateChunk(msgspec.Struct):
    """One SSE event of a streamed generate: a step's new ids and their logprobs (the last choice chunk says why
    it ended and carries the weight versions of the whole output), or the closing usage (`choices` empty)."""

    choices: list[GeneratedChoice] = []
    usage: Usage | None = None
    request_id: str = ""
    error: StreamError | None = None  # the engine failed mid-stream


class StreamError(msgspec.Struct):
    message: str = ""


class DerenderChoice(msgspec.Struct):
    token_ids: list[int]
    finish_reason: str | None = None
    index: int = 0


class GenerateResponse(msgspec.Struct):
    choices: list[DerenderChoice]


class DerenderRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    generate_response: GenerateResponse
    chat_request: msgspec.Raw  # the chat body the parsers need (its messages and tools, already encoded)
    prompt_tokens: int = 0
    prompt_token_ids: msgspec.Raw | None = None  # the prompt's last ids: the engine seeds its detokenizer with them
    model: str | None = None


class DerenderStreamRequest(msgspec.Struct, kw_only=True):
    """One step of vLLM's streaming derender: new ids (as one generate chunk) and the state the last step returned."""

    stream: bool = True
    generate_chunk: GenerateResponse
    stream_state: msgspec.Raw  # opaque: what the engine answered last time (null at first)
    chat_request: msgspec.Raw
    prompt_token_ids: msgspec.Raw  # the whole prompt (the parsers read it to know whether reasoning is open)
    prompt_tokens: int
    model: str | None = None


class FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct):
    """A piece of a streamed tool call: its id and name once, its arguments in fragments to concatenate."""

    index: int = 0
    id: str | None = None
    function: FunctionDelta | None = None


class TextDelta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class DeltaChoice(msgspec.Struct):
    delta: TextDelta = msgspec.field(default_factory=TextDelta)


class DerenderedChunk(msgspec.Struct):
    choices: list[DeltaChoice] = []


class DerenderStreamReply(msgspec.Struct):
    chunk: DerenderedChunk
    stream_state: msgspec.Raw


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = ""


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def reasoning_text(self) -> str | None:
        return self.reasoning or self.reasoning_content


class DerenderedChoice(msgspec.Struct):
    message: AssistantMessage
    finish_reason: str | None = None


class DerenderReply(msgspec.Struct):
    choices: list[DerenderedChoice]


class ModelCard(msgspec.Struct):
    """One served model; vLLM says its context size, the embedded engine also its vocabulary size."""

    id: str = ""
    max_model_len: int | None = None
    vocab_size: int | None = None
    root: str | None = None  # vLLM: the model's path (where its tokenizer and chat template are)


class ModelList(msgspec.Struct):
    data: list[ModelCard] = []


RENDER_DECODER = msgspec.json.Decoder(RenderReply)
GENERATE_DECODER = msgspec.json.Decoder(GenerateReply)
DERENDER_DECODER = msgspec.json.Decoder(DerenderReply)
CHUNK_DECODER = msgspec.json.Decoder(GenerateChunk)
DERENDER_STREAM_DECODER = msgspec.json.Decoder(DerenderStreamReply)
MODELS_DECODER = msgspec.json.Decoder(ModelList)
