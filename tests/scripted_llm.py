"""A scripted model server on loopback that speaks just enough of every agent dialect, and records.

It stands in for the proxy when checking what a real agent CLI sends and what it needs back:
every request's method, path, query, headers and body are recorded, and model calls are answered
from a `Script`: a call whose conversation holds no tool result yet gets the scripted tool call
(or `edit` text for tool-less agents), a later one the final text. Calls without tools
(titles, summaries, next-speaker checks) get `aux_text`. Dialects, chosen by path:

- OpenAI Chat Completions (`.../chat/completions`), JSON or SSE;
- OpenAI Responses (`.../responses`), JSON or SSE with the typed events; a websocket upgrade on the
  same path is refused with 426 (and recorded) so the client falls back to HTTPS;
- Google Gemini (`...:generateContent`, `...:streamGenerateContent?alt=sse`, `...:countTokens`);
- `GET .../models` answers a one-model list (OpenAI and Gemini shapes).

Run it from a test with `with serve_scripted(script) as server:` (a background thread), or as a
script (`python tests/scripted_llm.py --port 18090 --tool bash --args '{"command": "ls"}'`) to
watch a CLI by hand; it then prints each request as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


@dataclass
class Script:
    """What the model answers: one tool call, then the final text; tool-less side calls get `aux_text`."""

    tool: str = "bash"
    arguments: dict[str, Any] = field(default_factory=dict)
    final_text: str = "Done."
    aux_text: str = "Scripted title"
    edit: str | None = None  # for tool-less agents (aider): the first answer's text instead of a tool call


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "path": self.path, "query": self.query, "headers": self.headers,
                "body": self.body}


@dataclass
class Reply:
    """One scripted answer, dialect-neutral."""

    text: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")


class ScriptedLLM:
    """The recording, answering aiohttp app."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[Recorded] = []
        self.edits_sent = 0
        self.log_to_stdout = False

    # -- choosing the answer ----------------------------------------------------------------

    def reply_for(self, has_tools: bool, tool_results: int) -> Reply:
        if self.script.edit is not None:  # tool-less agents show example turns: count our own answers
            self.edits_sent += 1
            return Reply(text=self.script.edit if self.edits_sent == 1 else self.script.final_text)
        if not has_tools:
            return Reply(text=self.script.aux_text)
        if tool_results == 0:
            return Reply(tool=self.script.tool, arguments=self.script.arguments)
        return Reply(text=self.script.final_text)

    # -- plumbing ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[self.record])
        app.router.add_route("*", "/{tail:.*}", self.route)
        return app

    @web.middleware
    async def record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = raw.decode("utf-8", "replace")
        entry = Recorded(request.method, request.path, dict(request.query), dict(request.headers), body)
        self.requests.append(entry)
        if self.log_to_stdout:
            print(json.dumps(entry.as_dict()), flush=True)
        return await handler(request)

    async def route(self, request: web.Request) -> web.StreamResponse:
        path, body = request.path, self.requests[-1].body
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return web.json_response({"error": {"message": "websockets are not served here"}}, status=426)
        if request.method == "GET" and path.rstrip("/").endswith("/models"):
            return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model",
                                                                  "owned_by": "scripted"}],
                                      "models": [{"name": "models/policy", "displayName": "policy"}]})
        if request.method != "POST" or not isinstance(body, dict):
            return web.json_response({}, status=200 if request.method in ("HEAD", "GET") else 404)
        if path.endswith("/chat/completions"):
            return await self.chat(request, body)
        if path.endswith("/responses"):
            return await self.responses(request, body)
        if ":countTokens" in path:
            return web.json_response({"totalTokens": 42})
        if ":generateContent" in path or ":streamGenerateContent" in path:
            return await self.gemini(request, body, stream=":streamGenerateContent" in path)
        return web.json_response({"error": {"message": f"no scripted route for {path}"}}, status=404)

    # -- OpenAI Chat ---------------------------------------------------------------------------

    async def chat(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        messages = body.get("messages") or []
        reply = self.reply_for(bool(body.get("tools")), sum(m.get("role") == "tool" for m in messages))
        message: dict[str, Any] = {"role": "assistant", "content": reply.text}
        finish = "stop"
        if reply.tool:
            finish = "tool_calls"
            message["tool_calls"] = [{"id": reply.call_id, "type": "function", "function": {
                "name": reply.tool, "arguments": json.dumps(reply.arguments)}}]
        created, model = int(time.time()), body.get("model", "policy")
        if not body.get("stream"):
            return web.json_response({"id": "chatcmpl-scripted", "object": "chat.completion", "created": created,
                                      "model": model, "usage": USAGE,
                                      "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
        base = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": created, "model": model}
        delta: dict[str, Any] = {"role": "assistant", "content": reply.text or ""}
        if reply.tool:
            delta = {"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": reply.call_id, "type": "function",
                 "function": {"name": reply.tool, "arguments": json.dumps(reply.arguments)}}]}
        chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                  {**base, "choices": [], "usage": USAGE}]
        return await sse(request, [(None, chunk) for chunk in chunks], done=True)

    # -- OpenAI Responses ----------------------------------------------------------------------

    async def responses(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        items: list[Any] = body["input"] if isinstance(body.get("input"), list) else []
        kinds = [item.get("type") or ("message" if "role" in item else None) for item in items]
        reply = self.reply_for(bool(body.get("tools")),
                               sum(kind in ("function_call_output", "custom_tool_call_output") for kind in kinds))
        response_id = f"resp_{uuid.uuid4().hex[:16]}"
        if reply.tool:
            item: dict[str, Any] = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:12]}",
                                    "call_id": reply.call_id, "name": reply.tool,
                                    "arguments": json.dumps(reply.arguments), "status": "completed"}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:12]}", "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": reply.text or "", "annotations": []}]}
        usage = {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 7,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 18}
        response = {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "completed",
                    "model": body.get("model", "policy"), "output": [item], "usage": usage,
                    "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}
        if not body.get("stream"):
            return web.json_response(response)
        started = {**response, "status": "in_progress", "output": [], "usage": None}
        events: list[dict[str, Any]] = [{"type": "response.created", "response": started},
                                        {"type": "response.in_progress", "response": started}]
        if reply.tool:
            events += [
                {"type": "response.output_item.added", "output_index": 0,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": 0,
                 "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": 0,
                 "arguments": item["arguments"]},
            ]
        else:
            part = {"type": "output_text", "text": "", "annotations": []}
            events += [
                {"type": "response.output_item.added", "output_index": 0,
                 "item": {**item, "content": [], "status": "in_progress"}},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": 0,
                 "content_index": 0, "part": part},
                {"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0, "content_index": 0,
                 "delta": reply.text or ""},
                {"type": "response.output_text.done", "item_id": item["id"], "output_index": 0, "content_index": 0,
                 "text": reply.text or ""},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": 0,
                 "content_index": 0, "part": {**part, "text": reply.text or ""}},
            ]
        events += [{"type": "response.output_item.done", "output_index": 0, "item": item},
                   {"type": "response.completed", "response": response}]
        for number, event in enumerate(events):
            event["sequence_number"] = number
        return await sse(request, [(event["type"], event) for event in events], done=False)

    # -- Google Gemini -------------------------------------------------------------------------

    async def gemini(self, request: web.Request, body: dict[str, Any], stream: bool) -> web.StreamResponse:
        contents = body.get("contents") or []
        parts = [part for content in contents for part in content.get("parts") or []]
        declared = any(tool.get("functionDeclarations") for tool in body.get("tools") or [])
        reply = self.reply_for(declared, sum("functionResponse" in part for part in parts))
        answer = ({"functionCall": {"name": reply.tool, "args": reply.arguments}} if reply.tool
                  else {"text": reply.text or ""})
        chunk = {"candidates": [{"content": {"role": "model", "parts": [answer]}, "finishReason": "STOP",
                                 "index": 0}],
                 "usageMetadata": {"promptTokenCount": 11, "candidatesTokenCount": 7, "totalTokenCount": 18},
                 "modelVersion": "policy", "responseId": f"resp-{uuid.uuid4().hex[:12]}"}
        if not stream:
            return web.json_response(chunk)
        return await sse(request, [(None, chunk)], done=False)


async def sse(request: web.Request, events: list[tuple[str | None, dict[str, Any]]], done: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        await response.write(f"{head}data: {json.dumps(data)}\n\n".encode())
    if done:
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@dataclass
class RunningScripted:
    url: str
    llm: ScriptedLLM

    @property
    def requests(self) -> list[Recorded]:
        return self.llm.requests

    def model_calls(self) -> list[Recorded]:
        """The recorded POSTs that asked the model for an answer (not token counts, not model lists)."""
        return [r for r in self.llm.requests if r.method == "POST" and isinstance(r.body, dict)
                and ":countTokens" not in r.path]


@contextmanager
def serve_scripted(script: Script, port: int = 0) -> Iterator[RunningScripted]:
    """Serve a `ScriptedLLM` on 127.0.0.1 (`port`, or 0: a free one) from a background thread until the block ends."""
    llm = ScriptedLLM(script)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(llm.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield RunningScripted(f"http://127.0.0.1:{runner.addresses[0][1]}", llm)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--tool", default="bash")
    parser.add_argument("--args", default="{}", help="the tool call's arguments, JSON")
    parser.add_argument("--final", default="Done.")
    args = parser.parse_args()
    llm = ScriptedLLM(Script(tool=args.tool, arguments=json.loads(args.args), final_text=args.final))
    llm.log_to_stdout = True
    web.run_app(llm.app(), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
