"""Token in, token out vs re-rendering: how many multi-turn conversations train as one exact chain.

Conversations are driven through `harness-rl`'s proxy in front of the embedded engine (the tiny random
model) with the official SDKs, the way agents send them: each reply goes back as the assistant message
(OpenAI), or as its content blocks (Anthropic), tool calls exactly as returned, then a tool result or
a user message. Kinds: plain text sampled by the model; OpenAI tool calls; Anthropic tool_use blocks.
Tool calls are the engine's forced completions written as compact JSON (`{"name":"bash",...}`), which
the chat template re-serialises with spaces, as real templates do. 4 conversations run at once.

The same conversations run through two proxies in one process: token in/token out on (spliced) and
off (every prompt rendered from the messages). Printed per mode, from the captured traces:
- chained transitions: consecutive turns where the later prompt extends the earlier prompt+completion;
- mistaken discards: turns the agent acted on that the capture graph marked `discarded`;
- untrained sampled tokens: sampled tokens no learner row will train;
- forwarded learner tokens (the learner's rows) vs a perfect chain (one row per conversation).

    python benchmarks/drift_bench.py [--conversations 24] [--turns 5] [--engine URL] [--quick]

`--engine URL` drives an engine already serving (real vLLM with `harness-rl serve vllm`) instead:
replies are then whatever its model samples, tool calls included only where it writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
from conventions import load_average, parse_args

from harness_rl.background import BackgroundLoop
from harness_rl.engine import Engine, build_tiny_model, serve_in_thread
from harness_rl.learner.rows import trace_rows
from harness_rl.run.stack import serve_proxy
from harness_rl.trace import TrainingTrace
from proxy.config import ProxyConfig

MAX_TOKENS = 24
TOOL = {"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}
ANTHROPIC_TOOL = {"name": "bash", "description": "run a shell command",
                  "input_schema": TOOL["function"]["parameters"]}  # type: ignore[index]


def forced_call(step: int) -> str:
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"cmd": f"ls dir{step}"}},
                                        separators=(",", ":")) + "\n</tool_call>"


def openai_text(session: dict, turns: int) -> None:
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["key"], max_retries=0)
    messages: list = [{"role": "user", "content": "Tell me about the sea."}]
    for step in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"more {step}"})


def openai_tools(session: dict, turns: int) -> None:
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["key"], max_retries=0)
    messages: list = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List files."}]
    for _ in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL], max_tokens=MAX_TOKENS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "a.txt b.txt"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "go on"})


def anthropic_blocks(session: dict, turns: int) -> None:
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["key"], max_retries=0)
    messages: list = [{"role": "user", "content": "List files."}]
    for _ in range(turns):
        answer = client.messages.create(model="policy", max_tokens=MAX_TOKENS, system="You are an agent.",
                                        messages=messages, tools=[ANTHROPIC_TOOL])
        blocks = [b.model_dump(exclude_none=True) for b in answer.content] or [{"type": "text", "text": ""}]
        messages.append({"role": "assistant", "content": blocks})
        results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "a.txt"}
                   for b in blocks if b["type"] == "tool_use"]
        messages.append({"role": "user", "content": results or "go on"})


KINDS = {"openai-text": openai_text, "openai-tools": openai_tools, "anthropic-blocks": anthropic_blocks}


def run_mode(engine_url: str, store: Path, tito: bool, conversations: int, turns: int) -> list[TrainingTrace]:
    """All conversations through one proxy; their traces."""
    with BackgroundLoop("bench-proxy") as loop, serve_proxy(ProxyConfig(upstream=engine_url, store_dir=str(store),
                                                                        tito=tito), loop) as proxy:
        admin = {"Authorization": f"Bearer {proxy.admin_token}"}
        sessions = [httpx.post(f"{proxy.url}/sessions", headers=admin, json={}).json() for _ in range(conversations)]
        kinds = list(KINDS.values())
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: kinds[i % len(kinds)](sessions[i], turns), range(conversations)))
        return [TrainingTrace.from_json(httpx.get(f"{proxy.url}/sessions/{s['id']}/trace", headers=admin,
                                                  timeout=60).content).validate() for s in sessions]


def measure(traces: list[TrainingTrace]) -> dict[str, float]:
    chained = transitions = discarded = sampled = untrained = forwarded = perfect = 0
    for trace in traces:
        turns = sorted(trace.turns, key=lambda t: t.started_at or 0.0)
        for earlier, later in zip(turns, turns[1:], strict=False):
            transitions += 1
            chained += later.parent_id == earlier.node_id and later.prompt_token_ids[:len(earlier.sequence)] == \
                earlier.sequence
        discarded += sum(t.role == "discarded" for t in turns)  # every turn here was acted on
        rows = trace_rows(trace)
        sampled += sum(len(t.completion_token_ids) for t in turns)
        untrained += sum(len(t.completion_token_ids) for t in turns) - sum(r.n_trained for r in rows)
        forwarded += sum(len(r) for r in rows)
        perfect += len(turns[-1].sequence) if turns else 0
    return {"chained": chained, "transitions": transitions, "discarded": discarded, "turns": sum(len(t.turns)
            for t in traces), "untrained": untrained, "sampled": sampled, "forwarded": forwarded, "perfect": perfect,
            "tool_calls": sum(len(t.reply.tool_calls) for trace in traces for t in trace.turns if t.reply)}


def run_embedded(work: Path, conversations: int, turns: int) -> dict[bool, dict[str, float]]:
    """Both modes against the embedded engine, tool calls forced as compact JSON."""
    engine = Engine.from_pretrained(build_tiny_model(work / "tiny", seed=0), served_model_name="tiny")
    results = {}
    with serve_in_thread(engine, forced_completions=True) as server:
        for tito in (True, False):
            tool_turns = turns * sum(1 for i in range(conversations) if i % len(KINDS) != 0)
            httpx.delete(f"{server.url}/forced_completions")
            httpx.post(f"{server.url}/forced_completions", json={"tools": [forced_call(i) for i in range(tool_turns)],
                                                                 "no_tools": []}).raise_for_status()
            results[tito] = measure(run_mode(server.url, work / f"store-{tito}", tito, conversations, turns))
    engine.close()
    return results


def main(argv: list[str] | None = None) -> dict[bool, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--engine", help="an engine already serving (e.g. real vLLM); default: the embedded one")
    args = parse_args(parser, {"conversations": 3, "turns": 2}, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="drift-bench-"))
    started = time.monotonic()
    if args.engine:
        results = {tito: measure(run_mode(args.engine, work / f"store-{tito}", tito, args.conversations, args.turns))
                   for tito in (True, False)}
    else:
        results = run_embedded(work, args.conversations, args.turns)
    print(f"{args.conversations} conversations x {args.turns} turns ({', '.join(KINDS)}), 4 at once, "
          f"{args.engine or 'embedded engine'}, tiny model; {time.monotonic() - started:.0f}s; {load_average()}")
    print(f"{'':<22}{'chained transitions':>22}{'mistaken discards':>20}{'untrained sampled':>20}"
          f"{'forwarded / perfect':>22}{'tool calls':>12}")
    for tito, r in results.items():
        name = "token in/out (splice)" if tito else "re-render (--no-tito)"
        print(f"{name:<22}{r['chained']:>10}/{r['transitions']:<4} {r['chained'] / r['transitions']:>6.1%}"
              f"{r['discarded']:>12}/{r['turns']:<6}{r['untrained'] / r['sampled']:>16.1%}"
              f"{r['forwarded'] / r['perfect']:>18.3f}x{r['tool_calls']:>12}")
    return results


if __name__ == "__main__":
    main()
