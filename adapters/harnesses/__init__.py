"""Harness adapters: how to run each agent CLI against one proxy session, under Harbor's agent names.

Our own adapters come first; every agent Harbor names is also a harness through the Harbor bridge,
as `harbor:<name>`, and under its plain name where we have no adapter of our own (`terminus-2`).
"""

from __future__ import annotations

from typing import Any

from adapters.harbor_bridge.catalog import CATALOG
from adapters.harnesses.aider import AiderHarness
from adapters.harnesses.base import (
    AgentRun,
    Dialect,
    Endpoint,
    Harness,
    Launch,
    Package,
    ToolReport,
)
from adapters.harnesses.claude_code import ClaudeCodeHarness
from adapters.harnesses.codex import CodexHarness
from adapters.harnesses.echo import EchoHarness
from adapters.harnesses.gemini_cli import GeminiCliHarness
from adapters.harnesses.harbor import HarborHarness, bridged
from adapters.harnesses.mini_swe_agent import MiniSweAgentHarness
from adapters.harnesses.opencode import OpencodeHarness
from adapters.harnesses.pi import PiHarness
from adapters.harnesses.qwen_coder import QwenCodeHarness

HARNESSES: dict[str, type[Harness]] = {harness.name: harness for harness in (
    EchoHarness, OpencodeHarness, ClaudeCodeHarness, MiniSweAgentHarness, CodexHarness, GeminiCliHarness,
    QwenCodeHarness, PiHarness, AiderHarness)}
NATIVE_NAMES = tuple(HARNESSES)
for _agent in CATALOG.values():
    HARNESSES[f"harbor:{_agent.name}"] = bridged(_agent)
    HARNESSES.setdefault(_agent.name, HARNESSES[f"harbor:{_agent.name}"])
HARNESS_NAMES = tuple(HARNESSES)


def harness_class(name: str) -> type[Harness]:
    """The adapter class for a Harbor agent name (`claude_code`-style spellings accepted too)."""
    try:
        return HARNESSES[name.replace("_", "-")]
    except KeyError:
        raise ValueError(f"unknown harness {name!r}; `harness-rl harnesses` lists them all") from None


def create_harness(name: str, **options: Any) -> Harness:
    """The adapter for a harness name, built with its options."""
    return harness_class(name)(**options)


__all__ = ["HARNESSES", "HARNESS_NAMES", "NATIVE_NAMES", "AgentRun", "Dialect", "Endpoint", "HarborHarness", "Harness",
           "Launch", "Package", "ToolReport", "create_harness", "harness_class"]
