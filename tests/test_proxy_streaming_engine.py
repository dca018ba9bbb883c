"""Streaming from the embedded engine through the proxy: the first text of a 256-token answer reaches the agent
while the engine is still sampling it, with the ids a non-streamed call samples; a stop string never leaks; an
agent that leaves ends the engine's generation and its turn stays as context with mask 0."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from harness_rl.engine import Engine
from harness_rl.trace import TrainingTrace
from proxy.server.app import RunningProxy

LONG = " ".join(f"word{i}" for i in range(600))  # far more than 256 tokens


def force(engine_url: str, *texts: str) -> None:
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    httpx.post(f"{engine_url}/forced_completions", json={"tools": [], "no_tools": list(texts)}).raise_for_status()


def new_session(proxy: RunningProxy) -> dict[str, Any]:
    return httpx.post(f"{proxy.url}/sessions", headers={"Authorization": f"Bearer {proxy.admin_token}"},
                      json={}).json()


def trace_of(proxy: RunningProxy, session: dict[str, Any]) -> TrainingTrace:
    got = httpx.get(f"{proxy.url}/sessions/{session['id']}/trace",
                    headers={"Authorization": f"Bearer {proxy.admin_token}"})
    return TrainingTrace.from_json(got.content).validate()


def chat(session: dict[str, Any], body: dict[str, Any], leave_after_text: bool = False,
         at_first_text: Callable[[], None] | None = None) -> tuple[list[tuple[float, str]], float, float]:
    """The content deltas with their arrival times, when the request was sent and when its answer ended
    (or when the agent left, after the first text); `at_first_text` is called as the first text arrives."""
    pieces: list[tuple[float, str]] = []
    sent = time.perf_counter()
    with httpx.stream("POST", f"{session['openai_base_url']}/chat/completions", json={"model": "tiny", **body},
                      headers={"Authorization": f"Bearer {session['key']}"}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text = event["choices"][0]["delta"].get("content") if event["choices"] else None
            if text:
                pieces.append((time.perf_counter(), text))
                if at_first_text is not None and len(pieces) == 1:
                    at_first_text()
                if leave_after_text:
                    break
    return pieces, sent, time.perf_counter()


def test_the_first_text_of_a_256_token_answer_arrives_while_the_engine_samples_it(
        proxy: RunningProxy, engine_url: str, engine: Engine) -> None:
    session = new_session(proxy)
    user = [{"role": "user", "content": "Count."}]
    force(engine_url, LONG)
    whole = httpx.post(f"{session['openai_base_url']}/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {session['key']}"},
                       json={"model": "tiny", "messages": user, "max_tokens": 256}).json()
    fractions, sampling = [], []
    for _ in range(3):
        force(engine_url, LONG)
        pieces, sent, ended = chat(session, {"messages": user, "max_tokens": 256, "stream": True},
                                   at_first_text=lambda: sampling.append(engine.num_requests))
        fractions.append((pieces[0][0] - sent) / (ended - sent))
        assert "".join(text for _, text in pieces) == whole["choices"][0]["message"]["content"]
        assert len(pieces) >= 3
    tries = ", ".join(f"{f:.1%}" for f in fractions)
    print(f"first text at {min(fractions):.1%} of the answer's time (tries: {tries})")
    # Not timed: the order is what matters. Each first text came while the engine was still sampling its answer
    # (about 7 % into it on a quiet machine, 15-35 % with other work on both cores).
    assert sampling == [1, 1, 1]
    turns = trace_of(proxy, session).turns
    assert [len(t.completion_token_ids) for t in turns] == [256] * 4
    assert all(t.completion_token_ids == turns[0].completion_token_ids for t in turns)
    assert all(t.per_token_logps == pytest.approx(turns[0].per_token_logps, abs=1e-5) for t in turns)
    assert [t.metadata["stream"] for t in turns] == [False, True, True, True]
    assert all(t.reply == turns[0].reply and t.finish_reason == "length" for t in turns)


def test_a_stop_string_never_reaches_the_agent(proxy: RunningProxy, engine_url: str) -> None:
    session = new_session(proxy)
    force(engine_url, "alpha beta gamma zqxjkvw delta epsilon")
    pieces, _, _ = chat(session, {"messages": [{"role": "user", "content": "Go."}], "stop": ["zqxjkvw"],
                                  "stream": True})
    (turn,) = trace_of(proxy, session).turns
    assert "".join(text for _, text in pieces) == turn.reply.content == "alpha beta gamma "
    assert turn.finish_reason == "stop" and turn.delivered


def test_an_agent_that_leaves_ends_the_engines_generation(proxy: RunningProxy, engine_url: str,
                                                         engine: Engine) -> None:
    session = new_session(proxy)
    force(engine_url, LONG * 4)
    pieces, _, left = chat(session, {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 8000,
                                     "stream": True}, leave_after_text=True)
    assert pieces
    while engine.num_requests and time.perf_counter() - left < 5:
        time.sleep(0.01)
    drained = time.perf_counter() - left
    assert engine.num_requests == 0 and drained < 2.0
    deadline = time.monotonic() + 5
    while not trace_of(proxy, session).turns and time.monotonic() < deadline:
        time.sleep(0.02)
    (turn,) = trace_of(proxy, session).turns
    assert turn.finish_reason == "abort" and not turn.delivered and set(turn.loss_mask) == {0}
    forced = len(engine.tokenizer.encode(LONG * 4, add_special_tokens=False))
    print(f"the engine stopped {drained:.2f} s after the agent left, {len(turn.completion_token_ids)} of {forced} "
          "tokens sampled")
    assert 0 < len(turn.completion_token_ids) < forced / 2 and LONG.startswith(turn.reply.content or "-")
