"""What the viewer page embeds: one `View`, encoded once as JSON into the HTML.

These Structs are the border between the Python side (which reads a run directory) and the page's
script (which only reads this JSON). Long texts (system prompts, tool results) live once in
`View.texts` and are referenced by index, so the same system prompt in 300 rollouts is stored once;
token text lives once per distinct id in `View.vocab`.
"""

from __future__ import annotations

import msgspec


class ToolCallView(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class MessageView(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    text: int | None = None  # index into View.texts
    tool_calls: list[ToolCallView] = []
    name: str | None = None


class ReplyView(msgspec.Struct, kw_only=True, omit_defaults=True):
    content: int | None = None  # index into View.texts
    reasoning: int | None = None
    tool_calls: list[ToolCallView] = []


class PrefixBreakView(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where this prompt stopped extending an earlier sequence, with the tokens on both sides."""

    position: int
    cause: str
    against: str | None = None
    window_start: int = 0  # prompt position of ours[0] and theirs[0]
    ours: list[int] = []
    theirs: list[int] = []


class BranchView(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The conversation a turn belongs to (`harness_rl.trace.Branch`)."""

    id: int
    reason: str
    origin: str | None = None  # node id of the turn it began from


class TurnView(msgspec.Struct, kw_only=True, omit_defaults=True):
    node_id: str
    parent_id: str | None = None
    role: str
    branch: BranchView | None = None
    policy_version: int | None = None
    finish_reason: str | None = None
    prompt_source: str | None = None  # "spliced" | "rendered" | None (not recorded)
    prefix_break: PrefixBreakView | None = None
    delivered: bool = True
    prompt_tokens: int
    new_prompt_tokens: int  # prompt tokens past the parent's prompt + completion
    new_prompt_text: int | None = None  # index into View.texts: those tokens decoded (with a tokenizer)
    ids: list[int]  # completion token ids
    logps: list[float]  # behaviour logprobs, one per completion token
    learner_logps: list[float] | None = None
    mask: str  # what the learner trains, one "0"/"1" per completion token (the loss mask; all 0 off the run's
    # train roles, by default every turn but the agent's own)
    messages: list[MessageView] = []  # request messages past those the parent's request already held
    message_count: int = 0  # all request messages
    reply: ReplyView | None = None
    duration_s: float | None = None


class RolloutView(msgspec.Struct, kw_only=True, omit_defaults=True):
    rollout_id: str
    step: int | None = None
    group_id: int | None = None
    task: str = ""
    harness: str = ""
    reward: float | None = None
    env_reward: float | None = None
    advantage: float | None = None
    error: str | None = None
    timed_out: bool = False
    exit_code: int | None = None
    tool_call_count: int | None = None
    tool_failure_count: int | None = None
    turn_count: int = 0
    duration_s: float | None = None
    turns: list[TurnView] | None = None  # None: no trace (not recorded, not embedded, or unreadable)
    trace_note: str | None = None  # why `turns` is None


class Chart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One small chart: the metrics drawn on it (the first is the headline line, a second is dashed)."""

    title: str
    keys: list[str]
    labels: list[str] = []  # legend names of `keys`, when there are two
    band: str | None = None  # a metric drawn as ± around the headline line (a standard deviation)


class View(msgspec.Struct, kw_only=True):
    title: str
    source: str
    tokenizer: str | None  # where token text came from; None: ids only
    charts: list[Chart]
    metrics: list[dict[str, float]]  # one row per step, only the charted keys (plus "step")
    rollouts: list[RolloutView]
    texts: list[str]
    vocab: dict[str, str]  # token id -> its text
