"""Token in, token out through the proxy: replies go back as the sampled ids, so a conversation is one chain.

The fake engine's template can drift (re-render a reply to other ids, as BPE and templates do) or drop
an earlier reply's reasoning once new messages follow (as Qwen3's does); splicing must keep the chain
exact through both, and a rendered turn must say where and why its prompt broke.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest
from fake_engine import CALL, IM_END, RETURN, FakeEngine, Scripted
from proxy_agent import TOOLS, Agent

from harness_rl.run.stack import serve_proxy
from harness_rl.trace import TrainingTrace
from proxy.capture.tito import DIGEST, Remembered, ReplyIndex
from proxy.config import ProxyConfig
from proxy.server.app import RunningProxy

TASK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"}]


def converse(agent: Agent, fake: FakeEngine, turns: int, edit=lambda message: message) -> list[dict]:
    """An agent loop: every reply goes back as the assistant message (through `edit`), then a tool result."""
    messages = list(TASK)
    for step in range(turns):
        fake.script.append(Scripted(tool=("bash", {"cmd": f"ls {step}"}), reasoning=f"step {step}"))
        got = agent.chat(messages, tools=TOOLS)
        assert got.status_code == 200, got.text
        reply = got.json()["choices"][0]["message"]
        messages += [edit(reply), {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                                   "content": f"file{step}.txt"}]
    return messages


def assert_one_chain(trace: TrainingTrace, fake: FakeEngine) -> None:
    turns = trace.validate().turns
    assert [t.prompt_source for t in turns] == ["rendered"] + ["spliced"] * (len(turns) - 1)
    assert all(t.role == "agent" and t.prefix_break is None for t in turns)
    for parent, child in zip(turns, turns[1:], strict=False):
        assert child.parent_id == parent.node_id and child.prompt_token_ids[:len(parent.sequence)] == parent.sequence
        # what follows the sampled reply is exactly the template's rendering of the new messages, rendered alone
        # and checked against the whole conversation's rendering on every turn
        whole = fake.render(child.request.messages, child.request.tools)
        assert child.prompt_token_ids[len(parent.sequence):] == whole[-len(child.prompt_token_ids)
                                                                      + len(parent.sequence):]
        assert child.metadata["render"] == "suffix, checked"


@pytest.mark.parametrize("drift", [False, True])
def test_replies_sent_back_are_spliced_so_every_turn_extends_the_last(fake_proxy: RunningProxy,
                                                                      fake_engine: FakeEngine, drift: bool) -> None:
    fake_engine.drift = drift
    agent = Agent(fake_proxy)
    converse(agent, fake_engine, 4)
    trace = agent.trace()
    assert_one_chain(trace, fake_engine)
    assert trace.turns[0].completion_token_ids[-1] == IM_END  # the fake's template closes a turn with IM_END alone


def test_the_spliced_tail_is_the_templates_rendering_of_the_new_messages_only(fake_proxy: RunningProxy,
                                                                              fake_engine: FakeEngine) -> None:
    fake_engine.drift = True
    agent = Agent(fake_proxy)
    messages = converse(agent, fake_engine, 2)
    t1, t2 = agent.trace().turns
    tail = fake_engine.render(messages[3:4], None)[:-2]  # the tool result, without the generation prompt
    assert t2.prompt_token_ids == t1.sequence + tail + fake_engine.render([], None)


def test_with_token_in_off_a_drifting_template_breaks_every_chain_and_says_where(
        fake_engine_server: tuple, fake_engine: FakeEngine, tmp_path: Path) -> None:
    fake_engine.drift = True
    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path), tito=False)
    with serve_proxy(config) as running:
        agent = Agent(running)
        converse(agent, fake_engine, 3)
        turns = agent.trace().validate().turns
    assert [t.prompt_source for t in turns] == ["rendered"] * 3
    assert [t.parent_id for t in turns] == [None, None, None]
    for earlier, later in zip(turns, turns[1:], strict=False):
        assert later.prefix_break.cause == "retokenized" and later.prefix_break.against == earlier.node_id
        assert later.prefix_break.position == len(earlier.prompt_token_ids)  # where the template re-rendered it


def test_a_template_that_drops_earlier_reasoning_still_splices(fake_proxy: RunningProxy,
                                                               fake_engine: FakeEngine) -> None:
    fake_engine.drop_reasoning = True
    agent = Agent(fake_proxy)
    converse(agent, fake_engine, 3)
    assert_one_chain(agent.trace(), fake_engine)


def test_a_generation_prompt_the_replies_do_not_start_with_still_splices(fake_proxy: RunningProxy,
                                                                          fake_engine: FakeEngine) -> None:
    fake_engine.open_thinking = True  # the next conversation's rendering does not start with the last one's
    agent = Agent(fake_proxy)
    converse(agent, fake_engine, 3)
    turns = agent.trace().validate().turns
    assert [t.prompt_source for t in turns] == ["rendered", "spliced", "spliced"]
    assert [t.parent_id for t in turns[1:]] == [t.node_id for t in turns[:-1]]


def test_an_engine_that_renders_no_conversation_ending_with_the_assistant_answers_every_call(
        fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """vLLM with Mistral's own tokenizer refuses the probe that learns how the template closes a turn (its last
    message the assistant's): each later turn is rendered whole, its break named, and the agent never sees it."""
    fake_engine.user_last = True
    agent = Agent(fake_proxy)
    converse(agent, fake_engine, 3)
    turns = agent.trace().validate().turns
    assert [t.prompt_source for t in turns] == ["rendered"] * 3
    assert [t.prefix_break.cause for t in turns[1:] if t.prefix_break is not None] == ["template_dropped"] * 2
    assert fake_engine.routes["/v1/chat/completions/render"] == 3 + 3  # the refused probe asked once (three renders)


def test_an_engine_whose_render_always_opens_the_next_turn_splices_after_the_stop_token_each_reply_sampled(
        fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """vLLM renders gpt-oss's harmony with the assistant's opening whatever add_generation_prompt says, so no probe
    shows a closing apart from it; its model samples `<|call|>` after a tool call (the template writes the same)
    and `<|return|>` after a final answer (the template writes `<|end|>`). The proxy learns the opening apart
    and splices the new messages right after the stop token each reply sampled, or after the template's end of
    turn for a reply cut short: every turn continues the last, its new part exactly the template's."""
    fake_engine.always_opens = True
    agent = Agent(fake_proxy)
    messages = converse(agent, fake_engine, 3)
    for scripted, after in ((Scripted(content="Two files."), "Thanks."),
                            (Scripted(content="You are welcome", finish_reason="length"), "Bye.")):
        fake_engine.script.append(scripted)
        got = agent.chat(messages, tools=TOOLS)
        assert got.status_code == 200, got.text
        messages += [got.json()["choices"][0]["message"], {"role": "user", "content": after}]
    assert agent.chat(messages, tools=TOOLS).status_code == 200
    turns = agent.trace().validate().turns
    assert [t.prompt_source for t in turns] == ["rendered"] + ["spliced"] * 5
    for parent, child in zip(turns, turns[1:], strict=False):
        assert child.parent_id == parent.node_id and child.prompt_token_ids[:len(parent.sequence)] == parent.sequence
        assert child.metadata["render"] == "suffix, checked" and child.prefix_break is None
    ends = [t.completion_token_ids[-1] for t in turns[:5]]
    assert ends == [CALL, CALL, CALL, RETURN, ends[4]] and ends[4] not in (CALL, RETURN, IM_END)
    for turn in turns[1:4]:  # after tool calls, the template writes exactly what was sampled
        assert turn.prompt_token_ids == fake_engine.render(turn.request.messages, turn.request.tools)
    for parent, child in zip(turns, turns[1:], strict=False):
        whole = fake_engine.render(child.request.messages, child.request.tools)
        new = child.prompt_token_ids[len(parent.sequence):]
        closed = [IM_END] if parent is turns[4] else []  # the reply cut short is closed as the template closes it
        assert new[:len(closed)] == closed and new[len(closed):] == whole[len(whole) - len(new) + len(closed):]
    at = len(turns[3].sequence) - 1  # the final answer's end: sampled RETURN kept where the template writes IM_END
    assert turns[4].prompt_token_ids[at] == RETURN
    assert fake_engine.render(turns[4].request.messages, turns[4].request.tools)[at] == IM_END
    assert fake_engine.routes["/v1/chat/completions/render"] == 1 + 3 + 5 * 3  # first turn, probe once, 3 a turn


def test_an_engine_whose_render_always_opens_renders_a_reply_a_stop_string_may_have_ended_whole(
        fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """With stop strings asked, a harmony reply's last id may be text the stop string cut, not its stop token: the
    proxy cannot say how it closes, and renders the next turn whole, its break named."""
    fake_engine.always_opens = True
    agent = Agent(fake_proxy)
    messages = list(TASK)
    for step in range(2):
        fake_engine.script.append(Scripted(tool=("bash", {"cmd": f"ls {step}"})))
        reply = agent.chat(messages, tools=TOOLS, stop=["</done>"]).json()["choices"][0]["message"]
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "a"}]
    turns = agent.trace().validate().turns
    assert [t.prompt_source for t in turns] == ["rendered", "rendered"]
    assert turns[1].prompt_token_ids == fake_engine.render(turns[1].request.messages, turns[1].request.tools)
    assert turns[1].prefix_break is not None and turns[1].prefix_break.cause == "template_dropped"


def test_tool_call_arguments_reserialised_and_reasoning_dropped_by_the_agent_still_match(
        fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    def agent_rewrites(message: dict) -> dict:
        calls = [{**c, "function": {**c["function"], "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                                                               separators=(",", ":"))}}
                 for c in message["tool_calls"]]
        return {"role": "assistant", "content": message["content"], "tool_calls": calls}

    agent = Agent(fake_proxy)
    converse(agent, fake_engine, 3, edit=agent_rewrites)
    assert_one_chain(agent.trace(), fake_engine)


def test_an_edited_reply_is_rendered_and_names_the_turn_it_edited(fake_proxy: RunningProxy,
                                                                  fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(content="I will look."))
    first = agent.chat(TASK).json()["choices"][0]["message"]
    edited = [*TASK, {**first, "content": "I will look carefully."}, {"role": "user", "content": "go on"}]
    assert agent.chat(edited).status_code == 200
    rewritten = [TASK[0], {"role": "user", "content": "list all files"}]
    assert agent.chat(rewritten).status_code == 200
    t1, t2, t3 = agent.trace().validate().turns
    assert (t2.prompt_source, t2.prefix_break.cause, t2.prefix_break.against) == ("rendered", "reply_edited",
                                                                                 t1.node_id)
    assert (t3.prompt_source, t3.prefix_break.cause) == ("rendered", "rewritten_history")
    assert t3.prefix_break.position < len(t1.prompt_token_ids)
    assert [t.role for t in (t1, t2, t3)] == ["agent"] * 3


def test_the_same_request_resent_is_a_discarded_retry_and_different_requests_are_siblings(
        fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    for _ in range(2):  # the agent timed out on the first answer and asked again
        fake_engine.script.append(Scripted(tool=("bash", {"cmd": "ls"})))
        reply = agent.chat(TASK, tools=TOOLS).json()["choices"][0]["message"]
    messages = [*TASK, reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "a"}]
    assert agent.chat(messages, tools=TOOLS).status_code == 200  # it went on from the second answer
    fork = [*TASK, {"role": "user", "content": "also count them"}]
    assert agent.chat(fork, tools=TOOLS).status_code == 200  # another request: a sibling, not a retry
    first, second, third, sibling = agent.trace().validate().turns
    assert (first.role, second.role, third.role, sibling.role) == ("discarded", "agent", "agent", "agent")
    assert third.parent_id == second.node_id and third.prompt_source == "spliced"


def test_a_retry_the_agent_went_on_from_is_never_discarded(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    replies = []
    for command in ("ls", "ls -a"):  # two different answers to the same request
        fake_engine.script.append(Scripted(tool=("bash", {"cmd": command})))
        replies.append(agent.chat(TASK, tools=TOOLS).json()["choices"][0]["message"])
    first_reply = replies[0]  # the agent went on from the first answer, not the newest
    result = {"role": "tool", "tool_call_id": first_reply["tool_calls"][0]["id"], "content": "a"}
    messages = [*TASK, first_reply, result]
    assert agent.chat(messages, tools=TOOLS).status_code == 200
    first, second, third = agent.trace().validate().turns
    assert (first.role, second.role, third.role) == ("agent", "discarded", "agent")
    assert third.parent_id == first.node_id


def test_anthropic_blocks_sent_back_splice(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    fake_engine.drift = True
    agent = Agent(fake_proxy)
    client = anthropic.Anthropic(base_url=agent.session["anthropic_base_url"], api_key=agent.session["key"])
    tools = [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}]
    messages: list[dict] = [{"role": "user", "content": "list files"}]
    for step in range(3):
        fake_engine.script.append(Scripted(tool=("bash", {"cmd": f"ls {step}"}), reasoning=f"think {step}"))
        answer = client.messages.create(model="m", max_tokens=64, system="be brief", messages=messages, tools=tools)
        blocks = [b.model_dump(exclude_none=True) for b in answer.content]
        tool_use = next(b for b in blocks if b["type"] == "tool_use")
        messages += [{"role": "assistant", "content": blocks},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"],
                                                   "content": f"file{step}"}]}]
    turns = agent.trace().validate().turns
    assert [t.prompt_source for t in turns] == ["rendered", "spliced", "spliced"]
    assert [t.parent_id for t in turns[1:]] == [t.node_id for t in turns[:-1]]


def test_splicing_costs_one_render_more_and_no_more_engine_calls(fake_proxy: RunningProxy,
                                                                fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    converse(agent, fake_engine, 3)
    assert len(fake_engine.requests) == 3  # one generate per turn
    got = httpx.get(f"{fake_proxy.url}/sessions/{agent.session['id']}/trace?format=full", headers=agent.admin)
    assert [t["prompt_source"] for t in got.json()["turns"]] == ["rendered", "spliced", "spliced"]


def test_a_spliced_turn_renders_only_the_reply_and_the_messages_after_it(fake_engine_server: tuple,
                                                                          fake_engine: FakeEngine,
                                                                          tmp_path: Path) -> None:
    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path), splice_check_tokens=0)
    with serve_proxy(config) as running:
        agent = Agent(running)
        converse(agent, fake_engine, 6)
        turns = agent.trace().validate().turns
    assert [t.prompt_source for t in turns] == ["rendered"] + ["spliced"] * 5
    assert [t.metadata.get("render") for t in turns] == [None] + ["suffix"] * 5  # never checked
    for parent, child in zip(turns, turns[1:], strict=False):  # the same ids as the whole rendering's tail
        whole = fake_engine.render(child.request.messages, child.request.tools)
        new = len(child.prompt_token_ids) - len(parent.sequence)
        assert child.prompt_token_ids[:len(parent.sequence)] == parent.sequence
        assert child.prompt_token_ids[len(parent.sequence):] == whole[len(whole) - new:]
        assert whole[len(whole) - new - 1] == IM_END  # right after the reply's closing
    # every render after the first turn's: the closing probe with the next turn opened (2 messages), then the probe,
    # the reply and the one tool result after it, however long the conversation has grown (the probe's own
    # rendering and the template's closing are learned once)
    sizes = [len(body["messages"]) for body in fake_engine.conversations]
    assert sizes[0] == len(TASK) and sizes[1] == 2 and sizes[2:] == [3] * 5


def test_a_template_that_renders_a_message_by_its_place_is_caught_and_the_session_renders_whole(
        fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    fake_engine.numbered_tools = True  # a tool result renders with its number in the whole conversation
    agent = Agent(fake_proxy)
    converse(agent, fake_engine, 4)
    turns = agent.trace().validate().turns
    assert [t.prompt_source for t in turns] == ["rendered"] + ["spliced"] * 3
    assert [t.parent_id for t in turns[1:]] == [t.node_id for t in turns[:-1]]
    for parent, child in zip(turns, turns[1:], strict=False):  # the prompts are the template's all the same
        whole = fake_engine.render(child.request.messages, child.request.tools)
        new = len(child.prompt_token_ids) - len(parent.sequence)
        assert child.prompt_token_ids[len(parent.sequence):] == whole[len(whole) - new:]
    # the second tool result alone renders as the first: seen at the check on turn 3, rendered whole from then on
    assert [t.metadata.get("render") for t in turns] == [None, "suffix, checked", "whole", "whole"]
    assert "differ from the end of the whole conversation" in turns[2].metadata["render_mismatch"]
    assert "render_mismatch" not in turns[3].metadata


def test_checks_cover_a_sessions_first_splices_then_one_in_32_or_the_budget_per_turn() -> None:
    """A steady short conversation pays a check on one turn in 32 after its first four; a long one about the
    budget's worth of tokens a turn: one turn in N when N times the budget long."""
    index = ReplyIndex()
    due = [index.check_due(500, 1000) for _ in range(4 + 64)]
    assert [i for i, d in enumerate(due) if d] == [0, 1, 2, 3, 35, 67]
    long = ReplyIndex()
    due = [long.check_due(64_000, 1000) for _ in range(4 + 128)]
    assert [i for i, d in enumerate(due) if d] == [0, 1, 2, 3, 67, 131]
    assert not any(ReplyIndex().check_due(100, 0) for _ in range(5))  # 0: never
    assert all(ReplyIndex().check_due(10**6, None) for _ in range(5))  # None: always


def test_the_closest_earlier_call_is_the_newest_sharing_the_most_leading_messages() -> None:
    def digests(*messages: str) -> bytes:
        return b"".join(m.encode().ljust(DIGEST, b".") for m in messages)

    index = ReplyIndex()
    for node_id, messages in [("a", "sut"), ("b", "su"), ("c", "sux"), ("d", "sv"), ("e", "su")]:
        index.add(node_id, Remembered(digests(*messages), None, None))
    assert index.closest(digests(*"sutz")) == ("a", 3)  # only "a" shares three
    assert index.closest(digests(*"suq")) == ("e", 2)  # a, b, c and e share two: the newest
    assert index.closest(digests(*"sv")) == ("d", 2)
    assert index.closest(digests(*"s")) == ("e", 1)  # a request shorter than the calls it matches
    assert index.closest(digests(*"zsu")) is None  # nothing shared from the start
    assert index.closest(b"") is None
