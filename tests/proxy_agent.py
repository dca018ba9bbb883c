"""A plain HTTP agent of one proxy session, for the proxy tests."""

from __future__ import annotations

import json
from typing import Any

import http_json
import httpx
import msgspec

from harness_rl.trace import TrainingTrace
from proxy.chat import ChatMessage
from proxy.server.app import RunningProxy

BASH_SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": BASH_SCHEMA}}]


class Agent:
    """A plain HTTP agent of one session (by path), and the admin side of the proxy."""

    def __init__(self, proxy: RunningProxy, **session: Any) -> None:
        self.proxy = proxy
        self.admin = {"Authorization": f"Bearer {proxy.admin_token}"}
        created = httpx.post(f"{proxy.url}/sessions", json=session, headers=self.admin)
        assert created.status_code == 201, created.text
        self.session = created.json()
        self.base = self.session["openai_base_url"]
        self.auth = {"Authorization": f"Bearer {self.session['key']}"}

    def chat(self, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
        return http_json.post(self.base, "/chat/completions", {"model": "policy", "messages": messages, **body},
                              self.auth, timeout=30)

    def trace(self) -> TrainingTrace:
        got = httpx.get(f"{self.proxy.url}/sessions/{self.session['id']}/trace", headers=self.admin)
        assert got.status_code == 200, got.text
        return TrainingTrace.from_json(got.content).validate()


def comparable(message: ChatMessage) -> dict[str, Any]:
    """A neutral message for comparison, tool-call arguments parsed (the same JSON however an agent spelled it)."""
    out: dict[str, Any] = msgspec.to_builtins(message)
    for call in out.get("tool_calls", ()):
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out
