"""Streaming from the engine, against the fake engine: text reaches the agent while the engine samples, in every
dialect; the sample is checked and the turn recorded before the finish goes out; text the parsers let out that
a whole reading disagrees with, or a sample that fails its checks, is an error event; an agent that leaves
cuts the generation short and its turn stays as context with mask 0."""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fake_engine import IM_END, FakeEngine, Scripted, logprob_of
from proxy_agent import TOOLS, Agent

from harness_rl.trace import TrainingTrace
from proxy.server.app import RunningProxy
from proxy.upstream.stream import _settled

WORDS = " ".join(f"w{i}" for i in range(60))  # ~80 tokens of 4 bytes
Block = tuple[float, dict[str, Any]]  # an SSE event's arrival time and its data


def _openai(block: dict[str, Any]) -> str:
    choices = block.get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def _anthropic(block: dict[str, Any]) -> str:
    return block["delta"].get("text", "") if block.get("type") == "content_block_delta" else ""


def _responses(block: dict[str, Any]) -> str:
    return block["delta"] if block.get("type") == "response.output_text.delta" else ""


def _gemini(block: dict[str, Any]) -> str:
    parts = block["candidates"][0]["content"]["parts"]
    return "".join(p.get("text", "") for p in parts if not p.get("thought"))


def _request(dialect: str, agent: Agent, text: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    session, user = agent.session, [{"role": "user", "content": text}]
    if dialect == "openai_chat":
        return f"{agent.base}/chat/completions", {"model": "m", "messages": user, "stream": True}, agent.auth
    if dialect == "anthropic_messages":
        return (f"{session['anthropic_base_url']}/v1/messages",
                {"model": "m", "max_tokens": 4096, "messages": user, "stream": True}, {"x-api-key": session["key"]})
    if dialect == "openai_responses":
        return f"{agent.base}/responses", {"model": "m", "input": text, "stream": True}, agent.auth
    return (f"{session['gemini_base_url']}/v1beta/models/m:streamGenerateContent?alt=sse",
            {"contents": [{"role": "user", "parts": [{"text": text}]}]}, {"x-goog-api-key": session["key"]})


TEXT_OF: dict[str, Callable[[dict[str, Any]], str]] = {
    "openai_chat": _openai, "anthropic_messages": _anthropic, "openai_responses": _responses, "google_gemini": _gemini}


def stream(url: str, body: dict[str, Any], headers: dict[str, str], until: Callable[[dict[str, Any]], bool]
           = lambda _: False) -> tuple[list[Block], float]:
    """Each SSE event's data as it arrives (stopping early, connection closed, once `until` holds), and when
    the request was sent."""
    blocks: list[Block] = []
    sent = time.perf_counter()
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        pending = ""
        for piece in itertools.chain(response.iter_text(), ["\n\n"]):  # Google's error event ends with one newline
            pending += piece
            while "\n\n" in pending:
                block, pending = pending.split("\n\n", 1)
                data = next((line[6:] for line in block.split("\n") if line.startswith("data: ")), block.strip())
                if not data.startswith("{"):  # [DONE], keep-alives
                    continue
                blocks.append((time.perf_counter(), json.loads(data)))
                if until(blocks[-1][1]):
                    return blocks, sent
    return blocks, sent


def wait_for_turns(agent: Agent, count: int, timeout_s: float = 10.0) -> TrainingTrace:
    deadline = time.monotonic() + timeout_s
    while True:
        trace = agent.trace()
        if len(trace.turns) >= count or time.monotonic() > deadline:
            return trace
        time.sleep(0.05)


@pytest.mark.parametrize("dialect", list(TEXT_OF))
def test_text_reaches_the_agent_while_the_engine_samples(dialect: str, fake_proxy: RunningProxy,
                                                         fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.token_delay_s = 0.01
    fake_engine.script.append(Scripted(content=WORDS))
    blocks, sent = stream(*_request(dialect, agent, "talk"))
    pieces = [(at, TEXT_OF[dialect](block)) for at, block in blocks if TEXT_OF[dialect](block)]
    total = blocks[-1][0] - sent
    assert "".join(text for _, text in pieces) == WORDS
    assert len(pieces) >= 4  # read as it grew, not once at the end
    assert pieces[0][0] - sent < 0.5 * total
    (turn,) = agent.trace().turns
    assert turn.reply.content == WORDS and turn.delivered and sum(turn.loss_mask) == len(turn.completion_token_ids)
    request = fake_engine.requests[-1]
    assert request["stream"] is True and request["stream_options"] == {"include_usage": True}
    # the parsers read every sampled id but the closing stop token, once, and their reads are the reply; one whole
    # reading beside the last read checks their tool calls
    steps = [i for ids in fake_engine.derender_steps for i in ids]
    assert steps == turn.completion_token_ids[:-1] and fake_engine.whole_derenders == 1


def _sent(url: str, body: dict[str, Any], headers: dict[str, str]) -> socket.socket:
    """A connection on which the request has been sent as one HTTP/1.1 POST (the answer is read raw from it)."""
    target = httpx.URL(url)
    payload = json.dumps(body).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in {**headers, "Host": target.netloc.decode(),
                   "Content-Type": "application/json", "Content-Length": str(len(payload))}.items())
    connection = socket.create_connection((target.host, target.port), timeout=30)
    connection.sendall(f"POST {target.raw_path.decode()} HTTP/1.1\r\n{head}\r\n".encode() + payload)
    return connection


def _writes(connection: socket.socket) -> list[bytes]:
    """The chunks of a chunked answer, read to its end: each is one write of the proxy, however TCP split them."""
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        got = connection.recv(1 << 16)
        assert got, data
        data += got
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    chunks = []
    while True:
        size, body = body.split(b"\r\n", 1)
        if not int(size, 16):
            return chunks
        chunks.append(body[:int(size, 16)])
        body = body[int(size, 16) + 2:]


def test_the_agents_first_bytes_carry_the_first_text(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """The stream's headers and opening wait for its first text and go with it in one send: an agent is woken
    once for what it can use, not three times."""
    agent = Agent(fake_proxy)
    fake_engine.token_delay_s = 0.05  # the first text comes well after the engine took the call
    fake_engine.script.append(Scripted(content="w1 w2 w3 w4 w5 w6"))
    with _sent(*_request("openai_chat", agent, "talk")) as connection:
        first = connection.recv(1 << 16)
    assert first.startswith(b"HTTP/1.1 200") and b'"role":"assistant"' in first and b'"content":"w1' in first


def test_the_last_text_goes_with_the_finish(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """The last read's text waits for the turn to be recorded and goes out with the finish, in one write."""
    agent = Agent(fake_proxy)
    fake_engine.token_delay_s = 0.01
    fake_engine.script.append(Scripted(content=WORDS, finish_reason="length"))  # the last step is text
    with _sent(*_request("openai_chat", agent, "talk")) as connection:
        writes = _writes(connection)
    events = [[json.loads(line[6:]) for line in write.decode().split("\n") if line.startswith("data: {")]
              for write in writes]
    assert "".join(_openai(event) for write in events for event in write) == WORDS
    assert len(writes) > 2 and b"data: [DONE]" in writes[-1]  # streamed as sampled; the end is one write
    last = [event for event in events[-1] if _openai(event)]
    finish = [event["choices"][0]["finish_reason"] for event in events[-1] if event.get("choices")]
    assert last and WORDS.endswith(_openai(last[-1])) and "length" in finish
    (turn,) = agent.trace().turns
    assert turn.finish_reason == "length" and turn.reply.content == WORDS


def test_a_stream_cut_anywhere_by_the_network_reads_as_sampled(fake_proxy: RunningProxy,
                                                               fake_engine: FakeEngine) -> None:
    """The engine's events reach the proxy in pieces that cut lines anywhere, and several at once: the sample is
    the same, id for id."""
    agent = Agent(fake_proxy)
    fake_engine.piece_bytes = 7
    fake_engine.script.append(Scripted(content=WORDS))
    blocks, _ = stream(*_request("openai_chat", agent, "talk"))
    assert "".join(_openai(block) for _, block in blocks) == WORDS
    (turn,) = agent.trace().turns
    assert turn.reply.content == WORDS
    assert turn.completion_token_ids == fake_engine.assistant_ids({"content": WORDS}) + [IM_END]
    assert turn.per_token_logps == [logprob_of(token) for token in turn.completion_token_ids]


def test_an_answer_sampled_before_its_first_read_is_read_once_whole(fake_proxy: RunningProxy,
                                                                    fake_engine: FakeEngine) -> None:
    """Nothing was sent before the answer was complete, so it is read as a JSON call's is: one whole reading, no
    streaming read (each of those would have the engine rescan the prompt)."""
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(content="Done", finish_reason="length"))  # one token: one step, the last
    blocks, _ = stream(*_request("openai_chat", agent, "talk"))
    assert "".join(_openai(block) for _, block in blocks) == "Done"
    assert fake_engine.derender_steps == [] and fake_engine.whole_derenders == 1
    assert fake_engine.routes["/inference/v1/generate"] == 1
    (turn,) = agent.trace().turns
    assert turn.reply.content == "Done" and len(turn.completion_token_ids) == 1 and turn.delivered


def test_a_streamed_tool_call_sent_back_as_received_splices(fake_proxy: RunningProxy,
                                                           fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.token_delay_s = 0.002
    fake_engine.script.append(Scripted(tool=("bash", {"cmd": "ls"}), reasoning="Let me look at the files here."))
    user = [{"role": "user", "content": "list"}]
    blocks, _ = stream(f"{agent.base}/chat/completions", {"model": "m", "messages": user, "tools": TOOLS,
                                                          "stream": True}, agent.auth)
    deltas = [b["choices"][0]["delta"] for _, b in blocks if b.get("choices")]
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls") or ():
            got = calls.setdefault(call["index"], {"id": "", "type": "function", "function": {"name": "",
                                                                                            "arguments": ""}})
            got["id"] += call.get("id") or ""
            got["function"]["name"] += call.get("function", {}).get("name") or ""
            got["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
    message = {"role": "assistant", "content": "".join(d.get("content") or "" for d in deltas),
               "reasoning": "".join(d.get("reasoning") or "" for d in deltas), "tool_calls": list(calls.values())}
    assert message["content"] == "" and message["reasoning"] == "Let me look at the files here."
    fake_engine.script.append(Scripted(content="done"))
    follow = user + [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "a.txt"}]
    assert agent.chat(follow, tools=TOOLS, stream=True).status_code == 200
    first, second = agent.trace().turns
    assert first.reply.tool_calls[0].arguments == '{"cmd": "ls"}' and first.finish_reason == "tool_calls"
    assert second.prompt_source == "spliced" and second.parent_id == first.node_id
    assert second.prompt_token_ids[:len(first.sequence)] == first.sequence


@pytest.mark.parametrize("lost", ["stream_drops_calls", "stream_drops_text"])
def test_what_the_streaming_reads_lost_reaches_the_agent_from_the_whole_reading(
        lost: str, fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """As vLLM's DeepSeek-V3 parser does when a read brings several ids: the streamed reads miss the call, or the
    text before it."""
    agent = Agent(fake_proxy)
    fake_engine.token_delay_s = 0.002
    setattr(fake_engine, lost, True)
    fake_engine.script.append(Scripted(tool=("bash", {"cmd": "ls"}), content="Listing the files now.",
                                       reasoning="Let me look at the files here."))
    blocks, _ = stream(f"{agent.base}/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "l"}],
                                                          "tools": TOOLS, "stream": True}, agent.auth)
    deltas = [b["choices"][0]["delta"] for _, b in blocks if b.get("choices")]
    pieces = [c for delta in deltas for c in delta.get("tool_calls") or ()]
    assert {c["index"] for c in pieces} == {0}
    assert "".join(c["function"].get("name") or "" for c in pieces) == "bash"
    assert "".join(c["function"].get("arguments") or "" for c in pieces) == '{"cmd": "ls"}'
    assert "".join(delta.get("content") or "" for delta in deltas) == "Listing the files now."
    (turn,) = agent.trace().turns
    assert turn.reply.tool_calls[0].name == "bash" and turn.finish_reason == "tool_calls" and turn.delivered
    assert turn.reply.content == "Listing the files now."


@pytest.mark.parametrize("dialect", list(TEXT_OF))
def test_an_agent_that_leaves_cuts_the_generation_and_its_turn_is_context(dialect: str, fake_proxy: RunningProxy,
                                                                         fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.token_delay_s = 0.02
    fake_engine.script.append(Scripted(content=WORDS * 5))  # ~400 tokens: 8 s if it ran to its end
    began = time.monotonic()
    blocks, _ = stream(*_request(dialect, agent, "talk"), until=lambda block: bool(TEXT_OF[dialect](block)))
    assert TEXT_OF[dialect](blocks[-1][1])
    (turn,) = wait_for_turns(agent, 1).turns
    while not fake_engine.aborted and time.monotonic() - began < 4.0:  # it notices at its next step
        time.sleep(0.01)
    assert time.monotonic() - began < 4.0
    assert fake_engine.aborted == [f"generate-{len(turn.prompt_token_ids)}"]  # the engine saw its client leave
    assert turn.finish_reason == "abort" and not turn.delivered and set(turn.loss_mask) == {0}
    full = len(fake_engine.assistant_ids({"content": WORDS * 5})) + 1
    assert 0 < len(turn.completion_token_ids) < full
    assert (turn.reply.content or "") and (WORDS * 5).startswith(turn.reply.content or "")


def test_a_failed_streaming_read_leaves_the_answer_to_a_whole_reading(fake_proxy: RunningProxy,
                                                                       fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.token_delay_s = 0.01
    fake_engine.stream_fail_after = 1
    fake_engine.script.append(Scripted(content=WORDS))
    blocks, _ = stream(*_request("openai_chat", agent, "talk"))
    assert "".join(_openai(block) for _, block in blocks) == WORDS
    (turn,) = agent.trace().turns
    assert turn.reply.content == WORDS and turn.delivered and fake_engine.whole_derenders == 1


def test_text_the_whole_reading_disagrees_with_is_an_error_and_the_turn_stays_as_context(
        fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.token_delay_s = 0.01
    fake_engine.stream_leak = "<tool"  # the first read lets out text, then the reads fail: the answer is read whole
    fake_engine.stream_fail_after = 1
    fake_engine.script.append(Scripted(content=WORDS))
    blocks, _ = stream(*_request("openai_chat", agent, "talk"))
    assert "error" in blocks[-1][1] and "does not hold" in blocks[-1][1]["error"]["message"]
    assert blocks[-1][1]["error"]["code"] == 502
    (turn,) = agent.trace().turns
    assert turn.reply.content == WORDS and not turn.delivered and set(turn.loss_mask) == {0}


@pytest.mark.parametrize("fault", ["no logprobs", "usage"])
def test_a_sample_that_fails_its_checks_is_an_error_event_and_nothing_is_recorded(
        fault: str, fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    if fault == "usage":
        fake_engine.usage_offset = 1
    else:
        fake_engine.capture = False
    for dialect in TEXT_OF:
        fake_engine.script.append(Scripted(content=WORDS))
        blocks, _ = stream(*_request(dialect, agent, "talk"))
        last = blocks[-1][1]
        message = last["response"]["error"]["message"] if dialect == "openai_responses" else last["error"]["message"]
        assert ("usage" in message) if fault == "usage" else ("without logprobs" in message)
        assert not any(block.get("type") in ("message_stop", "response.completed") for _, block in blocks)
    assert agent.trace().turns == []


def test_an_engine_that_breaks_off_its_stream_is_an_error_event_and_nothing_is_recorded(
        fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.break_after = 5
    fake_engine.script.append(Scripted(content=WORDS))
    blocks, _ = stream(*_request("anthropic_messages", agent, "talk"))
    assert blocks[-1][1]["type"] == "error" and "broke off its stream" in blocks[-1][1]["error"]["message"]
    assert agent.trace().turns == []


def test_stop_strings_are_held_back_until_they_cannot_be_one() -> None:
    assert _settled("abc", []) == 3
    assert _settled("ab", ["b!"]) == 1  # "b" may begin "b!"
    assert _settled("abc STO", ["STOP"]) == 4
    assert _settled("abc STOP", ["STOP"]) == 4
    assert _settled("abc STOX", ["STOP"]) == 8
    assert _settled("xa", ["ab", "xabc"]) == 0
