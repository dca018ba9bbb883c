"""A fast fake engine speaking vLLM 0.32's token-in routes, for proxy tests and the proxy benchmark.

It answers in well under a millisecond with deterministic token ids and logprobs. Its "chat
template" is prefix-stable like a real one (each message renders to the same ids wherever it sits);
an assistant message renders to exactly the ids sampled for it, unless `drift` is set, when the
template adds a token to it as real templates re-tokenise replies. Tests steer it through plain
attributes: scripted replies, injected failures, delays, a policy version header, drift, or dropped
capture fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from array import array
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec
from aiohttp import web

IM_START, IM_END, TOOL_CALL, DRIFT, THINK = 1, 2, 3, 4, 5
CALL, RETURN = 6, 7  # `always_opens`: harmony's stop tokens, after a tool call and after a final answer
ROLE_IDS = {"system": 10, "user": 11, "assistant": 12, "tool": 13}
TOOLS_ID = 14
TOOL_NUMBER = 1_100_000  # past every text id
PROBE_MESSAGE = {"role": "user", "content": "hi"}  # proxy.upstream.client.PROBE
_ENCODER = msgspec.json.Encoder()


def text_ids(text: str) -> list[int]:
    """Four UTF-8 bytes per token (C speed); ids are offset past the special ones."""
    data = text.encode()
    data += b"\0" * (-len(data) % 4)
    return [i % 1_000_000 + 100 for i in array("I", data)]


def logprob_of(token: int) -> float:
    return -((token % 97) + 1) / 100.0


@dataclass
class Scripted:
    """One reply to give instead of the default: text, or a tool call, and an optional status/delay."""

    content: str | None = None
    tool: tuple[str, dict[str, Any]] | None = None
    reasoning: str | None = None
    status: int = 200
    retry_after: str | None = None
    delay_s: float = 0.0
    finish_reason: str | None = None
    synced_to: int | None = None  # a weight sync to this version lands after the completion's first token


@dataclass
class FakeEngine:
    """vLLM's token-in routes (render, generate, derender), `/tokenize` and `/v1/models`, in microseconds.

    `drift` makes the template re-render an assistant message differently from the ids sampled for it
    (as real templates and BPE do), so only token in/token out keeps a conversation one chain.
    """

    version: int | None = None
    capture: bool = True  # False: answer like a vLLM started without the capture flags
    drift: bool = False
    drop_reasoning: bool = False  # like Qwen3: an assistant's reasoning is rendered only in the last message
    open_thinking: bool = False  # the generation prompt opens a thought the rendered replies do not hold
    numbered_tools: bool = False  # like templates that number tool results across the whole conversation
    script: deque[Scripted] = field(default_factory=deque)
    requests: list[dict[str, Any]] = field(default_factory=list)  # generate bodies
    conversations: list[dict[str, Any]] = field(default_factory=list)  # render bodies of whole conversations
    keep_requests: bool = True
    token_delay_s: float = 0.0  # streamed generate: the pause before each step
    stream_drops_calls: bool = False  # streaming derender: never reads the tool calls (DeepSeek-V3's parser, fed
    # several ids at once)
    stream_drops_text: bool = False  # streaming derender: never reads the content of an answer with tool calls
    # (DeepSeek-V3's parser, fed the text and the start of a call in one read)
    stream_leak: str | None = None  # streaming derender: text its parsers let out that the whole reading has not
    usage_offset: int = 0  # streamed generate: added to the completion tokens its usage chunk reports
    break_after: int | None = None  # streamed generate: drop the connection after this many chunks
    piece_bytes: int | None = None  # streamed generate: send the stream in pieces this long, a pause between
    hold_generate: bool = False  # never answer a generate; say on stdout that one arrived
    data_parallel: int | None = None  # vLLM's data-parallel copies, as its /get_world_size says (None: no route)
    ranks: list[str | None] = field(default_factory=list)  # each generate's X-data-parallel-rank header
    aborted: list[str] = field(default_factory=list)  # streamed generations whose client left before the end
    derender_steps: list[list[int]] = field(default_factory=list)  # the ids of each streaming derender call
    model_dir: str | None = None  # render with this model's tokenizer and chat template (as vLLM would), and say so
    served_root: str | None = None  # say this is the model it serves instead (a hub id), still rendering with model_dir
    routes: Counter[str] = field(default_factory=Counter)  # requests answered, by route
    render_extra: list[int] = field(default_factory=list)  # model_dir: ids its template adds (a template changed)
    user_last: bool = False  # refuse (400) to render a conversation ending with the assistant, as mistral-common
    always_opens: bool = False  # as vLLM's harmony: render the next turn's opening whatever add_generation_prompt
    # says, close a tool call with CALL (as sampled), and sample RETURN where the template closes with IM_END
    stream_fail_after: int | None = None  # streaming derender: fail every call after this many
    whole_derenders: int = 0  # derender calls of whole answers
    _cache: dict[str, list[int]] = field(default_factory=dict)
    _template: Any = None
    _sampled: dict[tuple[int, ...], dict[str, Any]] = field(default_factory=dict)
    _streamed: dict[tuple[int, ...], dict[str, Any]] = field(default_factory=dict)  # by prompt: the message sampled

    def reset(self) -> None:
        """Every knob and record back to what a new FakeEngine() holds (containers emptied in place, so a reference
        to one stays live); only the text-to-ids memo is kept, as it changes no answer."""
        fresh = FakeEngine()
        for knob in fields(self):
            if knob.name == "_cache":
                continue
            value, default = getattr(self, knob.name), getattr(fresh, knob.name)
            if isinstance(default, list | dict | deque) and type(value) is type(default):  # a Counter is a dict
                value.clear()
            else:
                setattr(self, knob.name, default)

    def _ids(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            if len(self._cache) > 50_000:
                self._cache.clear()
            ids = self._cache[text] = text_ids(text)
        return ids

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None,
               add_generation_prompt: bool = True) -> list[int]:
        if self.model_dir is not None:
            return self._model_render(messages, tools, add_generation_prompt) + self.render_extra
        out: list[int] = []
        if tools:
            out += [IM_START, TOOLS_ID, *self._ids(_ENCODER.encode(tools).decode()), IM_END]
        tool_results = 0
        for index, m in enumerate(messages):
            out += [IM_START, ROLE_IDS.get(m.get("role"), 15)]
            if m.get("role") == "tool" and self.numbered_tools:
                out.append(TOOL_NUMBER + tool_results)
                tool_results += 1
            if m.get("role") == "assistant":
                out += [DRIFT] if self.drift else []
                out += self.assistant_ids(m, reasoning=not self.drop_reasoning or index == len(messages) - 1)
            else:
                out += self._ids(_content(m.get("content")))
            out.append(CALL if self.always_opens and m.get("tool_calls") else IM_END)
        return out + ([IM_START, ROLE_IDS["assistant"], *([THINK] if self.open_thinking else [])]
                      if add_generation_prompt else [])

    def assistant_ids(self, message: dict[str, Any], reasoning: bool = True) -> list[int]:
        """The ids sampled for an assistant message (what the template renders too, unless it drifts)."""
        out = [THINK, *self._ids(message["reasoning"])] if reasoning and message.get("reasoning") else []
        out += self._ids(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            f = call["function"]
            out = out + [TOOL_CALL, *self._ids(f["name"]), *self._ids(f["arguments"])]
        return out

    def sample(self, prompt: list[int], scripted: Scripted | None) -> tuple[dict[str, Any], list[int], str]:
        """The message, its completion ids (stop token included) and finish reason for a prompt."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        finish = "stop"
        if scripted is not None and scripted.tool is not None:
            name, args = scripted.tool
            message["tool_calls"] = [{"id": f"chatcmpl-tool-{len(prompt):x}", "type": "function",
                                      "function": {"name": name, "arguments": json.dumps(args)}}]
            message["content"] = scripted.content  # the text before the call, if any
        else:
            message["content"] = scripted.content if scripted and scripted.content is not None \
                else f"answer after {len(prompt)} tokens"
        if scripted is not None and scripted.reasoning:
            message["reasoning"] = scripted.reasoning
        completion = self.assistant_ids(message) + [
            (CALL if message.get("tool_calls") else RETURN) if self.always_opens else IM_END]
        if scripted is not None and scripted.finish_reason == "length":
            finish, completion = "length", completion[:-1]
        self._sampled[tuple(completion[:-1] if finish == "stop" else completion)] = message
        return message, completion, finish

    def _model_render(self, messages: list[dict[str, Any]], tools: list[Any] | None,
                      add_generation_prompt: bool) -> list[int]:
        """The model's own template and tokenizer, shaped as vLLM shapes messages (the proxy's local renderer, which
        is checked against vLLM elsewhere: here it only has to be fast and deterministic)."""
        from proxy.capture.local_render import LocalTemplate
        from proxy.tokens import token_ids
        from proxy.upstream.client import ChatRender

        if self._template is None:
            self._template = LocalTemplate.load(str(self.model_dir))
        request = ChatRender(messages=[msgspec.Raw(_ENCODER.encode(m)) for m in messages],
                             tools=msgspec.Raw(_ENCODER.encode(tools)) if tools else None,
                             add_generation_prompt=add_generation_prompt)
        rendered = self._template.render(request, "string")
        if rendered is None:
            raise ValueError("the model's template declined these messages")
        return token_ids(rendered.text)

    @property
    def whole_conversations(self) -> list[dict[str, Any]]:
        """The render bodies of whole conversations (the proxy's renders of new messages alone, behind its one-message
        probe conversation, left out)."""
        return [body for body in self.conversations if body["messages"][:1] != [PROBE_MESSAGE]]

    # ---------------------------------------------------------------- HTTP

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 2**20, middlewares=[self._count])
        app.router.add_post("/v1/chat/completions", self._chat)  # for the direct baseline and OpenEnv's proxy
        app.router.add_post("/v1/chat/completions/render", self._render)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/v1/chat/completions/derender", self._derender)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_get("/get_world_size", self._world_size)
        app.router.add_get("/stats", self._stats)
        return app

    async def _world_size(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode route: TP x PP (here 1), times the data-parallel copies unless include_dp=false."""
        if self.data_parallel is None:
            raise web.HTTPNotFound()
        include_dp = request.query.get("include_dp", "true") == "true"
        return web.json_response({"world_size": self.data_parallel if include_dp else 1})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _weight_info(self, request: web.Request) -> web.Response:
        """The version as vLLM says it: "default" until one is set."""
        return web.json_response({"weight_version": "default" if self.version is None else str(self.version)})

    def _headers(self) -> dict[str, str]:
        return {"x-policy-version": str(self.version)} if self.version is not None else {}

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        scripted = self.script.popleft() if self.script else None
        prompt = self.render(body["messages"], body.get("tools"))
        message, completion, finish = self.sample(prompt, scripted)
        if body.get("stream"):
            return await self._chat_stream(request, message, completion, finish)
        choice: dict[str, Any] = {"index": 0, "message": message, "stop_reason": None,
                                  "finish_reason": "tool_calls" if message.get("tool_calls") else finish}
        reply: dict[str, Any] = {"id": f"chatcmpl-{len(prompt)}", "object": "chat.completion", "created": 1,
                                 "model": body.get("model", "fake"), "choices": [choice],
                                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
                                           "total_tokens": len(prompt) + len(completion)}}
        if self.capture and body.get("return_token_ids"):
            choice["token_ids"] = completion
            reply["prompt_token_ids"] = prompt
        if self.capture and body.get("logprobs"):
            choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": logprob_of(t), "bytes": None,
                                               "top_logprobs": []} for t in completion]}
        return web.Response(body=_ENCODER.encode(reply), content_type="application/json", headers=self._headers())

    async def _chat_stream(self, request: web.Request, message: dict[str, Any], completion: list[int],
                           finish: str) -> web.StreamResponse:
        """The chat route streaming (the direct baseline of streaming agents): a chunk per sampled token."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = ""
        for count in range(1, len(completion) + 1):
            _, content = self._text(message, count)
            last = count == len(completion)
            delta: dict[str, Any] = {"content": content[len(sent):]} if content[len(sent):] else {}
            if last and message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            sent = content
            chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish if last else None}]}
            await response.write(b"data: " + _ENCODER.encode(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def _render(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        agp = body.get("add_generation_prompt", True)
        if self.user_last and body["messages"][-1]["role"] == "assistant":
            return web.json_response({"error": {"message": "Expected last role User or Tool (or Assistant with prefix) "
                                                           "for serving but got assistant"}}, status=400)
        if agp and self.keep_requests:
            self.conversations.append(body)
        ids = self.render(body["messages"], body.get("tools"), agp or self.always_opens)
        return web.Response(body=_ENCODER.encode({"token_ids": ids, "sampling_params": {}}),
                            content_type="application/json")

    async def _generate(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        if self.keep_requests:
            self.requests.append(body)
            self.ranks.append(request.headers.get("X-data-parallel-rank"))
        if self.hold_generate:  # a test kills this engine now, with the call at it
            print("generate", flush=True)
            await asyncio.Event().wait()
        scripted = self.script.popleft() if self.script else None
        if scripted is not None and scripted.delay_s:
            await asyncio.sleep(scripted.delay_s)
        if scripted is not None and scripted.status != 200:
            headers = {"Retry-After": scripted.retry_after} if scripted.retry_after else {}
            return web.Response(status=scripted.status, headers=headers, content_type="application/json",
                                body=_ENCODER.encode({"error": {"message": f"scripted {scripted.status}"}}))
        prompt = body["token_ids"]
        _, completion, finish = self.sample(prompt, scripted)
        spans = [{"version": str(self.version) if self.version is not None else "default", "start": 0,
                  "end": len(completion)}]
        if scripted is not None and scripted.synced_to is not None:  # like vLLM's pause(mode=keep) mid-generation
            self.version = scripted.synced_to
            spans = [{**spans[0], "end": 1}, {"version": str(self.version), "start": 1, "end": len(completion)}]
        if body.get("stream"):
            self._streamed[tuple(prompt)] = {"message": self._sampled[tuple(completion[:-1] if finish == "stop"
                                                                             else completion)], "ids": completion}
            return await self._stream(request, body, completion, finish, spans)
        choice: dict[str, Any] = {"index": 0, "token_ids": completion, "finish_reason": finish, "stop_reason": None,
                                  "weight_versions": spans}
        if self.capture:
            choice["logprobs"] = {"content": [{"token_id": t, "logprob": logprob_of(t)} for t in completion]}
        reply = {"request_id": f"generate-{len(prompt)}", "choices": [choice],
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}}
        return web.Response(body=_ENCODER.encode(reply), content_type="application/json", headers=self._headers())

    async def _stream(self, request: web.Request, body: dict[str, Any], completion: list[int], finish: str,
                      spans: list[dict[str, Any]]) -> web.StreamResponse:
        """vLLM's streamed generate: one chunk per token (the last with the finish and the spans), then the usage."""
        request_id = f"generate-{len(body['token_ids'])}"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **self._headers()})
        await response.prepare(request)
        events = []
        for k, token in enumerate(completion):
            last = k == len(completion) - 1
            choice: dict[str, Any] = {"index": 0, "token_ids": [token], "finish_reason": finish if last else None,
                                      "stop_reason": None, "weight_versions": spans if last else None}
            if self.capture:
                choice["logprobs"] = {"content": [{"token_id": token, "logprob": logprob_of(token)}]}
            events.append({"request_id": request_id, "usage": None, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({"request_id": request_id, "choices": [], "usage": {
                "prompt_tokens": len(body["token_ids"]), "completion_tokens": len(completion) + self.usage_offset}})
        try:
            for sent, event in enumerate(events):
                if sent == self.break_after and request.transport is not None:
                    request.transport.close()
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                await self._send(response, b"data: " + _ENCODER.encode(event) + b"\n\n")
            await self._send(response, b"data: [DONE]\n\n")
        except ConnectionResetError:
            self.aborted.append(request_id)
        return response

    async def _send(self, response: web.StreamResponse, data: bytes) -> None:
        size = self.piece_bytes or len(data)
        for start in range(0, len(data), size):
            if start:
                await asyncio.sleep(0.001)  # the pieces arrive apart, lines cut anywhere
            await response.write(data[start:start + size])

    async def _derender_step(self, body: dict[str, Any]) -> web.Response:
        """Streaming derender: the text the new ids add to the answer's reasoning and content (4 bytes a token);
        the finishing step adds the tool calls, whole."""
        choice = body["generate_chunk"]["choices"][0]
        ids = choice["token_ids"]
        self.derender_steps.append(ids)
        if self.stream_fail_after is not None and len(self.derender_steps) > self.stream_fail_after:
            return web.Response(status=400, content_type="application/json",
                                body=_ENCODER.encode({"error": {"message": "scripted derender failure"}}))
        message = self._streamed[tuple(body["prompt_token_ids"])]["message"]
        before = (body.get("stream_state") or {}).get("count", 0)
        (r0, c0), (r1, c1) = self._text(message, before), self._text(message, before + len(ids))
        dropped = self.stream_drops_text and message.get("tool_calls")
        delta = {"role": None, "content": None if dropped else c1[len(c0):] or None, "reasoning": r1[len(r0):] or None}
        if self.stream_leak and delta["content"]:
            delta["content"] += self.stream_leak
        if choice.get("finish_reason") and message.get("tool_calls") and not self.stream_drops_calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        chunk = {"id": "chatcmpl-derendered", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}]}
        return web.Response(body=_ENCODER.encode({"chunk": chunk, "stream_state": {"count": before + len(ids)}}),
                            content_type="application/json")

    def _text(self, message: dict[str, Any], count: int) -> tuple[str, str]:
        """The reasoning and content of a message's first `count` sampled tokens."""
        reasoning, content = message.get("reasoning") or "", message.get("content") or ""
        thought = 1 + len(self._ids(reasoning)) if reasoning else 0
        return _prefix(reasoning, count - 1 if reasoning else 0), _prefix(content, count - thought)

    def _cut_short(self, ids: list[int]) -> dict[str, Any] | None:
        """The message of a streamed sample cut short after `ids`."""
        for streamed in self._streamed.values():
            if streamed["ids"][:len(ids)] == ids:
                reasoning, content = self._text(streamed["message"], len(ids))
                return {"role": "assistant", "content": content, "reasoning": reasoning or None}
        return None

    async def _derender(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        if body.get("stream"):
            return await self._derender_step(body)
        self.whole_derenders += 1
        choice = body["generate_response"]["choices"][0]
        message = self._sampled.get(tuple(choice["token_ids"])) or self._cut_short(choice["token_ids"])
        if message is None:
            return web.Response(status=400, content_type="application/json",
                                body=_ENCODER.encode({"error": {"message": "ids this fake never sampled"}}))
        reply = {"id": "chatcmpl-derendered", "object": "chat.completion",
                 "choices": [{"index": 0, "message": message, "finish_reason": choice.get("finish_reason")}]}
        return web.Response(body=_ENCODER.encode(reply), content_type="application/json")

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        ids = self.render(body["messages"], body.get("tools")) if "messages" in body else self._ids(body["prompt"])
        return web.Response(body=_ENCODER.encode({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids}),
                            content_type="application/json")

    @web.middleware
    async def _count(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.routes[request.path] += 1
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        root = self.served_root or self.model_dir
        card = {"id": "fake", "object": "model", **({"root": root} if root else {})}
        return web.Response(body=_ENCODER.encode({"object": "list", "data": [card]}), content_type="application/json")

    async def _stats(self, request: web.Request) -> web.Response:
        return web.Response(body=_ENCODER.encode(dict(self.routes)), content_type="application/json")


def _prefix(text: str, tokens: int) -> str:
    """The text of a message's first `tokens` tokens (4 UTF-8 bytes each), an unfinished character held back."""
    return text.encode()[:max(tokens, 0) * 4].decode(errors="ignore") if tokens < len(text.encode()) / 4 else text


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


async def start_fake_engine(engine: FakeEngine, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(engine.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, f"http://{host}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


@contextlib.contextmanager
def run_fake_engine(engine: FakeEngine) -> Iterator[str]:
    """Serve `engine` from a background thread; yield its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, url = asyncio.run_coroutine_threadsafe(start_fake_engine(engine), loop).result(10)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def main() -> None:
    """Serve a fake engine in this process (the benchmark runs it apart from the proxies it measures)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--hold-generate", action="store_true",
                        help="never answer a generate; print 'generate' when one arrives (a crash mid-call)")
    parser.add_argument("--model-dir", help="render with this model's tokenizer and chat template")
    parser.add_argument("--served-root", help="name this hub id as the model served (`vllm serve ORG/NAME`)")
    args = parser.parse_args()

    async def serve() -> None:
        fake = FakeEngine(keep_requests=False, hold_generate=args.hold_generate, model_dir=args.model_dir,
                          served_root=args.served_root)
        runner, url = await start_fake_engine(fake, port=args.port)
        print(url, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
