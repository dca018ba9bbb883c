"""Read a run directory (or loose trace files) into the `View` the page embeds.

A run directory holds `metrics.jsonl` (one row per learner step), `rollouts.jsonl` (one row per
consumed rollout) and `traces/<rollout_id>.json`; any of them may be missing and the page simply
shows less, but a directory holding none of them, or a loose file that is not a trace, is refused
(`NoTraceError`): a page of nothing would pass for a run that recorded nothing. Turn fields that
older traces lack (`prompt_source`, `prefix_break`, `reply`, `delivered`) are read with `getattr`,
falling back to what older traces recorded.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from harness_rl.learner.rows import AGENT_ONLY, completion_mask
from harness_rl.trace import Request, TraceFormatError, TrainingTrace, Turn
from harness_rl.viewer.model import (
    BranchView,
    Chart,
    MessageView,
    PrefixBreakView,
    ReplyView,
    RolloutView,
    ToolCallView,
    TurnView,
    View,
)
from harness_rl.viewer.tokens import TokenText

CHARTS = (
    Chart(title="Reward", keys=["reward"], band="reward_std"),
    Chart(title="Loss", keys=["loss"]),
    Chart(title="KL", keys=["kl", "ref_kl"], labels=["to sampler", "to reference"]),
    Chart(title="Entropy", keys=["entropy"]),
    Chart(title="Staleness", keys=["sample/staleness_mean", "sample/staleness_max"], labels=["mean", "max"]),
    Chart(title="Throughput (tok/s)", keys=["perf/trained_tok_s_wall_clock", "perf/forwarded_tok_s_wall_clock"],
          labels=["trained", "forwarded"]),
    Chart(title="Mismatch KL", keys=["mismatch_kl"]),
    Chart(title="Train/inference |Δ logprob|",
          keys=["sampling/sampling_logp_difference/max", "sampling/sampling_logp_difference/mean"],
          labels=["max", "mean"]),
    Chart(title="After each sync |Δ logprob|", keys=["sync/logp_difference_max"]),
    Chart(title="Tool calls per rollout", keys=["tools/call_frequency"]),
    Chart(title="Tool failure rate", keys=["tools/failure_frequency"]),
    Chart(title="Verifier reward (with --reward-fn)", keys=["rollout/correctness_mean"]),
)
MAX_TEXT_CHARS = 20_000  # one message or reply; longer texts are cut with a note saying how much
BREAK_WINDOW = 8  # tokens shown on each side of a prefix break
LOGP_DIGITS = 3
DEFAULT_MAX_BYTES = 40_000_000  # traces embedded in one page; past it the newest steps win
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "traces/*.json")


class NoTraceError(ValueError):
    """Input that holds nothing to show: a directory that is not a run, a file that is not a trace."""


class Texts:
    """The page's shared text table: each distinct text stored once, referenced by index."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._index: dict[str, int] = {}
        self.chars = 0

    def ref(self, text: str | None) -> int | None:
        if text is None:
            return None
        if len(text) > MAX_TEXT_CHARS:
            text = text[:MAX_TEXT_CHARS] + f"\n… ({len(text) - MAX_TEXT_CHARS:,} more characters not embedded)"
        if text not in self._index:
            self._index[text] = len(self.items)
            self.items.append(text)
            self.chars += len(text)
        return self._index[text]

    def rollback(self, count: int) -> None:
        """Forget every text added after the first `count` (a rollout that was not embedded after all)."""
        for text in self.items[count:]:
            del self._index[text]
            self.chars -= len(text)
        del self.items[count:]


def load_run(run_dir: Path, tokens: TokenText | None, steps: tuple[int | None, int | None] = (None, None),
             max_bytes: int = DEFAULT_MAX_BYTES) -> View:
    """The whole run: metrics, every rollout row, and the traces of rollouts whose step is in `steps`.

    Traces are embedded newest step first until they take `max_bytes`, so a long run's page stays
    small enough to open and shows where training ended up; older rollouts keep their row and say why
    their turns are missing.
    """
    if not any(any(run_dir.glob(pattern)) for pattern in RUN_FILES):
        raise NoTraceError(f"{run_dir} holds no run (none of {', '.join(RUN_FILES)}): give the --output-dir of "
                           "harness-rl train, or trace files")
    texts = Texts()
    roles = _train_roles(run_dir)
    rows = _read_jsonl(run_dir / "rollouts.jsonl")
    rollouts = [_rollout_from_row(row) for row in rows]
    budget = max_bytes
    newest_first = sorted(range(len(rows)), key=lambda i: rollouts[i].step or 0, reverse=True)
    for index in newest_first:
        view, trace_path = rollouts[index], rows[index].get("trace")
        if not isinstance(trace_path, str):
            view.trace_note = "no trace recorded"
        elif not _in_steps(view.step, steps):
            view.trace_note = "trace not embedded (outside --steps)"
        elif budget <= 0:
            view.trace_note = "trace not embedded: the page is full (raise --max-mb or choose --steps)"
        else:
            count, chars = len(texts.items), texts.chars
            _attach_trace(view, run_dir / trace_path, tokens, texts, roles)
            size = texts.chars - chars + len(msgspec.json.encode(view))
            if size > budget and view.turns is not None:
                texts.rollback(count)
                view.turns, budget = None, 0
                view.trace_note = "trace not embedded: the page is full (raise --max-mb or choose --steps)"
            else:
                budget -= size
    if not rows:  # an older run without rollouts.jsonl: whatever traces it left
        rollouts = [_rollout_from_trace_file(path, tokens, texts, roles)
                    for path in sorted(run_dir.glob("traces/*.json"))]
    return View(
        title=run_dir.resolve().name, source=str(run_dir), tokenizer=str(tokens.path) if tokens else None,
        charts=list(CHARTS), metrics=_charted_metrics(_read_jsonl(run_dir / "metrics.jsonl")),
        rollouts=rollouts, texts=texts.items, vocab=tokens.vocab if tokens else {},
    )


def load_traces(paths: Iterable[Path], tokens: TokenText | None) -> View:
    """Loose trace files: one rollout each, described by the trace's own metadata; no charts. Every file must be
    a trace."""
    texts = Texts()
    paths = list(paths)
    traces = []
    for path in paths:
        trace, why = _read_trace(path)
        if trace is None:
            raise NoTraceError(f"{path} holds no trace: {why}")
        traces.append(trace)
    rollouts = [_rollout_from_trace(trace, tokens, texts) for trace in traces]
    title = paths[0].name if len(paths) == 1 else f"{len(paths)} traces"
    return View(title=title, source=", ".join(map(str, paths)), tokenizer=str(tokens.path) if tokens else None,
                charts=[], metrics=[], rollouts=rollouts, texts=texts.items,
                vocab=tokens.vocab if tokens else {})


def _in_steps(step: int | None, steps: tuple[int | None, int | None]) -> bool:
    first, last = steps
    if step is None:
        return first is None and last is None
    return (first is None or step >= first) and (last is None or step <= last)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every intact JSON object line (a run still being written may end in a partial line)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _charted_metrics(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The charted keys of each step, in step order; a step logged again (after a resume) keeps its last row."""
    keys = {key for chart in CHARTS for key in [*chart.keys, chart.band] if key}
    by_step: dict[float, dict[str, float]] = {}
    for row in rows:
        if _is_number(row.get("step")):
            step = float(row["step"])
            by_step[step] = {"step": step, **{k: float(v) for k, v in row.items() if k in keys and _is_number(v)}}
    return [by_step[step] for step in sorted(by_step)]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> float | None:
    return float(value) if _is_number(value) else None


def _integer(value: Any) -> int | None:
    return int(value) if _is_number(value) else None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _rollout_from_row(row: dict[str, Any]) -> RolloutView:
    return RolloutView(
        rollout_id=str(row.get("rollout_id", "")), step=_integer(row.get("step")),
        group_id=_integer(row.get("group_id")), task=_text(row.get("task")), harness=_text(row.get("harness")),
        reward=_number(row.get("reward")), env_reward=_number(row.get("env_reward")),
        advantage=_number(row.get("advantage")), error=row.get("error") or None,
        timed_out=bool(row.get("timed_out")), exit_code=_integer(row.get("exit_code")),
        tool_call_count=_integer(row.get("tool_call_count")),
        tool_failure_count=_integer(row.get("tool_failure_count")), turn_count=_integer(row.get("turns")) or 0,
        duration_s=_number(row.get("duration_s")),
    )


def _rollout_from_trace_file(path: Path, tokens: TokenText | None, texts: Texts,
                             roles: frozenset[str]) -> RolloutView:
    trace, why = _read_trace(path)
    if trace is None:
        return RolloutView(rollout_id=path.stem, trace_note=why)
    return _rollout_from_trace(trace, tokens, texts, roles)


def _rollout_from_trace(trace: TrainingTrace, tokens: TokenText | None, texts: Texts,
                        roles: frozenset[str] = AGENT_ONLY) -> RolloutView:
    """A rollout known only by its trace, described by the trace's own metadata."""
    meta = trace.metadata
    view = RolloutView(
        rollout_id=trace.rollout_id, step=_integer(meta.get("step")), group_id=_integer(meta.get("group_id")),
        task=_text(meta.get("task")), harness=_text(meta.get("harness")), reward=_number(meta.get("reward")),
        advantage=_number(meta.get("advantage")), error=meta.get("error") or None)
    _show_turns(view, trace, tokens, texts, roles)
    return view


def _read_trace(path: Path) -> tuple[TrainingTrace | None, str | None]:
    """The trace in `path`, or None and why it cannot be read."""
    try:
        return TrainingTrace.load(path), None
    except FileNotFoundError:
        return None, f"trace file missing: {path.name}"
    except (TraceFormatError, OSError) as exc:
        return None, f"trace unreadable: {exc}"


def _attach_trace(view: RolloutView, path: Path, tokens: TokenText | None, texts: Texts,
                  roles: frozenset[str]) -> None:
    trace, why = _read_trace(path)
    if trace is None:
        view.trace_note = why
    else:
        _show_turns(view, trace, tokens, texts, roles)


def _show_turns(view: RolloutView, trace: TrainingTrace, tokens: TokenText | None, texts: Texts,
                roles: frozenset[str]) -> None:
    view.turns = turn_views(trace, tokens, texts, roles)
    view.turn_count = view.turn_count or len(trace.turns)


def turn_views(trace: TrainingTrace, tokens: TokenText | None, texts: Texts,
               roles: frozenset[str] = AGENT_ONLY) -> list[TurnView]:
    """Each turn as the page draws it; `mask` is what the learner trains with these train roles."""
    by_id = {turn.node_id: turn for turn in trace.turns}
    return [_turn_view(turn, by_id, tokens, texts, roles) for turn in trace.turns]


def _train_roles(run_dir: Path) -> frozenset[str]:
    """The run's `--train-roles` (its config.toml), else the default: the agent's own turns."""
    try:
        learner = tomllib.loads((run_dir / "config.toml").read_text()).get("learner", {})
    except (OSError, ValueError):
        return AGENT_ONLY
    roles = learner.get("train_roles") if isinstance(learner, dict) else None
    return frozenset(roles) if isinstance(roles, list) and roles else AGENT_ONLY


def _turn_view(turn: Turn, by_id: dict[str, Turn], tokens: TokenText | None, texts: Texts,
               roles: frozenset[str]) -> TurnView:
    parent = by_id.get(turn.parent_id) if turn.parent_id else None
    new_start = len(parent.sequence) if parent is not None else 0
    new_prompt = turn.prompt_token_ids[new_start:]
    messages = _messages(turn.request)
    parent_messages = _messages(parent.request) if parent is not None else []
    shared = _common_prefix(messages, parent_messages)
    prefix_break = _prefix_break(turn, by_id)
    learner = turn.metadata.get("learner_logps")
    if tokens is not None:
        tokens.pieces(turn.completion_token_ids)
        if prefix_break is not None:
            tokens.pieces(prefix_break.ours + prefix_break.theirs)
    delivered = turn.delivered
    return TurnView(
        node_id=turn.node_id, parent_id=turn.parent_id, role=turn.role, policy_version=turn.policy_version,
        branch=BranchView(id=turn.branch.id, reason=turn.branch.reason, origin=turn.branch.origin)
        if turn.branch is not None else None,
        finish_reason=turn.finish_reason, prompt_source=turn.prompt_source,
        prefix_break=prefix_break, delivered=bool(delivered),
        prompt_tokens=len(turn.prompt_token_ids), new_prompt_tokens=len(new_prompt),
        new_prompt_text=texts.ref(tokens.decode(new_prompt)) if tokens is not None and new_prompt else None,
        ids=turn.completion_token_ids, logps=[round(lp, LOGP_DIGITS) for lp in turn.per_token_logps],
        learner_logps=[round(float(lp), LOGP_DIGITS) for lp in learner] if learner else None,
        mask="".join("1" if m else "0" for m in completion_mask(turn, roles)),
        messages=[_message_view(m, texts) for m in messages[shared:]], message_count=len(messages),
        reply=_reply_view(turn, texts),
        duration_s=(turn.finished_at - turn.started_at
                    if turn.started_at is not None and turn.finished_at is not None else None),
    )


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _prefix_break(turn: Turn, by_id: dict[str, Turn]) -> PrefixBreakView | None:
    found = turn.prefix_break
    if found is None:
        return None
    position, cause, against = found.position, found.cause, found.against
    start = max(0, position - BREAK_WINDOW)
    other = by_id.get(against) if against else None
    return PrefixBreakView(
        position=position, cause=cause, against=against, window_start=start,
        ours=turn.prompt_token_ids[start:position + BREAK_WINDOW],
        theirs=other.sequence[start:position + BREAK_WINDOW] if other is not None else [],
    )


def _messages(request: Request) -> list[Any]:
    return request.messages or []


def _content_text(content: Any) -> str | None:
    """A message's content as text: a string, or the text parts of a content list (others named)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict):
                parts.append(f"[{part.get('type', 'part')}]")
        return "\n".join(parts)
    return json.dumps(content)


def _tool_calls(calls: Any) -> list[ToolCallView]:
    out = []
    for call in calls if isinstance(calls, list) else []:
        if isinstance(call, dict):  # OpenAI shape: {"function": {"name", "arguments"}}
            function: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else call
            arguments = function.get("arguments", "")
            out.append(ToolCallView(name=str(function.get("name", "?")),
                                    arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
        else:  # a typed ToolCall (Reply.tool_calls)
            out.append(ToolCallView(name=call.name, arguments=call.arguments))
    return out


def _message_view(message: Any, texts: Texts) -> MessageView:
    if not isinstance(message, dict):
        return MessageView(role="?", text=texts.ref(json.dumps(message)))
    name = message.get("name") or message.get("tool_call_id")
    return MessageView(role=str(message.get("role", "?")), text=texts.ref(_content_text(message.get("content"))),
                       tool_calls=_tool_calls(message.get("tool_calls")), name=str(name) if name else None)


def _reply_view(turn: Turn, texts: Texts) -> ReplyView | None:
    reply = turn.reply
    if reply is None:
        return None
    return ReplyView(content=texts.ref(reply.content), reasoning=texts.ref(reply.reasoning),
                     tool_calls=_tool_calls(reply.tool_calls))
