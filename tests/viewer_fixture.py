"""A synthetic run directory for the viewer tests: metrics, rollouts and traces as `harness-rl train` writes them.

Token ids come from the tiny model's real tokenizer (ChatML text encoded), so the page has real token
text; logprobs are drawn from a seeded generator. Each step has one group whose first four rollouts'
shapes cover what the viewer must draw: tool-calling agent turns, an auxiliary side call, a
discarded retry (each its own branch), an undelivered completion, learner logprobs, a long
completion (past the token cap), an errored rollout without a trace.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from harness_rl.trace import Reply, Request, ToolCall, TrainingTrace, Turn
from proxy.capture.branches import classify

SYSTEM = "You are a careful coding agent. Use the tools to inspect and change files, then answer briefly."
TASK = "Write the digits 0 to 9 to answer.txt, one line."
LONG_REPLY = " ".join(f"line {i}: check the output and fix the test" for i in range(60))


@dataclass
class FixtureRun:
    path: Path
    rollouts: list[dict] = field(default_factory=list)  # the rows of rollouts.jsonl
    traces: dict[str, TrainingTrace] = field(default_factory=dict)  # by rollout id


def chatml(messages: list[dict], open_assistant: bool = True) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if open_assistant else "")


class _Builder:
    def __init__(self, tokenizer, rng: random.Random) -> None:
        self.tokenizer, self.rng = tokenizer, rng

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def logps(self, n: int) -> list[float]:
        return [-min(9.0, self.rng.expovariate(1.2)) for _ in range(n)]

    def turn(self, node_id: str, parent: Turn | None, new_prompt: str, reply: str, messages: list[dict],
             role: str = "agent", delivered: bool = True, version: int = 0, tool_call: dict | None = None) -> Turn:
        prompt = (parent.sequence if parent else []) + self.ids(new_prompt)
        completion = self.ids(reply + "<|im_end|>")
        calls = [ToolCall(id="call_1", name=tool_call["name"], arguments=tool_call["arguments"])] if tool_call else []
        return Turn(node_id=node_id, parent_id=parent.node_id if parent else None, prompt_token_ids=prompt,
                    completion_token_ids=completion, per_token_logps=self.logps(len(completion)),
                    loss_mask=[0] * len(prompt) + [1 if delivered else 0] * len(completion), policy_version=version,
                    finish_reason="stop", role=role, request=Request(messages=messages, tools=[]),  # type: ignore[arg-type]
                    reply=Reply(content=reply, tool_calls=calls), delivered=delivered,
                    prompt_source="rendered" if parent is None else "spliced", started_at=100.0, finished_at=100.4)


def _trace(b: _Builder, rollout_id: str, kind: int, version: int, reward: float) -> TrainingTrace:
    first_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    call = {"name": "bash", "arguments": json.dumps({"command": "seq 0 9 | tr -d '\\n' > answer.txt"})}
    reply0 = f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': json.loads(call['arguments'])})}\n</tool_call>"
    t0 = b.turn("t0", None, chatml(first_messages), reply0, first_messages, version=version, tool_call=call)
    tool_result = "wrote answer.txt (10 bytes)"
    second_messages = [*first_messages, {"role": "assistant", "content": reply0, "tool_calls": [
        {"id": "call_1", "type": "function", "function": call}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                   "content": tool_result}]
    new_prompt = "\n" + chatml([{"role": "tool", "content": f"<tool_response>\n{tool_result}\n</tool_response>"}])
    final = LONG_REPLY if kind == 3 else f"Done: answer.txt holds 0123456789 (reward {reward:.2f})."
    t1 = b.turn("t1", t0, new_prompt, final, second_messages, version=version)
    if kind == 2:  # the learner's logprobs recorded beside the behaviour ones
        t1.metadata["learner_logps"] = [min(0.0, lp + b.rng.uniform(-0.3, 0.3)) for lp in t1.per_token_logps]
    turns = [t0, t1]
    if kind == 0:  # a title side call (auxiliary) and a retry of the last call that the agent dropped
        title_messages = [{"role": "user", "content": "Generate a short title for: " + TASK}]
        turns.append(b.turn("aux", None, chatml(title_messages), "Digits to a file", title_messages,
                            role="auxiliary", version=version))
        turns.append(b.turn("retry", t0, new_prompt, "Retrying the last step.", second_messages, role="discarded",
                            version=version))
    if kind == 1:  # a completion the agent never received (kept as context, mask 0)
        turns.append(b.turn("lost", t1, "\n" + chatml([{"role": "user", "content": "continue"}]), "Continuing.",
                            [*second_messages, {"role": "user", "content": "continue"}], delivered=False,
                            version=version))
    classify(turns)  # the branches, as the proxy gives them: main, the title's side call, the retry's own
    return TrainingTrace(rollout_id=rollout_id, turns=turns, metadata={"task": "digits", "harness": "echo",
                                                                         "reward": reward, "error": None})


def make_run(path: Path, tokenizer_dir: Path, steps: int = 3, group_size: int = 4, seed: int = 0) -> FixtureRun:
    """Write `steps` steps of one group of `group_size` rollouts each under `path` (metrics, rollouts, traces)."""
    from tokenizers import Tokenizer

    rng = random.Random(seed)
    builder = _Builder(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")), rng)
    run = FixtureRun(path)
    (path / "traces").mkdir(parents=True)
    metrics = []
    for step in range(1, steps + 1):
        rewards: list[float | None] = [round(min(1.0, max(0.0, step / steps + rng.uniform(-0.5, 0.3))), 2)
                                       for _ in range(group_size)]
        if step == 2:
            rewards[3] = None  # its rollout failed: no reward, no trace
        scored = [r for r in rewards if r is not None]
        mean, std = statistics.fmean(scored), statistics.pstdev(scored)
        for k, reward in enumerate(rewards):
            rollout_id = f"s{step:03d}-g{step}-r{k}"
            advantage = None if reward is None or std == 0 else round((reward - mean) / (std + 1e-8), 4)
            row = {"step": step, "group_id": step, "rollout_id": rollout_id, "task": "digits", "harness": "echo",
                   "reward": reward, "env_reward": reward, "advantage": advantage, "error": None, "timed_out": False,
                   "exit_code": 0, "tool_call_count": 1, "turns": 0, "duration_s": 1.5 + k,
                   "trace": f"traces/{rollout_id}.json"}
            if reward is None:
                row.update(error="agent exited with status 1 before the verifier ran", exit_code=1, trace=None,
                           tool_call_count=0)
            else:
                trace = _trace(builder, rollout_id, kind=k % 4, version=step - 1, reward=reward)
                trace.validate()
                trace.save(path / "traces" / f"{rollout_id}.json")
                run.traces[rollout_id] = trace
                row["turns"] = len(trace.turns)
            run.rollouts.append(row)
        metrics.append({"step": step, "reward": mean, "reward_std": std, "loss": rng.uniform(-0.1, 0.1),
                        "kl": rng.uniform(0, 0.02), "entropy": 3 - step * 0.05, "sample/staleness_mean": 0.5,
                        "sample/staleness_max": 1.0, "perf/trained_tok_s_wall_clock": 500 + 10 * step,
                        "mismatch_kl": 1e-4 * step, "sampling/sampling_logp_difference/max": 0.05 * step,
                        "grad_norm": 1.0, "learning_rate": 1e-2, "policy_version": float(step)})
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run.rollouts))
    return run


def trained_tokens(trace: TrainingTrace) -> int:
    return sum(sum(t.completion_mask) for t in trace.turns if t.role == "agent")

