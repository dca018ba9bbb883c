"""Prompts rendered in the proxy with the model's own tokenizer.json and chat template (`proxy.capture.local_render`):
the same ids as the engine's rendering (the embedded engine here, vLLM in test_vllm_suffix.py), never used when
the files are not what the engine runs, and one engine round trip fewer per call."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from fake_engine import FakeEngine, run_fake_engine
from proxy_agent import TOOLS, Agent

from harness_rl.run.stack import serve_proxy
from harness_rl.trace import TrainingTrace
from proxy.capture.local_render import LocalRendering, LocalTemplate, _message
from proxy.config import ProxyConfig
from proxy.upstream.client import ChatRender, EngineClient, Rendered

CALL = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls -la"}'}}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ünïcödé 😀 <tool_call> <|im_start|>x"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
     {"role": "tool", "tool_call_id": "call_2",
      "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
    [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok", "reasoning": "think"},
     {"role": "user", "content": "more"}],
    [{"role": "user", "content": "go"}, {"role": "assistant", "content": "x", "tool_calls": [
        {**CALL, "function": {"name": "bash", "arguments": "not json"}}]}],
]


def request(messages: list[dict[str, Any]], tools: list[Any] | None, generation: bool = True) -> ChatRender:
    return ChatRender(messages=[msgspec.Raw(msgspec.json.encode(m)) for m in messages],
                      add_generation_prompt=generation,
                      tools=msgspec.Raw(msgspec.json.encode(tools)) if tools else None)


async def both(model_dir: Path, url: str, requests: list[ChatRender]) -> tuple[LocalRendering,
                                                                           list[tuple[Rendered | None, Rendered]]]:
    engine = EngineClient(url, timeout_s=60, retries=0)
    await engine.start()
    try:
        local = LocalRendering(LocalTemplate.load(model_dir), engine)
        await local.ready()
        return local, [(local.render(r), await engine.render(r)) for r in requests]
    finally:
        await engine.close()


def test_the_proxy_renders_every_conversation_as_the_engine_does(tiny_model_dir: Path, engine_url: str) -> None:
    requests = [request(c, tools, generation) for c in CONVERSATIONS for tools in (None, TOOLS)
                for generation in (True, False)]
    local, renders = asyncio.run(both(tiny_model_dir, engine_url, requests))
    assert local.off is None and local.format == "string"  # the embedded engine hands contents over as sent
    for ours, engines in renders:
        assert ours is not None and ours == engines


def test_a_tokenizer_file_that_is_not_what_the_engine_loads_is_never_used(tiny_model_dir: Path, tmp_path: Path,
                                                                          engine_url: str) -> None:
    # as `tokenizers` trains it, without the normalizer and pre-tokenizer transformers gives Qwen2's class: it cuts
    # "\n\n" into two ids where the engine has one
    for item in tiny_model_dir.iterdir():
        (tmp_path / item.name).symlink_to(item)
    trained = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    trained |= {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                                      "trim_offsets": True, "use_regex": True}}
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.json").write_text(json.dumps(trained))
    local, renders = asyncio.run(both(tmp_path, engine_url, [request(CONVERSATIONS[3], TOOLS)]))
    assert local.off is not None and "probe conversation differs" in local.off
    assert renders == [(None, renders[0][1])]


def test_pieces_between_added_tokens_encode_as_the_whole_text(tiny_model_dir: Path) -> None:
    template = LocalTemplate.load(tiny_model_dir)
    specials = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "\n", " ", "  "]
    words = ["def", " f(x):", "ünï", "😀", "\n\n", "12345", "return", "<|im_sta", "rt|>", "é", "\t", "x"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(specials if rng.random() < 0.3 else words) for _ in range(rng.randrange(1, 40)))
        assert template.encode(text) == template.tokenizer.encode(text, add_special_tokens=False).ids, repr(text)


# The reads chat templates make: attributes and keys of messages (some named like dict methods), loop state,
# neighbours by index, tools as JSON (cached and not), defaults for what is missing.
READS = """{%- for message in messages -%}
{{ loop.index0 }}/{{ loop.length }} {{ loop.first }} {{ loop.last }} {{ loop.revindex }} {{ loop.previtem is defined }}
{{ message.role }} {{ message['role'] }} {{ message.content if message.content is string else message.content|length }}
{{ message.missing is defined }} {{ message.missing | default('none') }} {{ message.get('reasoning', '-') }}
{{ message.keys is defined }} {{ message['keys'] | default('no key') }} {{ message.items() | list | length }}
{%- for call in message.tool_calls or [] %}{{ call.function.name }} {{ call.function.arguments | tojson }}
{% endfor %}
{%- if not loop.first %} after {{ messages[loop.index0 - 1].role }}{% endif %}
{% endfor -%}
{%- for tool in tools or [] %}{{ tool | tojson }} {{ tool | tojson(indent=2) }} {{ tool.function.name }}
{% endfor -%}"""
UNSAFE = ["{{ messages[0].__class__.__mro__ }}", "{{ messages[0].update({'role': 'x'}) }}", "{{ messages.append(1) }}",
          "{{ loop }}{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}"]


def test_the_proxys_sandbox_reads_as_transformers_sandbox_does(tiny_model_dir: Path) -> None:
    import jinja2.ext
    import jinja2.sandbox

    from proxy.capture.local_render import _sandbox

    stock = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                         extensions=[jinja2.ext.loopcontrols])
    stock.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    ours = LocalTemplate.load(tiny_model_dir)
    messages = [*CONVERSATIONS[3], {"role": "assistant", "content": "y", "reasoning": "r"}]
    shaped = [m for m in (_message(m, "string") for m in messages) if m is not None]
    shaped.append({"role": "user", "content": "x", "keys": "a key named like a method"})
    tools = ours._tools.shaped(msgspec.json.encode(TOOLS))
    fast = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    fast.filters["tojson"] = ours._tools.tojson
    expected = stock.from_string(READS).render(messages=shaped, tools=tools)
    assert fast.from_string(READS).render(messages=shaped, tools=tools) == expected
    assert "\nTrue a key named like a method" in expected and "False none" in expected and "after tool" in expected
    assert json.dumps(tools[0], ensure_ascii=False) in expected and "1/6 False False 5 True" in expected
    for text in UNSAFE:
        with pytest.raises(jinja2.exceptions.SecurityError):
            stock.from_string(text).render(messages=shaped)
        with pytest.raises(jinja2.exceptions.SecurityError):
            fast.from_string(text).render(messages=shaped)


@pytest.mark.parametrize("message", [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
    {"role": "developer", "content": "rules"},
    {"role": "system", "content": "x-anthropic-billing-header: cc_version=1\nBe brief."},
])
def test_what_vllm_shapes_otherwise_is_left_to_the_engine(tiny_model_dir: Path, message: dict[str, Any]) -> None:
    template = LocalTemplate.load(tiny_model_dir)
    assert template.render(request([message, {"role": "user", "content": "go"}], None), "string") is None
    assert template.render(request([{"role": "user", "content": "go"}], None), "string") is not None


@pytest.fixture
def model_engine(tiny_model_dir: Path) -> Iterator[tuple[FakeEngine, str]]:
    """A fast fake engine rendering with the tiny model's tokenizer and template, and naming its directory."""
    fake = FakeEngine(model_dir=str(tiny_model_dir))
    with run_fake_engine(fake) as url:
        yield fake, url


def test_with_the_models_files_at_hand_a_call_is_generate_and_derender(model_engine: tuple[FakeEngine, str],
                                                                        tmp_path: Path) -> None:
    fake, url = model_engine
    config = ProxyConfig(upstream=url, store_dir=str(tmp_path), splice_check_tokens=0)  # local_render: auto
    with serve_proxy(config) as proxy:
        admin = {"Authorization": f"Bearer {proxy.admin_token}"}
        session = httpx.post(f"{proxy.url}/sessions", headers=admin, json={}).json()
        auth = {"Authorization": f"Bearer {session['key']}"}
        messages: list = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list files"}]
        calls: list[dict[str, int]] = []
        for step in range(12):
            before = dict(fake.routes)
            got = httpx.post(f"{session['openai_base_url']}/chat/completions", headers=auth, timeout=30,
                             json={"model": "m", "messages": messages, "tools": TOOLS})
            assert got.status_code == 200, got.text
            calls.append({route: n - before.get(route, 0) for route, n in fake.routes.items()
                          if n > before.get(route, 0)})
            messages += [got.json()["choices"][0]["message"],
                         {"role": "tool", "tool_call_id": f"call_{step}", "content": f"file{step}.txt"}]
        turns = TrainingTrace.from_json(httpx.get(f"{proxy.url}/sessions/{session['id']}/trace",
                                                  headers=admin).content).validate().turns
    # the first eight renders made in the proxy are checked by the engine's; after that, two calls per agent call
    assert all(call.get("/v1/chat/completions/render") for call in calls[:8])
    assert calls[8:] == [{"/inference/v1/generate": 1, "/v1/chat/completions/derender": 1}] * 4
    for parent, child in zip(turns, turns[1:], strict=False):
        assert child.prompt_source == "spliced" and child.parent_id == parent.node_id
        whole = fake.render(child.request.messages, child.request.tools)
        new = len(child.prompt_token_ids) - len(parent.sequence)
        assert child.prompt_token_ids[len(parent.sequence):] == whole[len(whole) - new:]


@pytest.mark.parametrize("served", ["a local directory", "a cached hub id", "an uncached hub id"])
def test_the_proxy_says_at_start_which_tokenizer_files_it_renders_with(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        served: str) -> None:
    """The engine's own model directory; for `vllm serve org/tiny` (the engine's model root no directory here) the
    snapshot this machine's Hugging Face cache holds of it (as `hf download` leaves it), or the engine renders.
    Said in one line as the proxy starts, before any call, and never again."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    if served == "a cached hub id":
        snapshot.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (snapshot / name).write_bytes((tiny_model_dir / name).read_bytes())
        (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
        (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    caplog.set_level(logging.INFO, logger="proxy.capture.prompts")
    fake = FakeEngine(model_dir=str(tiny_model_dir), served_root=None if served == "a local directory" else "org/tiny")
    with run_fake_engine(fake) as url, serve_proxy(ProxyConfig(upstream=url, store_dir=str(tmp_path / "s"))) as proxy:
        said = proxy.proxy.pipeline.prompts.said
        agent = Agent(proxy)
        assert agent.chat([{"role": "user", "content": "one"}]).status_code == 200
        (turn,) = agent.trace().turns
    assert said == {
        "a local directory": "prompts are rendered in the proxy with the tokenizer and chat template in "
                             f"{tiny_model_dir} (the engine's model directory)",
        "a cached hub id": f"prompts are rendered in the proxy with the tokenizer and chat template in {snapshot} "
                           "(this machine's Hugging Face cache of org/tiny)",
        "an uncached hub id": "prompts are rendered by the engine: its model org/tiny has no tokenizer.json on this "
                              "machine (a local directory, or the Hugging Face cache); --local-render DIR names one",
    }[served]
    assert [record.getMessage() for record in caplog.records if record.name == "proxy.capture.prompts"] == [said]
    assert turn.metadata["rendered_by"] == ("engine" if served == "an uncached hub id" else "proxy")


def test_a_template_that_renders_by_place_is_not_blamed_on_the_proxys_renderer(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """A template that numbers tool results by their place in the conversation (as DeepSeek-V3's opens only the
    first of several tool outputs): the new messages rendered alone differ from the whole conversation's end, in
    the proxy and in the engine alike. The session renders whole from then on; the proxy keeps rendering."""
    placed = tmp_path / "placed"
    placed.mkdir()
    for item in tiny_model_dir.iterdir():
        (placed / item.name).write_bytes(item.read_bytes())
    template = (tiny_model_dir / "chat_template.jinja").read_text()
    numbered = template.replace("{{- '\\n<tool_response>\\n' }}",
                                "{{- '\\n<tool_response>\\n' + (loop.index0 | string) + ': ' }}")
    assert numbered != template
    (placed / "chat_template.jinja").write_text(numbered)
    fake = FakeEngine(model_dir=str(placed))
    with run_fake_engine(fake) as url, serve_proxy(ProxyConfig(upstream=url, store_dir=str(tmp_path / "s"))) as proxy:
        agent = Agent(proxy)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
        for step in range(3):
            got = agent.chat(messages, tools=TOOLS)
            assert got.status_code == 200, got.text
            messages += [got.json()["choices"][0]["message"],
                         {"role": "tool", "tool_call_id": f"call_{step}", "content": f"file{step}.txt"}]
        turns = agent.trace().turns
        local = proxy.proxy.pipeline.prompts.local
    # the second tool result is the first whose place differs (index 2 alone behind the probe, 4 in the whole)
    assert [t.metadata.get("render") for t in turns] == [None, "suffix, checked", "whole"]
    assert "differ from the end of the whole conversation" in turns[2].metadata["render_mismatch"]
    assert local is not None and local.usable, local.off if local is not None else None


def test_a_disagreement_hands_rendering_back_to_the_engine(model_engine: tuple[FakeEngine, str],
                                                            tmp_path: Path) -> None:
    fake, url = model_engine
    with serve_proxy(ProxyConfig(upstream=url, store_dir=str(tmp_path))) as proxy:
        agent = Agent(proxy)
        assert agent.chat([{"role": "user", "content": "one"}]).status_code == 200
        fake.render_extra = [7]  # the server's template changed under the proxy
        system = {"role": "system", "content": "Be brief."}  # a shape not checked yet, so the engine renders it too
        assert agent.chat([system, {"role": "user", "content": "two"}]).status_code == 200
        renders = fake.routes["/v1/chat/completions/render"]
        assert agent.chat([{"role": "user", "content": "three"}]).status_code == 200
        renders = fake.routes["/v1/chat/completions/render"] - renders
        one, two, three = agent.trace().turns
    assert one.metadata["rendered_by"] == "proxy" and "render_mismatch" not in one.metadata
    assert two.metadata["rendered_by"] == "engine" and "differs from the engine's" in two.metadata["render_mismatch"]
    assert two.prompt_token_ids == fake.render(two.request.messages, None)  # the engine's ids, its extra one too
    assert three.metadata["rendered_by"] == "engine" and renders == 1  # rendered by the engine from then on


def test_a_whole_conversation_is_checked_when_its_shape_is_new(model_engine: tuple[FakeEngine, str],
                                                                tmp_path: Path) -> None:
    """Conversations rendered whole (none continues an answer of the proxy's): the engine renders one of each shape
    (roles, kinds of content, tools) alongside the proxy, and otherwise only generates and derenders."""
    fake, url = model_engine
    history = CONVERSATIONS[3][:3] + [{"role": "assistant", "content": "done"}]
    asked = [[{"role": "user", "content": f"task {k}"}] for k in range(3)] + [
        [*history, {"role": "user", "content": f"step {k}"}] for k in range(3)] + [
        [*history, {"role": "user", "content": "with tools"}]] + [
        [{"role": "system", "content": f"Be brief {k}."}, {"role": "user", "content": "go"}] for k in range(2)]
    with serve_proxy(ProxyConfig(upstream=url, store_dir=str(tmp_path))) as proxy:
        agent = Agent(proxy)
        renders = []
        for k, messages in enumerate(asked):
            before = fake.routes.get("/v1/chat/completions/render", 0)
            got = agent.chat(messages, **({"tools": TOOLS} if k == 6 else {}))
            assert got.status_code == 200, got.text
            renders.append(fake.routes["/v1/chat/completions/render"] - before)
        turns = agent.trace().turns
    assert renders == [2, 0, 0, 1, 0, 0, 1, 1, 0]  # the first with the probe conversation
    for turn in turns:
        assert turn.metadata["rendered_by"] == "proxy" and turn.prompt_token_ids == fake.render(
            turn.request.messages, turn.request.tools)


def test_rendering_in_the_proxy_never_imports_torch_or_transformers(tiny_model_dir: Path) -> None:
    import subprocess
    import sys

    script = "\n".join([
        "import sys, msgspec",
        "from proxy.capture.local_render import LocalTemplate",
        "from proxy.upstream.client import ChatRender",
        f"template = LocalTemplate.load({str(tiny_model_dir)!r})",
        "messages = [msgspec.Raw(msgspec.json.encode({'role': 'user', 'content': 'hi'}))]",
        "rendered = template.render(ChatRender(messages=messages, add_generation_prompt=True), 'openai')",
        "assert rendered is not None and rendered.count > 3",
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_many_first_calls_at_once_load_the_files_once(model_engine: tuple[FakeEngine, str], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    model_engine[0].render([{"role": "user", "content": "hi"}], None)  # the fake engine has loaded its own copy
    loads: list[str] = []
    load = LocalTemplate.load
    monkeypatch.setattr(LocalTemplate, "load", classmethod(lambda cls, model_dir: loads.append(model_dir) or load(
        model_dir)))
    with serve_proxy(ProxyConfig(upstream=model_engine[1], store_dir=str(tmp_path))) as proxy:
        agents = [Agent(proxy) for _ in range(16)]
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda agent: agent.chat([{"role": "user", "content": "hi"}]).status_code, agents))
        turns = [turn for agent in agents for turn in agent.trace().turns]
    assert statuses == [200] * 16 and len(loads) == 1
    assert {turn.metadata["rendered_by"] for turn in turns} == {"proxy"}
