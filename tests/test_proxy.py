"""The proxy against a fast fake engine: sessions, routing, capture, durability, sampling, faults."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from fake_engine import IM_END, FakeEngine, Scripted, logprob_of
from proxy_agent import TOOLS, Agent

from harness_rl.run.stack import serve_proxy
from harness_rl.trace import TrainingTrace
from proxy.client import ProxyClient, ProxyClientError
from proxy.config import ProxyConfig
from proxy.sampling import SamplingPolicy, call_seed
from proxy.server.app import RunningProxy
from proxy.server.pipeline import BUDGET_MESSAGE

Served = tuple[FakeEngine, str]  # the fake engine and its URL

def test_session_urls_and_control_api(fake_proxy: RunningProxy) -> None:
    agent = Agent(fake_proxy, metadata={"task": "t1"}, max_turns=5)
    info = agent.session
    assert info["openai_base_url"] == f"{fake_proxy.url}/s/{info['id']}/v1"
    assert info["anthropic_base_url"] == f"{fake_proxy.url}/s/{info['id']}"
    assert len(info["key"]) > 30
    listed = httpx.get(f"{fake_proxy.url}/sessions", headers=agent.admin).json()["sessions"]
    assert [s["id"] for s in listed] == [info["id"]]
    one = httpx.get(f"{fake_proxy.url}/sessions/{info['id']}", headers=agent.admin).json()
    assert one["metadata"] == {"task": "t1"} and one["max_turns"] == 5 and one["turns"] == 0
    assert httpx.head(f"{fake_proxy.url}/").status_code == 200
    assert httpx.head(info["anthropic_base_url"]).status_code == 200
    assert httpx.get(f"{fake_proxy.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{fake_proxy.url}/sessions").status_code == 401
    assert httpx.get(f"{fake_proxy.url}/sessions", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_chat_turn_is_captured_exactly(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.version = 7
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"}]
    fake_engine.script.append(Scripted(tool=("bash", {"cmd": "ls"})))
    first = agent.chat(messages, tools=TOOLS, temperature=0.3, top_p=0.5, max_tokens=50)
    assert first.status_code == 200, first.text
    answer = first.json()
    assert set(answer) == {"id", "object", "created", "model", "choices", "usage"}
    assert "token_ids" not in answer["choices"][0] and answer["choices"][0]["logprobs"] is None
    call = answer["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "bash", "arguments": '{"cmd": "ls"}'}
    sent = fake_engine.requests[-1]
    assert sent["sampling_params"] == {"logprobs": 0, "skip_special_tokens": False, "temperature": 1.0,
                                       "max_tokens": 50}
    assert sent["model"] == "fake" and sent["token_ids"] == fake_engine.render(
        fake_engine.conversations[0]["messages"], fake_engine.conversations[0]["tools"])

    messages += [answer["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}]
    second = agent.chat(messages, tools=TOOLS)
    assert second.status_code == 200
    trace = agent.trace()
    t1, t2 = trace.turns
    expected_prompt = fake_engine.requests[0]["token_ids"]
    expected_completion = fake_engine.assistant_ids(answer["choices"][0]["message"]) + [IM_END]
    assert t1.prompt_token_ids == expected_prompt
    assert t1.completion_token_ids == expected_completion
    assert t1.per_token_logps == [logprob_of(t) for t in expected_completion]
    assert t1.loss_mask == [0] * len(expected_prompt) + [1] * len(expected_completion)
    assert t2.parent_id == t1.node_id and t1.parent_id is None
    assert t2.prompt_token_ids[:len(t1.sequence)] == t1.sequence
    assert (t1.role, t2.role) == ("agent", "agent")
    assert t1.policy_version == 7 and t1.finish_reason == "tool_calls"
    assert len(t1.node_id) == 12 and int(t1.node_id, 16) >= 0
    assert t1.request.messages == messages[:2] and t1.request.tools == TOOLS
    assert [m["role"] for m in t2.request.messages] == ["system", "user", "assistant", "tool"]
    assert t2.request.messages[2]["tool_calls"][0]["id"] == call["id"]
    assert t1.reply.tool_calls[0].name == "bash" and t1.reply.tool_calls[0].arguments == '{"cmd": "ls"}'
    assert t1.sampling.requested == {"temperature": 0.3, "top_p": 0.5, "max_tokens": 50}
    assert (t1.sampling.temperature, t1.sampling.max_tokens, t1.sampling.truncation) == (1.0, 50, "neutralise")
    assert t1.metadata["dialect"] == "openai_chat" and t1.metadata["model"] == "policy"
    assert agent.session["key"] not in trace.to_json().decode()
    assert t1.started_at <= t1.finished_at


def test_streaming_chat_with_tool_call_deltas_and_usage(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(tool=("bash", {"cmd": "pwd"}), reasoning="think first"))
    got = agent.chat([{"role": "user", "content": "where am I"}], tools=TOOLS, stream=True,
                     stream_options={"include_usage": True})
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in got.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"]["reasoning"] == "think first"
    header = chunks[2]["choices"][0]["delta"]["tool_calls"][0]
    assert header["index"] == 0 and header["type"] == "function" and header["id"]
    assert header["function"] == {"name": "bash", "arguments": ""}
    assert chunks[3]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"cmd": "pwd"}'
    assert chunks[4]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[5]["choices"] == [] and chunks[5]["usage"]["prompt_tokens"] > 0
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in chunks)
    assert fake_engine.requests[-1]["stream"] is True  # sampled as a stream, with the usage to check it against
    assert fake_engine.requests[-1]["stream_options"] == {"include_usage": True}
    assert agent.trace().turns[0].metadata["stream"] is True


def test_routing_by_key_and_isolation(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    a, b = Agent(fake_proxy), Agent(fake_proxy)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    by_key = httpx.post(f"{fake_proxy.url}/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {a.session['key']}"})
    assert by_key.status_code == 200
    by_x_api_key = httpx.post(f"{fake_proxy.url}/v1/chat/completions", json=body,
                              headers={"x-api-key": a.session["key"]})
    assert by_x_api_key.status_code == 200
    cross = httpx.post(f"{b.base}/chat/completions", json=body, headers={"Authorization": f"Bearer {a.session['key']}"})
    assert cross.status_code == 401
    assert len(a.trace().turns) == 2 and b.trace().turns == []
    assert httpx.post(f"{fake_proxy.url}/v1/chat/completions", json=body).status_code == 401
    assert httpx.post(f"{fake_proxy.url}/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.post(f"{fake_proxy.url}/s/sdoesnotexist/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {a.session['key']}"}).status_code == 404
    for headers in ({}, {"Authorization": "Bearer junk"}):  # the session id alone never authorises a call
        assert httpx.post(f"{a.base}/chat/completions", json=body, headers=headers).status_code == 401


def test_concurrent_sessions_keep_their_own_graphs(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agents = [Agent(fake_proxy) for _ in range(4)]

    async def converse(agent: Agent, n: int) -> None:
        messages = [{"role": "user", "content": f"task {n}"}]
        async with httpx.AsyncClient(timeout=30) as http:
            for step in range(3):
                got = await http.post(f"{agent.base}/chat/completions",
                                      json={"model": "m", "messages": messages, "tools": TOOLS},
                                      headers={"Authorization": f"Bearer {agent.session['key']}"})
                messages += [got.json()["choices"][0]["message"], {"role": "user", "content": f"go on {step}"}]

    async def all_of_them() -> None:
        await asyncio.gather(*(converse(a, i) for i, a in enumerate(agents)))

    asyncio.run(all_of_them())
    for i, agent in enumerate(agents):
        turns = agent.trace().turns
        assert [t.parent_id for t in turns] == [None, turns[0].node_id, turns[1].node_id]
        assert turns[0].request.messages[0]["content"] == f"task {i}"


def test_client_api(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    async def run() -> None:
        async with ProxyClient(fake_proxy.url, fake_proxy.admin_token) as client:
            info = await client.create_session({"task": "x"}, max_turns=3, max_tokens_per_turn=10)
            assert info.openai_base_url.endswith(f"/s/{info.id}/v1")
            async with httpx.AsyncClient() as http:
                got = await http.post(f"{info.openai_base_url}/chat/completions",
                                      json={"model": "m", "messages": [{"role": "user", "content": "q"}],
                                            "max_tokens": 99}, headers={"Authorization": f"Bearer {info.key}"})
            assert got.status_code == 200
            assert fake_engine.requests[-1]["sampling_params"]["max_tokens"] == 10
            trace = await client.get_trace(info.id)
            assert len(trace.turns) == 1 and trace.metadata["task"] == "x"
            assert trace.turns[0].sampling.max_tokens == 10
            await client.set_policy_version(4)
            assert (await client.health()).policy_version == 4
            assert [s.id for s in await client.list_sessions()] == [info.id]
            closed = await client.close_session(info.id)
            assert closed.closed is True
            await client.delete_session(info.id)
            with pytest.raises(ProxyClientError) as missing:
                await client.get_trace(info.id)
            assert missing.value.status == 404

    asyncio.run(run())


def test_a_seeded_session_seeds_every_call_the_agent_does_not(fake_proxy: RunningProxy,
                                                               fake_engine: FakeEngine) -> None:
    """The session's seed reaches the engine as each call's own seed (`call_seed(seed, n)` for the n-th call,
    a retry of a failed call keeps its number); an agent's own seed wins; an unseeded session sends none."""
    async def run() -> tuple[list, list]:
        async with ProxyClient(fake_proxy.url, fake_proxy.admin_token) as client, httpx.AsyncClient() as http:
            seeded = await client.create_session(seed=7)
            plain = await client.create_session()
            sent = []
            for info, own in ((seeded, None), (seeded, None), (seeded, 5), (plain, None)):
                body = {"model": "m", "messages": [{"role": "user", "content": f"q{len(sent)}"}], "max_tokens": 64,
                        **({"seed": own} if own is not None else {})}
                got = await http.post(f"{info.openai_base_url}/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {info.key}"})
                assert got.status_code == 200
                sent.append(fake_engine.requests[-1]["sampling_params"].get("seed"))
            turns = (await client.get_trace(seeded.id)).turns
            return sent, [turn.sampling.seed for turn in turns]

    sent, recorded = asyncio.run(run())
    assert sent == [call_seed(7, 1), call_seed(7, 2), 5, None]
    assert recorded == sent[:3]
    assert call_seed(7, 1) != call_seed(7, 2) and call_seed(7, 1) == call_seed(7, 1) < 2**31


def test_policy_version_falls_back_to_the_admin_value(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    assert agent.chat([{"role": "user", "content": "a"}]).status_code == 200
    httpx.post(f"{fake_proxy.url}/admin/policy_version", json={"version": 12}, headers=agent.admin)
    assert agent.chat([{"role": "user", "content": "b"}]).status_code == 200
    fake_engine.version = 13
    assert agent.chat([{"role": "user", "content": "c"}]).status_code == 200
    assert [t.policy_version for t in agent.trace().turns] == [None, 12, 13]


def test_a_sync_during_a_reply_records_both_versions_and_rows_use_each(fake_proxy: RunningProxy,
                                                                        fake_engine: FakeEngine) -> None:
    from harness_rl.learner.rows import trace_rows

    agent = Agent(fake_proxy)
    httpx.post(f"{fake_proxy.url}/admin/policy_version", json={"version": 7}, headers=agent.admin)
    fake_engine.script.append(Scripted(content="straddles a sync", synced_to=8))  # vLLM says "default", then "8"
    assert agent.chat([{"role": "user", "content": "a"}]).status_code == 200
    turn = agent.trace().turns[0]
    n = len(turn.completion_token_ids)
    assert [(s.version, s.start, s.end) for s in turn.version_spans] == [(7, 0, 1), (8, 1, n)]
    assert turn.policy_version == 7 and turn.token_versions == [7] + [8] * (n - 1)
    (row,) = trace_rows(agent.trace())
    assert row.versions[-n:] == [7] + [8] * (n - 1)  # the staleness filter and IS weights see each token's version


def test_step_budget_answers_without_the_engine(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy, max_turns=2)
    messages = [{"role": "user", "content": "go"}]
    for _ in range(2):
        assert agent.chat(messages, tools=TOOLS).status_code == 200
    calls = len(fake_engine.requests)
    over = agent.chat(messages, tools=TOOLS)
    assert over.status_code == 200
    assert over.json()["choices"][0]["message"]["content"] == BUDGET_MESSAGE
    assert over.json()["choices"][0]["finish_reason"] == "stop"
    streamed = agent.chat(messages, tools=TOOLS, stream=True)
    assert BUDGET_MESSAGE in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    assert len(fake_engine.requests) == calls
    trace = agent.trace()
    assert len(trace.turns) == 2 and trace.metadata["budget_stops"] == 2


def test_reject_truncation_policy(fake_engine_server: Served, fake_engine: FakeEngine, tmp_path: Path) -> None:
    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path),
                         sampling=SamplingPolicy(truncation="reject"))
    with serve_proxy(config) as running:
        agent = Agent(running)
        refused = agent.chat([{"role": "user", "content": "x"}], top_p=0.9)
        assert refused.status_code == 400 and "top_p" in refused.json()["error"]["message"]
        assert agent.chat([{"role": "user", "content": "x"}], top_p=1.0).status_code == 200
        assert len(agent.trace().turns) == 1


def test_pause_holds_new_calls_until_resume(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            admin = agent.admin
            fake_engine.script.append(Scripted(delay_s=0.3))
            one = {"model": "m", "messages": [{"role": "user", "content": "1"}]}
            in_flight = asyncio.create_task(http.post(f"{agent.base}/chat/completions", json=one, headers=agent.auth))
            while not fake_engine.requests:  # the call is at the engine (it answers after 0.3 s)
                await asyncio.sleep(0.01)
            paused = await http.post(f"{fake_proxy.url}/admin/pause", headers=admin)
            assert paused.json() == {"paused": True, "in_flight": 0}
            trace = await http.get(f"{fake_proxy.url}/sessions/{agent.session['id']}/trace", headers=admin)
            assert len(TrainingTrace.from_json(trace.content).turns) == 1  # the pause waited for it to be recorded
            assert (await in_flight).status_code == 200
            held = asyncio.create_task(http.post(f"{agent.base}/chat/completions",
                                                 json={"model": "m", "messages": [{"role": "user", "content": "2"}]},
                                                 headers=agent.auth))
            await asyncio.sleep(0.2)
            assert not held.done() and len(fake_engine.requests) == 1
            await http.post(f"{fake_proxy.url}/admin/resume", headers=admin)
            assert (await held).status_code == 200

    asyncio.run(run())


def test_restart_recovers_every_turn(fake_engine_server: Served, fake_engine: FakeEngine, tmp_path: Path) -> None:
    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path), admin_token="admin")
    with serve_proxy(config) as running:
        agent = Agent(running, metadata={"k": 1})
        messages = [{"role": "user", "content": "start"}]
        for i in range(3):
            got = agent.chat(messages, tools=TOOLS).json()
            messages += [got["choices"][0]["message"], {"role": "user", "content": f"more {i}"}]
        before = agent.trace()
    with serve_proxy(config) as again:
        agent.proxy = again
        agent.base = agent.base.replace(running.url, again.url)
        after = agent.trace()
        assert after.to_json() == before.to_json()
        got = httpx.post(f"{again.url}/v1/chat/completions", json={"model": "m", "messages": messages, "tools": TOOLS},
                         headers={"x-api-key": agent.session["key"]})
        assert got.status_code == 200
        turns = agent.trace().turns
        assert len(turns) == 4 and turns[3].parent_id == turns[2].node_id


def test_torn_log_tail_is_dropped(fake_engine_server: Served, fake_engine: FakeEngine, tmp_path: Path) -> None:
    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path), admin_token="admin")
    with serve_proxy(config) as running:
        agent = Agent(running)
        agent.chat([{"role": "user", "content": "one"}])
    log = tmp_path / f"{agent.session['id']}.jsonl"
    with log.open("ab") as f:
        f.write(b'{"kind":"turn","node_id":"abc')  # a kill mid-write
    with serve_proxy(config) as again:
        agent.proxy = again
        assert len(agent.trace().turns) == 1
        agent.base = agent.base.replace(running.url, again.url)
        assert agent.chat([{"role": "user", "content": "two"}]).status_code == 200
        assert len(agent.trace().turns) == 2


def test_client_disconnect_mid_reply_keeps_turn_with_mask_zero(
        fake_proxy: RunningProxy, fake_engine: FakeEngine,
) -> None:
    """The agent gives up while the engine works; the call runs on, and its turn is kept as context (the streamed
    case, where the generation is cut short: test_proxy_streaming)."""
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(delay_s=0.5))
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{agent.base}/chat/completions", headers=agent.auth, timeout=0.2,
                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    deadline = time.monotonic() + 60  # the engine answers 0.5 s in; a busy machine records and marks it later
    while time.monotonic() < deadline and not any(t.delivered is False for t in agent.trace().turns):
        time.sleep(0.05)
    (turn,) = agent.trace().turns
    assert turn.delivered is False
    assert turn.loss_mask == [0] * len(turn.loss_mask) and turn.completion_token_ids


# ------------------------------------------------------------------------------------------ faults


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "expected object, got array"),
    (b'{"model": "m"}', "missing required field messages"),
    (b'{"model": "m", "messages": "hi"}', "messages: expected array"),
    (b'{"model": "m", "messages": [{"content": "no role"}]}', "role"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "max_tokens"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n: 2 is not supported"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}', "tools"),
])
def test_bad_openai_requests_get_400(
        fake_proxy: RunningProxy, fake_engine: FakeEngine, body: bytes, message: str,
) -> None:
    agent = Agent(fake_proxy)
    got = httpx.post(f"{agent.base}/chat/completions", content=body,
                     headers={"Content-Type": "application/json", **agent.auth})
    assert got.status_code == 400
    assert message in got.json()["error"]["message"]
    assert fake_engine.requests == []
    assert agent.chat([{"role": "user", "content": "still fine"}]).status_code == 200


def test_closed_and_deleted_sessions(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    httpx.post(f"{fake_proxy.url}/sessions/{agent.session['id']}/close", headers=agent.admin)
    closed = agent.chat([{"role": "user", "content": "x"}])
    assert closed.status_code == 409 and "closed" in closed.json()["error"]["message"]
    assert len(agent.trace().turns) == 0
    assert httpx.delete(f"{fake_proxy.url}/sessions/{agent.session['id']}", headers=agent.admin).status_code == 200
    assert agent.chat([{"role": "user", "content": "x"}]).status_code == 404
    assert httpx.get(f"{fake_proxy.url}/sessions/{agent.session['id']}", headers=agent.admin).status_code == 404


def test_body_over_the_limit_is_413(fake_engine_server: Served, fake_engine: FakeEngine, tmp_path: Path) -> None:
    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path), max_body_mb=0.01)
    with serve_proxy(config) as running:
        agent = Agent(running)
        huge = agent.chat([{"role": "user", "content": "x" * 20_000}])
        assert huge.status_code == 413 and "MB" in huge.json()["error"]["message"]
        big = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 20_000}]}
        anthropic = httpx.post(f"{agent.session['anthropic_base_url']}/v1/messages", json=big,
                               headers={"x-api-key": agent.session["key"]})
        assert anthropic.status_code == 413 and anthropic.json()["error"]["type"] == "request_too_large"
        assert agent.chat([{"role": "user", "content": "small"}]).status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_down_is_502_naming_the_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with serve_proxy(ProxyConfig(upstream=url, store_dir=str(tmp_path), retries=1, upstream_model="m")) as running:
        agent = Agent(running)
        got = agent.chat([{"role": "user", "content": "x"}])
        assert got.status_code == 502 and url in got.json()["error"]["message"]
        assert httpx.get(f"{running.url}/health").json()["engines"][0]["url"] == url  # the proxy itself stays up


def test_engine_timeout_is_504(fake_engine_server: Served, fake_engine: FakeEngine, tmp_path: Path) -> None:
    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path), request_timeout_s=0.3, retries=0)
    with serve_proxy(config) as running:
        agent = Agent(running)
        agent.chat([{"role": "user", "content": "warm"}])  # learns the served model name
        fake_engine.script.append(Scripted(delay_s=1.0))
        got = agent.chat([{"role": "user", "content": "x"}])
        assert got.status_code == 504 and fake_engine_server[1] in got.json()["error"]["message"]


def test_engine_without_capture_is_502_telling_how_to_start_vllm(
        fake_proxy: RunningProxy, fake_engine: FakeEngine,
) -> None:
    fake_engine.capture = False
    agent = Agent(fake_proxy, max_turns=1)
    got = agent.chat([{"role": "user", "content": "x"}])
    message = got.json()["error"]["message"]
    assert got.status_code == 502
    assert "--logprobs-mode processed_logprobs --return-tokens-as-token-ids" in message
    fake_engine.capture = True
    assert agent.chat([{"role": "user", "content": "x"}]).status_code == 200  # the failed call did not spend budget


def test_retries_honour_retry_after(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.extend([Scripted(status=503, retry_after="0.4"), Scripted(status=429, retry_after="0")])
    started = time.monotonic()
    got = agent.chat([{"role": "user", "content": "x"}])
    assert got.status_code == 200
    assert time.monotonic() - started >= 0.4
    assert len(fake_engine.requests) == 3
    assert agent.trace().turns[0].metadata["engine_attempts"] == 3


def test_retries_give_up_with_502(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.extend([Scripted(status=500, retry_after="0")] * 3)
    got = agent.chat([{"role": "user", "content": "x"}])
    assert got.status_code == 502 and "HTTP 500" in got.json()["error"]["message"]


def test_engine_400_passes_through_as_400(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(status=400))
    got = agent.chat([{"role": "user", "content": "x"}])
    assert got.status_code == 400 and "scripted 400" in got.json()["error"]["message"]


def test_models_route(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    got = httpx.get(f"{agent.base}/models", headers=agent.auth)
    assert got.status_code == 200 and got.json()["data"][0]["id"] == "fake"


def test_unknown_route_is_a_json_404(fake_proxy: RunningProxy) -> None:
    got = httpx.post(f"{fake_proxy.url}/v1/embeddings", json={})
    assert got.status_code == 404 and "Not Found" in got.json()["error"]["message"]
    assert httpx.get(f"{fake_proxy.url}/v1/messages").status_code == 405


def test_slow_engine_gets_keepalives_then_the_answer(fake_engine_server: Served, fake_engine: FakeEngine,
                                                     tmp_path: Path) -> None:
    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path), keepalive_s=0.1, retries=0)
    with serve_proxy(config) as running:
        agent = Agent(running)
        agent.chat([{"role": "user", "content": "warm"}])
        fake_engine.script.append(Scripted(delay_s=0.45, content="slow but sure"))
        got = agent.chat([{"role": "user", "content": "x"}], stream=True)
        assert got.status_code == 200
        blocks = got.text.split("\n\n")
        assert blocks[0] == ": keepalive" and blocks.count(": keepalive") >= 3
        # the answer streams as the engine samples it: its text may arrive over several chunks
        chunks = [json.loads(b.removeprefix("data: ")) for b in blocks if b.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "slow but sure"
        assert got.text.endswith("data: [DONE]\n\n")
        client = openai.OpenAI(base_url=agent.base, api_key=agent.session["key"])
        fake_engine.script.append(Scripted(delay_s=0.3, content="parsed"))
        chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}],
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "parsed"
        fake_engine.script.append(Scripted(delay_s=0.3, status=500))
        failed = agent.chat([{"role": "user", "content": "z"}], stream=True)
        assert failed.status_code == 200 and '"error"' in failed.text and "HTTP 500" in failed.text
        with pytest.raises(openai.APIError):
            fake_engine.script.append(Scripted(delay_s=0.3, status=500))
            list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "w"}], stream=True))
        assert len(agent.trace().turns) == 3
