"""The engine client: asks for exact token capture, retries what is worth retrying, checks the answer.

The engine is vLLM or the embedded engine; both speak vLLM's chat API. Every chat call asks for
the prompt and completion token ids, the sampled token's logprob and token-id strings, and the
reply is refused unless ids, logprob tokens and usage all agree.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from email.utils import parsedate_to_datetime
from typing import Annotated, Any

import aiohttp
import msgspec

from proxy.capture import ids_text
from proxy.engine_wire import CHAT_REPLY_DECODER, MODELS_DECODER, NULL, TOKENIZE_DECODER, ChatReply
from proxy.errors import ProxyError

POLICY_VERSION_HEADER = "x-policy-version"
VLLM_HINT = ("start vLLM with `--logprobs-mode processed_logprobs --return-tokens-as-token-ids` "
             "(and `--generation-config vllm`), version 0.10.2 or newer for return_token_ids")
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
MAX_RETRY_AFTER_S = 30.0

_ENCODER = msgspec.json.Encoder()


class EngineChatRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A chat request to the engine with exact capture on: prompt and sampled ids, sampled logprobs as ids.

    The capture fields have no defaults, so they are always written (omit_defaults drops only the
    optional sampling fields left unset).
    """

    messages: list[msgspec.Raw]  # each message already encoded (its bytes are also what the log keeps)
    return_token_ids: bool
    logprobs: bool
    top_logprobs: int
    return_tokens_as_token_ids: bool
    stream: bool
    tools: Any = None  # the tools list already encoded (msgspec.Raw), or None
    tool_choice: Any = None
    temperature: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None

    @classmethod
    def capturing(cls, messages: list[msgspec.Raw], **fields: Any) -> EngineChatRequest:
        return cls(messages=messages, return_token_ids=True, logprobs=True, top_logprobs=0,
                   return_tokens_as_token_ids=True, stream=False, **fields)


class TokenizeChat(msgspec.Struct, kw_only=True, omit_defaults=True):
    messages: list[Any]
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    model: str | None = None


class EngineCall(msgspec.Struct, frozen=True):
    """One engine answer, checked: the reply, its prompt as token text, its policy version, attempts."""

    reply: ChatReply
    prompt_text: bytes
    n_prompt: int
    policy_version: int | None
    attempts: int


class EngineUnreachable(ProxyError):
    """No answer came back (refused, reset, closed mid-reply): worth another attempt."""


class EngineClient:
    """One keep-alive connection pool to one engine URL.

    `timeout_s` is the deadline of one call, retries and their waits included; replies larger than
    `max_reply_bytes` are refused unread. The model name, context size and vocabulary size come
    from the engine's `/v1/models`, asked until it answers.
    """

    def __init__(self, url: str, *, timeout_s: float, retries: int, model: str | None = None,
                 max_reply_bytes: int = 64 * 2**20, vocab_size: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.model = model
        self.max_reply_bytes = max_reply_bytes
        self.vocab_size = vocab_size
        self.max_model_len: int | None = None
        self._described = False
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                           skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def served_model(self) -> str | None:
        """The engine's model name, asked until the engine answers (agents may call the policy anything).

        Never cached while unknown: a proxy started beside an engine that is still loading heals as
        soon as the engine serves. The same answer says the context and vocabulary sizes, if it does.
        """
        if not self._described:
            try:
                status, body, _ = await self._send("GET", "/v1/models", None)
                cards = MODELS_DECODER.decode(body).data if status == 200 else []
            except (ProxyError, msgspec.DecodeError):
                return self.model or None
            card = next((c for c in cards if c.id == self.model), cards[0] if cards else None)
            if card is not None and card.id:
                self._described = True
                self.model = self.model or card.id
                self.max_model_len = card.max_model_len
                self.vocab_size = self.vocab_size or card.vocab_size
        return self.model or None

    async def chat(self, request: EngineChatRequest) -> EngineCall:
        """Send a capturing chat request and return the checked reply."""
        model = await self.served_model()
        if model:
            request = msgspec.structs.replace(request, model=model)
        status, data, headers, attempts = await self._send_with_retries("/v1/chat/completions",
                                                                        _ENCODER.encode(request))
        if status != 200:
            raise _engine_error(self.url, status, data, headers)
        try:
            reply = CHAT_REPLY_DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise ProxyError(502, f"the engine at {self.url} sent a chat reply this proxy cannot read: {exc}") from None
        prompt_text, n_prompt = check_capture(reply, self.url, self.vocab_size)
        version = headers.get(POLICY_VERSION_HEADER)
        policy_version = int(version) if version and version.isdigit() else None
        return EngineCall(reply, prompt_text, n_prompt, policy_version, attempts)

    async def count_chat_tokens(self, messages: list[Any], tools: list[Any] | None) -> int:
        """Exact prompt length from the engine's own chat template (vLLM's `/tokenize` chat form)."""
        body = TokenizeChat(messages=messages, tools=tools or None, model=await self.served_model())
        status, data, headers, _ = await self._send_with_retries("/tokenize", _ENCODER.encode(body))
        if status != 200:
            raise _engine_error(self.url, status, data, headers)
        try:
            return TOKENIZE_DECODER.decode(data).count
        except msgspec.DecodeError as exc:
            raise ProxyError(502, f"the engine at {self.url} sent a /tokenize reply this proxy cannot read: "
                                  f"{exc}") from None

    async def _send_with_retries(self, path: str, payload: bytes) -> tuple[int, bytes, Any, int]:
        """POST, retrying 408/429/5xx answers and lost connections; every attempt and wait ends by one deadline.

        A wait that would end past the deadline (a long Retry-After) is not waited: the last answer
        (or error) is returned at once.
        """
        deadline = time.monotonic() + self.timeout_s
        delay = 0.2
        attempt = 0
        while True:
            attempt += 1
            try:
                status, data, headers = await self._send("POST", path, payload, deadline)
            except EngineUnreachable:
                if attempt > self.retries or time.monotonic() + delay >= deadline:
                    raise
                wait = delay
            else:
                if status not in RETRY_STATUSES or attempt > self.retries:
                    return status, data, headers, attempt
                wait = _retry_after(headers.get("Retry-After"), delay)
                if time.monotonic() + wait >= deadline:
                    return status, data, headers, attempt
            await asyncio.sleep(wait)
            delay = min(delay * 2, MAX_RETRY_AFTER_S)

    async def _send(self, method: str, path: str, payload: bytes | None,
                    deadline: float | None = None) -> tuple[int, bytes, Any]:
        """One request, ended by `deadline` (time.monotonic(); default `timeout_s` from now)."""
        assert self._http is not None, "EngineClient.start() was not awaited"
        remaining = (deadline - time.monotonic()) if deadline is not None else self.timeout_s
        try:
            if remaining <= 0:
                raise TimeoutError
            async with self._http.request(method, self.url + path, data=payload,
                                          headers={"Content-Type": "application/json"},
                                          timeout=aiohttp.ClientTimeout(total=remaining)) as resp:
                return resp.status, await self._read(resp), resp.headers
        except TimeoutError:
            raise ProxyError(504, f"the engine at {self.url} did not answer within {self.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise EngineUnreachable(502, f"cannot reach the engine at {self.url}: {exc}") from None

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        """The reply's body, refused (502, not retried) past `max_reply_bytes`, before it is all read if possible."""
        limit = self.max_reply_bytes
        if resp.content_length is not None and resp.content_length <= limit:
            return await resp.read()
        if resp.content_length is None:
            chunks, size = [], 0
            async for chunk in resp.content.iter_any():
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
            else:
                return b"".join(chunks)
        raise ProxyError(502, f"the engine at {self.url} sent a reply larger than {limit / 2**20:g} MB "
                              "(--max-reply-mb)")


def _retry_after(value: str | None, fallback: float) -> float:
    """Seconds to wait, from a Retry-After header (seconds or HTTP date), capped."""
    if not value:
        return fallback
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        pass
    try:
        return min(max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0), MAX_RETRY_AFTER_S)
    except (TypeError, ValueError):
        return fallback


def _engine_error(url: str, status: int, data: bytes, headers: Any = None) -> ProxyError:
    """The agent's error for an engine's error: its 4xx as is, 429 with its Retry-After, anything else 502."""
    message = _error_message(data)
    if status == 429:
        retry_after = (headers or {}).get("Retry-After") or "1"
        return ProxyError(429, f"the engine is rate limiting: {message}", headers={"Retry-After": retry_after})
    if 400 <= status < 500 and status not in RETRY_STATUSES:
        return ProxyError(status, f"the engine rejected the request: {message}")
    return ProxyError(502, f"the engine at {url} failed with HTTP {status}: {message}")


def _error_message(data: bytes) -> str:
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data[:500].decode("utf-8", "replace")
    if isinstance(decoded, dict):
        error = decoded.get("error", decoded)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in decoded:
            return str(decoded["detail"])
    return str(decoded)[:500]


def check_capture(reply: ChatReply, url: str, vocab_size: int | None = None) -> tuple[bytes, int]:
    """Refuse a reply whose token ids, logprobs and usage do not describe one and the same sample.

    Returns the prompt ids as the capture graph's token text, and their count.
    """
    if len(reply.choices) != 1:
        raise ProxyError(502, f"the engine at {url} returned {len(reply.choices)} choices, expected 1")
    choice = reply.choices[0]
    content = choice.logprobs.content if choice.logprobs is not None else None
    has_prompt = reply.prompt_token_ids != NULL
    if not has_prompt or choice.token_ids is None or content is None:
        missing = [name for name, absent in (("prompt_token_ids", not has_prompt),
                                             ("choices[0].token_ids", choice.token_ids is None),
                                             ("choices[0].logprobs.content", content is None)) if absent]
        raise ProxyError(502, f"the engine at {url} returned no {', '.join(missing)}: token capture needs "
                              f"return_token_ids and sampled-token logprobs; {VLLM_HINT}")
    prompt = ids_text(bytes(reply.prompt_token_ids))
    if not prompt or not prompt[1]:
        raise ProxyError(502, f"the engine at {url} returned a prompt_token_ids that is not a non-empty array of "
                              "token ids")
    if vocab_size is not None:
        try:
            _ids_below(vocab_size).decode(bytes(reply.prompt_token_ids))
        except msgspec.ValidationError:
            raise ProxyError(502, f"the engine at {url} returned a prompt id outside its {vocab_size}-token "
                                  "vocabulary") from None
    ids = choice.token_ids
    if len(content) != len(ids):
        raise ProxyError(502, f"the engine at {url} returned {len(content)} logprobs for {len(ids)} sampled tokens")
    check_sample(ids, [entry.logprob for entry in content], url, vocab_size)
    expected = [f"token_id:{i}" for i in ids]
    actual = [entry.token for entry in content]
    if actual != expected:
        k = next(k for k, (a, e) in enumerate(zip(actual, expected, strict=True)) if a != e)
        raise ProxyError(502, f"the engine at {url} returned logprob token {actual[k]!r} at position {k} for "
                              f"sampled id {ids[k]}; {VLLM_HINT}")
    prompt_text, n_prompt = prompt
    if reply.usage is not None and (reply.usage.completion_tokens != len(ids) or reply.usage.prompt_tokens != n_prompt):
        raise ProxyError(502, f"the engine at {url} reported usage {reply.usage.prompt_tokens}+"
                              f"{reply.usage.completion_tokens} tokens but returned {n_prompt}+{len(ids)} ids")
    return prompt_text, n_prompt


def check_sample(ids: list[int], logps: list[float], url: str, vocab_size: int | None) -> None:
    """Refuse sampled ids outside the vocabulary and logprobs that are positive or not finite (C-speed scans)."""
    if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
        bad = next(i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size))
        size = f"its {vocab_size}-token vocabulary" if vocab_size is not None else "any vocabulary"
        raise ProxyError(502, f"the engine at {url} returned sampled token id {bad}, outside {size}")
    if logps and (not all(map(math.isfinite, logps)) or max(logps) > 0):
        lp = next(lp for lp in logps if not (math.isfinite(lp) and lp <= 0))
        raise ProxyError(502, f"the engine at {url} returned logprob {lp} for a sampled token; a logprob is finite "
                              "and at most 0")


@functools.cache
def _ids_below(vocab_size: int) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]])
