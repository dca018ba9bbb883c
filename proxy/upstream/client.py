"""The engine client: vLLM's token-in routes with exact capture, retries, and checks on every answer.

The engine is vLLM (0.32+, started with `--enable-scale-out`) or the embedded engine; both answer
`/v1/chat/completions/render` (messages → prompt ids with the server's own template),
`/inference/v1/generate` (prompt ids → sampled ids, their logprobs, per-token weight versions) and
`/v1/chat/completions/derender` (sampled ids → a chat message with the server's tool and reasoning
parsers). A sample is refused unless its ids, logprobs and usage describe one and the same sample.
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import msgspec

from harness_rl.wire import MODELS_ROUTE, POLICY_VERSION_HEADER
from proxy.errors import ProxyError
from proxy.tokens import SEP, ids_array, ids_text, offset_after, token_text
from proxy.upstream.checks import VLLM_HINT, check_sample, check_usage, ids_below
from proxy.upstream.wire import (
    DERENDER_DECODER,
    GENERATE_DECODER,
    MODELS_DECODER,
    RENDER_DECODER,
    AssistantMessage,
    DerenderChoice,
    DerenderRequest,
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
    WeightVersionSpan,
)

log = logging.getLogger("harness_rl.proxy")
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
MAX_RETRY_AFTER_S = 30.0
# vLLM seeds a reply's detokenizer with the prompt's last 7 ids (its detokenizer_utils'
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2); a few more cost nothing
DETOKENIZER_SEED_IDS = 16
# A one-message conversation. Two replies to it the template renders alike but for their text: what follows
# the text in both is how the template closes an assistant turn (the end-of-turn token, then a separator).
PROBE = msgspec.Raw(b'{"role":"user","content":"hi"}')
_ENCODER = msgspec.json.Encoder()


class ChatRender(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A render request: the conversation in the engine's chat form (messages and tools already encoded)."""

    messages: list[msgspec.Raw]
    add_generation_prompt: bool
    tools: Any = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None


class Rendered(msgspec.Struct, frozen=True):
    """Prompt ids as the capture graph's token text (`1,2,3,`), and their count."""

    text: bytes
    count: int


class Generated(msgspec.Struct, frozen=True):
    """One checked sample: its ids and logprobs, why it ended, which weights produced which tokens."""

    ids: list[int]
    logps: list[float]
    finish_reason: str
    stop_reason: str | int | None
    spans: list[WeightVersionSpan]
    policy_version: int | None  # the engine's `x-policy-version` header (the embedded engine sends one)
    attempts: int

    @property
    def ends_with_stop_token(self) -> bool:
        """The last id is the stop token that ended the sample (EOS or a stop_token_ids hit), not text."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str) and bool(self.ids)


class Closing(msgspec.Struct, frozen=True):
    """How the engine's template closes an assistant turn, learned from probe renders (`EngineClient.closing`)."""

    end_of_turn: int  # the id that ends an assistant turn in the template's rendering
    separator: bytes  # token text between it and the next message
    opening: bytes = b""  # token text ending every rendering whatever add_generation_prompt says (vLLM's harmony
    # rendering of gpt-oss: `<|start|>assistant`); b"": the template opens the next turn only when asked

    @property
    def marker(self) -> bytes:
        return token_text([self.end_of_turn]) + self.separator

    def after(self, sequence: bytes, stopped: bool) -> bytes:
        """The token text that closes the reply ending `sequence` (prompt and completion) before the next message.
        The template's end of turn, unless the reply sampled it; where every rendering ends with an opening
        (harmony), the stop token the reply sampled (`<|call|>`, `<|return|>`) is its end, written as sampled."""
        if self.opening:
            return b"" if stopped else token_text([self.end_of_turn])
        last = sequence[sequence.rfind(SEP, 0, len(sequence) - 1) + 1:-1]
        return self.separator if last == str(self.end_of_turn).encode() else self.marker


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
        self.model_root: str | None = None
        self.described = False  # whether the engine has said what it serves (its /v1/models card)
        self._closing: Closing | None = None
        self._closing_unknowable = False  # the engine cannot show how its template closes a turn
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
        if not self.described:
            try:
                status, body, _ = await self._send("GET", MODELS_ROUTE, None)
                cards = MODELS_DECODER.decode(body).data if status == 200 else []
            except (ProxyError, msgspec.DecodeError):
                return self.model or None
            card = next((c for c in cards if c.id == self.model), cards[0] if cards else None)
            if card is not None and card.id:
                self.described = True
                self.model = self.model or card.id
                self.max_model_len = card.max_model_len
                self.model_root = card.root
                self.vocab_size = self.vocab_size or card.vocab_size
        return self.model or None

    async def render(self, request: ChatRender) -> Rendered:
        """The prompt ids of a conversation, rendered by the engine's own chat template."""
        request = msgspec.structs.replace(request, model=await self.served_model())
        data, _, _ = await self.post("/v1/chat/completions/render", _ENCODER.encode(request))
        try:
            ids = bytes(RENDER_DECODER.decode(data).token_ids)
            if self.vocab_size is not None:
                ids_below(self.vocab_size).decode(ids)
        except msgspec.ValidationError:
            raise ProxyError(502, f"the engine at {self.url} rendered a prompt id outside its {self.vocab_size}-token "
                                  "vocabulary") from None
        except msgspec.DecodeError as exc:
            raise ProxyError(502, f"the engine at {self.url} sent a render reply this proxy cannot read: {exc}") \
                from None
        rendered = ids_text(ids)
        if not rendered or not rendered[1]:
            raise ProxyError(502, f"the engine at {self.url} rendered no prompt ids")
        return Rendered(*rendered)

    async def generate(self, prompt: Rendered, sampling: SamplingParams) -> Generated:
        """Sample from prompt ids; the answer is checked before anyone sees it."""
        request = GenerateRequest(token_ids=ids_array(prompt.text), sampling_params=sampling,
                                  model=await self.served_model())
        data, headers, attempts = await self.post("/inference/v1/generate", _ENCODER.encode(request))
        try:
            reply = GENERATE_DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise ProxyError(502, f"the engine at {self.url} sent a generate reply this proxy cannot read: "
                                  f"{exc}") from None
        if len(reply.choices) != 1:
            raise ProxyError(502, f"the engine at {self.url} returned {len(reply.choices)} choices, expected 1")
        choice = reply.choices[0]
        entries = choice.logprobs.content if choice.logprobs is not None else None
        if choice.token_ids is None or entries is None:
            raise ProxyError(502, f"the engine at {self.url} returned no sampled token ids or logprobs; {VLLM_HINT}")
        ids, logps = choice.token_ids, [e.logprob for e in entries]
        check_sample(self.url, ids, [e.token_id for e in entries], logps, self.vocab_size)
        if reply.usage is not None:
            check_usage(self.url, reply.usage, prompt.count, len(ids))
        version = headers.get(POLICY_VERSION_HEADER)
        return Generated(ids, logps, choice.finish_reason or "stop", choice.stop_reason, choice.weight_versions or [],
                         int(version) if version and version.isdigit() else None, attempts)

    async def derender(self, sample: Generated, chat_request: bytes, prompt: Rendered) -> AssistantMessage:
        """The chat message the engine's parsers read from a sample's ids (a trailing stop token left out,
        as the chat route leaves it out of the text). The prompt's last ids seed the engine's detokenizer as the
        chat route's are seeded: without them a SentencePiece reply loses its first space (Mistral's v7 tokenizer:
        " Bye." read as "Bye.")."""
        ids = sample.ids[:-1] if sample.ends_with_stop_token else sample.ids
        if not ids:
            return AssistantMessage(content="")
        tail = prompt.text[offset_after(prompt.text, max(prompt.count - DETOKENIZER_SEED_IDS, 0)):]
        request = DerenderRequest(generate_response=GenerateResponse([DerenderChoice(ids, sample.finish_reason)]),
                                  chat_request=msgspec.Raw(chat_request), prompt_tokens=prompt.count,
                                  prompt_token_ids=ids_array(tail),
                                  model=await self.served_model())
        data, _, _ = await self.post("/v1/chat/completions/derender", _ENCODER.encode(request))
        try:
            message = DERENDER_DECODER.decode(data).choices[0].message
        except (msgspec.DecodeError, IndexError) as exc:
            raise ProxyError(502, f"the engine at {self.url} sent a derender reply this proxy cannot read: "
                                  f"{exc}") from None
        if isinstance(sample.stop_reason, str) and message.content:
            # vLLM's derender does not apply stop strings; the chat route cuts the text before the match
            cut = message.content.find(sample.stop_reason)
            message = msgspec.structs.replace(message, content=message.content[:cut] if cut >= 0 else message.content)
        return message

    async def closing(self) -> Closing | None:
        """How the engine's template closes an assistant turn: the end-of-turn id, and the token text after it.

        Learned once from probe renders and kept; None (asked again next time) while the engine cannot say, or
        when the template closes turns in a way this probe cannot read. An engine that refuses to render a
        conversation ending with the assistant (vLLM with Mistral's own tokenizer) never can, and gets None from
        then on without asking. One whose render adds the next turn's opening whether or not it is asked to (vLLM
        rendering gpt-oss's harmony) shows the closing followed by that opening: both are kept apart
        (`Closing.opening`), the separator taken as empty, as harmony has it.
        """
        if self._closing is None and not self._closing_unknowable:
            probes = [("A", False), ("A", True), ("B", False)]  # (the reply, add_generation_prompt)
            try:
                renders = await asyncio.gather(*(self.render(ChatRender(
                    messages=[PROBE, msgspec.Raw(_ENCODER.encode({"role": "assistant", "content": r}))],
                    add_generation_prompt=prompt)) for r, prompt in probes))
            except ProxyError as exc:
                if exc.status >= 500:
                    raise
                self._closing_unknowable = True
                return None
            closed, opened, other = renders
            a, b = (r.text.split(b",")[:-1] for r in (closed, other))
            shared = 0
            while shared < min(len(a), len(b)) and a[len(a) - 1 - shared] == b[len(b) - 1 - shared]:
                shared += 1
            suffix = a[len(a) - shared:]
            if opened.text != closed.text:
                self._closing = Closing(int(suffix[0]), b"".join(t + b"," for t in suffix[1:])) if shared else None
            elif shared >= 2:
                log.info("the engine at %s renders the next turn's opening whatever add_generation_prompt says "
                         "(harmony): a reply is closed by the stop token it sampled", self.url)
                self._closing = Closing(int(suffix[0]), b"", b"".join(t + b"," for t in suffix[1:]))
            else:
                self._closing_unknowable = True
        return self._closing

    async def post(self, path: str, payload: bytes) -> tuple[bytes, Any, int]:
        status, data, headers, attempts = await self._send_with_retries(path, payload)
        if status in (403, 404):
            raise ProxyError(502, f"the engine at {self.url} does not serve {path} (HTTP {status}: "
                                  f"{_error_message(data)}); {VLLM_HINT}")
        if status != 200:
            raise _engine_error(self.url, status, data, headers)
        return data, headers, attempts

    async def open_stream(self, path: str, payload: bytes) -> aiohttp.ClientResponse:
        """POST for a streamed reply and return it open (the caller reads it, then releases it: closing it
        early ends the engine's work). Retried as `post` until the engine answers 200; the deadline covers
        the whole stream."""
        status, response, headers, _ = await self._send_with_retries(path, payload, stream=True)
        if isinstance(response, aiohttp.ClientResponse):
            return response
        if status in (403, 404):
            raise ProxyError(502, f"the engine at {self.url} does not serve {path} (HTTP {status}: "
                                  f"{_error_message(response)}); {VLLM_HINT}")
        raise _engine_error(self.url, status, response, headers)

    async def _send_with_retries(self, path: str, payload: bytes,
                                 stream: bool = False) -> tuple[int, Any, Any, int]:
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
                status, data, headers = await self._send("POST", path, payload, deadline, stream)
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

    async def _send(self, method: str, path: str, payload: bytes | None, deadline: float | None = None,
                    stream: bool = False, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
        """One request (with `headers` besides its content type), ended by `deadline` (time.monotonic(); default
        `timeout_s` from now). With `stream`, a 200 reply is returned unread (the response itself, still open)."""
        assert self._http is not None, "EngineClient.start() was not awaited"
        remaining = (deadline - time.monotonic()) if deadline is not None else self.timeout_s
        try:
            if remaining <= 0:
                raise TimeoutError
            resp = await self._http.request(method, self.url + path, data=payload,
                                            headers={"Content-Type": "application/json", **(headers or {})},
                                            timeout=aiohttp.ClientTimeout(total=remaining))
            if stream and resp.status == 200:
                return resp.status, resp, resp.headers
            async with resp:
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
