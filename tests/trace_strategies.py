"""Hypothesis strategies for valid traces: random capture trees, shuffled into arrival order."""

from __future__ import annotations

from hypothesis import strategies as st

from harness_rl.trace import (
    BRANCH_REASONS,
    ROLES,
    Branch,
    Reply,
    Request,
    Sampling,
    ToolCall,
    TrainingTrace,
    Turn,
    VersionSpan,
)

token_ids = st.lists(st.integers(min_value=0, max_value=200_000), max_size=12)
logprob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, allow_infinity=False)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=8))
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                                 "content": st.text(max_size=20)})


@st.composite
def traces(draw: st.DrawFn, max_turns: int = 8) -> TrainingTrace:
    """A valid trace whose turns form a forest of exact-prefix chains, listed in random order."""
    n = draw(st.integers(min_value=0, max_value=max_turns))
    tools = draw(st.one_of(st.none(), st.lists(st.fixed_dictionaries({"name": st.text(max_size=6)}),
                                                 max_size=3)))
    turns: list[Turn] = []
    for i in range(n):
        parent = draw(st.one_of(st.none(), st.sampled_from(turns))) if turns else None
        suffix = draw(token_ids)
        prompt = (parent.sequence if parent else []) + suffix
        if not prompt:
            prompt = [draw(st.integers(0, 200_000))]
        completion = draw(token_ids)
        messages = ((parent.request.messages or []) if parent else []) + draw(st.lists(message, max_size=3))
        turns.append(Turn(
            node_id=f"n{i:02d}{draw(st.text('abcdef0123456789', min_size=2, max_size=4))}",
            parent_id=parent.node_id if parent else None,
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            per_token_logps=draw(st.lists(logprob, min_size=len(completion), max_size=len(completion))),
            loss_mask=[0] * len(prompt) + draw(st.lists(st.sampled_from([0, 1]), min_size=len(completion),
                                                        max_size=len(completion))),
            policy_version=draw(st.one_of(st.none(), st.integers(0, 50))),
            version_spans=[VersionSpan(version=v, start=a, end=b) for v, a, b in draw(st.sampled_from(
                [[]] + ([[(1, 0, 1), (2, 1, len(completion))]] if len(completion) > 1 else [])))],
            finish_reason=draw(st.sampled_from([None, "stop", "length", "tool_calls"])),
            role=draw(st.sampled_from(ROLES)),
            request=Request(messages=messages, tools=tools),
            reply=draw(st.one_of(st.none(), st.builds(
                Reply, content=st.one_of(st.none(), st.text(max_size=10)),
                tool_calls=st.lists(st.builds(ToolCall, id=st.text(max_size=4), name=st.text(max_size=4),
                                              arguments=st.text(max_size=8)), max_size=2)))),
            sampling=draw(st.one_of(st.none(), st.builds(
                Sampling, temperature=st.sampled_from([None, 0.7, 1.0]),
                max_tokens=st.just(None) if len(completion) == 0 else st.integers(len(completion), 64)))),
            delivered=draw(st.booleans()),
            branch=draw(st.one_of(st.none(), st.builds(Branch, id=st.integers(0, 9),
                                                       reason=st.sampled_from(BRANCH_REASONS),
                                                       origin=st.one_of(st.none(), st.text(max_size=6))))),
            metadata=draw(st.dictionaries(st.text("xyz", min_size=1, max_size=3), json_scalar, max_size=2)),
            started_at=draw(st.one_of(st.none(), st.floats(0, 2e9))),
            finished_at=draw(st.one_of(st.none(), st.floats(0, 2e9))),
        ))
    order = draw(st.permutations(turns)) if turns else []
    return TrainingTrace(rollout_id=draw(st.text(min_size=1, max_size=10)), turns=list(order),
                         metadata=draw(st.dictionaries(st.text(max_size=4), json_scalar, max_size=2)))
