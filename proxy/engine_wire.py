"""The engine's chat reply as typed Structs, decoded once at the edge (vLLM's shapes, reference/vllm.md §2)."""

from __future__ import annotations

import msgspec


class SampledLogprob(msgspec.Struct):
    token: str
    logprob: float


class ChoiceLogprobs(msgspec.Struct):
    content: list[SampledLogprob] | None = None


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


class Choice(msgspec.Struct):
    message: AssistantMessage
    index: int = 0
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int | None = None


NULL = msgspec.Raw(b"null")


class ChatReply(msgspec.Struct):
    """The prompt ids stay raw JSON: the capture graph uses their text as is (see proxy.capture)."""

    choices: list[Choice]
    id: str = ""
    model: str = ""
    created: int = 0
    usage: Usage | None = None
    prompt_token_ids: msgspec.Raw = NULL


class TokenizeReply(msgspec.Struct):
    count: int
    tokens: list[int] = []


class ModelCard(msgspec.Struct):
    """One served model; vLLM says its context size, the embedded engine also its vocabulary size."""

    id: str = ""
    max_model_len: int | None = None
    vocab_size: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard] = []


CHAT_REPLY_DECODER = msgspec.json.Decoder(ChatReply)
TOKENIZE_DECODER = msgspec.json.Decoder(TokenizeReply)
MODELS_DECODER = msgspec.json.Decoder(ModelList)
