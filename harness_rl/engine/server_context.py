"""What every route handler needs: the engine, the forced-completion script (when enabled), and
helpers that turn engine output into vLLM's JSON pieces."""

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from harness_rl import __version__
from harness_rl.engine.engine import Engine
from harness_rl.engine.forced import ForcedCompletions
from harness_rl.engine.generation import GenerationUpdate, PromptLogprob, SampledToken
from harness_rl.wire import POLICY_VERSION_HEADER

SYSTEM_FINGERPRINT = f"harness-rl-{__version__}"
LOGPROB_FLOOR = -9999.0


@dataclass
class ServerContext:
    engine: Engine
    forced: ForcedCompletions | None = None
    tokens_as_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def token_string(self, token_id: int, as_ids: bool) -> str:
        """`token_id:N` (vLLM's `return_tokens_as_token_ids`) or the decoded piece."""
        return f"token_id:{token_id}" if as_ids else self.engine.tokenizer.decode([token_id])

    def chat_logprob(self, token: SampledToken, as_ids: bool, top: int) -> dict[str, Any]:
        """One `logprobs.content[k]` entry, byte for byte as vLLM 0.32 writes it: the sampled
        token's `bytes` are its decoded text, the alternatives' are their `token` strings."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_string(token_id, as_ids)
            return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(text.encode("utf-8"))}

        decoded = self.engine.tokenizer.decode([token.token_id])
        return {
            **entry(token.token_id, token.logprob),
            "bytes": list(decoded.encode("utf-8", errors="replace")),
            "top_logprobs": [entry(i, lp) for i, lp in token.top_logprobs[:top]],
        }

    def prompt_logprobs(self, scored: tuple[PromptLogprob, ...] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: null for the first position, then `{id: {logprob, rank,
        decoded_token}}` holding the prompt token and the top alternatives."""
        if scored is None:
            return None
        decode = self.engine.tokenizer.decode

        def entry(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": decode([token_id])}

        return [None] + [
            {
                str(p.token_id): entry(p.logprob, p.rank, p.token_id),
                **{str(i): entry(lp, rank, i) for i, lp, rank in p.top if i != p.token_id},
            }
            for p in scored
        ]


CONTEXT = web.AppKey("context", ServerContext)


@dataclass
class Completion:
    """A finished generation, gathered from the engine's updates."""

    tokens: list[SampledToken]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    policy_version: int
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


async def collect(updates: AsyncIterator[GenerationUpdate]) -> Completion:
    tokens: list[SampledToken] = []
    pieces: list[str] = []
    version = 0
    scored = None
    async for update in updates:
        tokens.extend(update.tokens)
        pieces.append(update.text)
        version = update.policy_version
        scored = update.prompt_logprobs if update.prompt_logprobs is not None else scored
        if update.finish_reason is not None:
            return Completion(tokens, "".join(pieces), update.finish_reason, update.stop_reason, version, scored)
    raise RuntimeError("the generation ended without a finish reason")


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, details: bool = False) -> dict[str, Any]:
    """vLLM's usage block; whole replies carry the (null) details, stream usage chunks do not."""
    block: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        block.update(prompt_tokens_details=None, completion_tokens_details=None)
    return block


async def open_sse(request: web.Request, policy_version: int) -> web.StreamResponse:
    """Start an SSE reply stamped with the policy version of the generation it carries."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            POLICY_VERSION_HEADER: str(policy_version),
        }
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: dict[str, Any] | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    await response.write(f"data: {data}\n\n".encode())


async def end_stream(
    response: web.StreamResponse, header: dict[str, Any], usage_payload: dict[str, int] | None
) -> web.StreamResponse:
    """Close an SSE stream as vLLM does: the usage chunk when asked for (`choices: []`), then `[DONE]`."""
    if usage_payload is not None:
        await send_event(
            response, {**header, "choices": [], "usage": usage_payload, "system_fingerprint": SYSTEM_FINGERPRINT}
        )
    await send_event(response, "[DONE]")
    await response.write_eof()
    return response
