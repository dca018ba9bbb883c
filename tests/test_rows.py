"""Rows: exact tokens, masks, logprobs and versions for every shape a captured trace can take."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from harness_rl.learner.rows import NO_VERSION, trace_rows
from harness_rl.trace import TrainingTrace, Turn


def turn(node_id, prompt, completion, *, parent=None, logps=None, mask=None, role="agent", version=0):
    logps = logps if logps is not None else [-0.1 * (i + 1) for i in range(len(completion))]
    mask = mask if mask is not None else [1] * len(completion)
    return Turn(node_id=node_id, parent_id=parent, prompt_token_ids=prompt, completion_token_ids=completion,
                per_token_logps=logps, loss_mask=[0] * len(prompt) + mask, role=role, policy_version=version)


def trace(*turns):
    return TrainingTrace(rollout_id="r", turns=list(turns)).validate()


def test_linear_chat_is_one_row_with_tool_output_as_context():
    rows = trace_rows(trace(
        turn("a", [1, 2, 3], [4, 5], logps=[-0.5, -0.25], version=3),
        turn("b", [1, 2, 3, 4, 5, 6, 7], [8, 9], parent="a", logps=[-1.0, -2.0], version=4),
    ))
    assert len(rows) == 1
    row = rows[0]
    assert row.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert row.mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert row.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, -2.0]
    assert row.versions == [-1, -1, -1, 3, 3, -1, -1, 4, 4]
    assert row.node_ids == ["a", "b"]


def test_rewritten_history_starts_a_new_row_seeded_with_the_full_prompt():
    rows = trace_rows(trace(
        turn("a", [1, 2], [3], logps=[-0.5]),
        turn("b", [1, 2, 3, 4], [5], parent="a", logps=[-0.75]),
        turn("c", [1, 9, 4], [6, 7], logps=[-1.0, -1.5]),  # the agent compacted its history
    ))
    assert [r.tokens for r in rows] == [[1, 2, 3, 4, 5], [1, 9, 4, 6, 7]]
    assert [r.mask for r in rows] == [[0, 0, 1, 0, 1], [0, 0, 0, 1, 1]]
    assert rows[1].logprobs == [0.0, 0.0, 0.0, -1.0, -1.5]


def test_rewrite_below_a_parent_whose_row_moved_on_starts_a_new_row():
    # "c" extends "a" but not "b": its parent is "a", whose row "b" has already extended.
    rows = trace_rows(trace(
        turn("a", [1, 2], [3]),
        turn("b", [1, 2, 3, 4], [5], parent="a"),
        turn("c", [1, 2, 3, 8], [9], parent="a", logps=[-0.3]),
    ))
    assert [r.tokens for r in rows] == [[1, 2, 3, 4, 5], [1, 2, 3, 8, 9]]
    assert [r.mask for r in rows] == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 1]]


def test_fork_trains_the_shared_prefix_once_and_covers_both_branches():
    rows = trace_rows(trace(
        turn("root", [1, 2], [3, 4], logps=[-0.1, -0.2]),
        turn("left", [1, 2, 3, 4, 5], [6], parent="root", logps=[-0.3]),
        turn("right", [1, 2, 3, 4, 7], [8], parent="root", logps=[-0.4]),
        turn("left2", [1, 2, 3, 4, 5, 6, 10], [11], parent="left", logps=[-0.5]),
        turn("right2", [1, 2, 3, 4, 7, 8, 12], [13], parent="right", logps=[-0.6]),
    ))
    assert [r.tokens for r in rows] == [[1, 2, 3, 4, 5, 6, 10, 11], [1, 2, 3, 4, 7, 8, 12, 13]]
    assert [r.mask for r in rows] == [[0, 0, 1, 1, 0, 1, 0, 1], [0, 0, 0, 0, 0, 1, 0, 1]]
    assert rows[0].logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3, 0.0, -0.5]
    assert rows[1].logprobs == [0.0, 0.0, 0.0, 0.0, 0.0, -0.4, 0.0, -0.6]
    assert [r.node_ids for r in rows] == [["root", "left", "left2"], ["right", "right2"]]


def test_branch_recorded_after_its_sibling_fork_still_continues_its_row():
    turns = [
        turn("root", [1, 2], [3]),
        turn("left", [1, 2, 3, 5], [6], parent="root"),
        turn("right", [1, 2, 3, 7], [8], parent="root"),
        turn("left2", [1, 2, 3, 5, 6, 9], [10], parent="left"),
    ]
    interleaved = trace(turns[0], turns[1], turns[2], turns[3])
    assert [r.tokens for r in trace_rows(interleaved)] == [[1, 2, 3, 5, 6, 9, 10], [1, 2, 3, 7, 8]]


def test_partial_completion_mask_survives_and_trailing_context_is_cut():
    rows = trace_rows(trace(turn("a", [10, 11], [12, 13, 14, 15], logps=[-0.1, -0.2, -0.3, -0.4],
                                 mask=[1, 0, 1, 0], version=7)))
    assert rows[0].tokens == [10, 11, 12, 13, 14]
    assert rows[0].mask == [0, 0, 1, 0, 1]
    assert rows[0].logprobs == [0.0, 0.0, -0.1, 0.0, -0.3]
    assert rows[0].versions == [-1, -1, 7, -1, 7]


def test_auxiliary_and_discarded_turns_are_never_trained():
    rows = trace_rows(trace(
        turn("title", [50, 51], [52], role="auxiliary"),  # side call, nothing extends it: skipped
        turn("a", [1, 2], [3], logps=[-0.1]),
        turn("retry", [1, 2, 3, 4], [9, 9], parent="a", role="discarded"),  # leaf retry: skipped
        turn("b", [1, 2, 3, 4], [5], parent="a", logps=[-0.2]),
        turn("summary", [1, 2, 3, 4, 5, 6], [7], parent="b", role="auxiliary"),  # extended below
        turn("c", [1, 2, 3, 4, 5, 6, 7, 8], [20], parent="summary", logps=[-0.3]),
    ))
    assert len(rows) == 1
    assert rows[0].tokens == [1, 2, 3, 4, 5, 6, 7, 8, 20]
    assert rows[0].mask == [0, 0, 1, 0, 1, 0, 0, 0, 1]
    assert rows[0].node_ids == ["a", "b", "summary", "c"]


def test_turn_without_trained_tokens_and_nothing_below_yields_no_row():
    assert trace_rows(trace(turn("a", [1, 2], [3, 4], mask=[0, 0]))) == []
    assert trace_rows(trace(turn("a", [1, 2], [3], role="discarded"))) == []


def test_unknown_policy_version_is_marked():
    rows = trace_rows(trace(turn("a", [1], [2], version=None)))
    assert rows[0].versions == [NO_VERSION, NO_VERSION]


def agent_trace(n_turns: int, seed: int = 0, prompt_len: int = 200, reply_len: int = 40, tool_len: int = 60):
    """A linear agent chat: each turn's prompt is the previous prompt+completion plus a tool result."""
    rng = random.Random(seed)
    turns, prompt = [], [rng.randrange(5000) for _ in range(prompt_len)]
    for i in range(n_turns):
        completion = [rng.randrange(5000) for _ in range(reply_len)]
        logps = [-rng.random() for _ in completion]
        turns.append(turn(f"t{i}", list(prompt), completion, parent=f"t{i - 1}" if i else None, logps=logps,
                          version=i // 10))
        prompt = prompt + completion + [rng.randrange(5000) for _ in range(tool_len)]
    return TrainingTrace(rollout_id="agent", turns=turns).validate()


def test_fifty_turn_agent_trace_is_one_row_training_every_sampled_token_once():
    tr = agent_trace(50)
    rows = trace_rows(tr)
    assert len(rows) == 1
    row, last = rows[0], tr.turns[-1]
    assert row.tokens == last.sequence
    expected_mask, expected_logps, expected_versions = [], [], []
    for t in tr.turns:
        new_context = len(t.prompt_token_ids) - len(expected_mask)
        expected_mask += [0] * new_context + [1] * len(t.completion_token_ids)
        expected_logps += [0.0] * new_context + t.per_token_logps
        expected_versions += [-1] * new_context + [t.policy_version] * len(t.completion_token_ids)
    assert row.mask == expected_mask
    assert row.logprobs == expected_logps
    assert row.versions == expected_versions
    assert row.n_trained == 50 * 40


@st.composite
def trees(draw):
    """Random capture trees: each turn extends a random earlier turn (or starts over), random masks/roles."""
    n = draw(st.integers(1, 12))
    turns: list[Turn] = []
    for i in range(n):
        parent = draw(st.sampled_from([None] + [t.node_id for t in turns]))
        base = [] if parent is None else next(t for t in turns if t.node_id == parent).sequence
        prompt = base + draw(st.lists(st.integers(0, 3), min_size=0 if base else 1, max_size=3))
        completion = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
        mask = draw(st.lists(st.integers(0, 1), min_size=len(completion), max_size=len(completion)))
        role = draw(st.sampled_from(["agent", "agent", "auxiliary", "discarded"]))
        turns.append(turn(f"n{i}", prompt, completion, parent=parent, mask=mask, role=role,
                          logps=[-float(i + 1)] * len(completion), version=i))
    return TrainingTrace(rollout_id="tree", turns=turns).validate()


@given(trees())
@settings(max_examples=300, deadline=None)
def test_every_masked_agent_token_is_trained_exactly_once_with_its_exact_context(tr):
    by_id = {t.node_id: t for t in tr.turns}
    rows = trace_rows(tr)
    trained = []
    for row in rows:
        assert row.n_trained > 0 and row.mask[-1] == 1
        for t in (by_id[n] for n in row.node_ids):
            overlap = min(len(row.tokens), len(t.sequence))
            assert row.tokens[:overlap] == t.sequence[:overlap]
        for pos, m in enumerate(row.mask):
            if m:
                owner = next(by_id[n] for n in row.node_ids
                             if len(by_id[n].prompt_token_ids) <= pos < len(by_id[n].sequence))
                j = pos - len(owner.prompt_token_ids)
                assert row.logprobs[pos] == owner.per_token_logps[j]
                assert row.versions[pos] == owner.policy_version
                trained.append((owner.node_id, j))
    expected = [(t.node_id, j) for t in tr.turns if t.role == "agent"
                for j, m in enumerate(t.completion_mask) if m]
    assert sorted(trained) == sorted(expected)
