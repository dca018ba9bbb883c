"""The trace contract: exact round trips, one named rule per corruption, linear storage."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from trace_strategies import traces

from harness_rl import trace as T
from harness_rl.trace import Request, Sampling, TraceFormatError, TraceValidationError, TrainingTrace, Turn


def chain(n_turns: int, prompt0: int = 4, step: int = 3, completion: int = 2) -> TrainingTrace:
    """A linear agent chat: each prompt is the previous prompt+completion plus a tool result."""
    turns, prompt, token = [], list(range(prompt0)), 1000
    for i in range(n_turns):
        comp = list(range(token, token + completion))
        token += completion + step
        turns.append(Turn(
            node_id=f"t{i}", parent_id=f"t{i - 1}" if i else None, prompt_token_ids=prompt,
            completion_token_ids=comp, per_token_logps=[-0.5] * completion,
            loss_mask=[0] * len(prompt) + [1] * completion, policy_version=i, finish_reason="tool_calls",
            request=Request(messages=[{"role": "user", "content": f"m{j}"} for j in range(i + 1)],
                            tools=[{"name": "bash"}]),
        ))
        prompt = prompt + comp + list(range(token - step, token))
    return TrainingTrace(rollout_id="r1", turns=turns)


@settings(max_examples=150, deadline=None)
@given(traces())
def test_valid_traces_round_trip_exactly_through_json_and_msgpack(trace: TrainingTrace) -> None:
    assert trace.violations() == []
    assert TrainingTrace.from_json(trace.to_json()) == trace
    assert TrainingTrace.from_msgpack(trace.to_msgpack()) == trace


@settings(max_examples=100, deadline=None)
@given(traces())
def test_delta_storage_holds_each_shared_token_once(trace: TrainingTrace) -> None:
    stored = msgspec.json.decode(trace.to_json())
    stored_tokens = sum(len(t["tail"]) for t in stored["turns"])
    by_id = {t.node_id: t for t in trace.turns}
    expected = sum(len(t.sequence) - (len(by_id[t.parent_id].sequence) if t.parent_id else 0)
                   for t in trace.turns)
    assert stored_tokens == expected


def test_storage_grows_linearly_with_turns() -> None:
    sizes = [len(chain(n).to_json()) for n in (10, 20, 40)]
    assert sizes[2] - sizes[1] == pytest.approx(2 * (sizes[1] - sizes[0]), rel=0.1)


def _leaf_with_completion(trace: TrainingTrace) -> Turn | None:
    parents = {t.parent_id for t in trace.turns}
    leaves = [t for t in trace.turns if t.node_id not in parents and t.completion_token_ids]
    return leaves[0] if leaves else None


def _corrupt(rule: str, trace: TrainingTrace, data: st.DataObject) -> None:
    """Break exactly one rule of a valid trace, in place."""
    turns = trace.turns
    pick = data.draw(st.sampled_from(turns)) if turns else None
    leaf = _leaf_with_completion(trace)
    if rule == T.UNSUPPORTED_SCHEMA:
        trace.schema_version = data.draw(st.sampled_from([0, 2, 99]))
    elif rule == T.INVALID_SAMPLING:
        turns.append(Turn(node_id="hot", prompt_token_ids=[1], completion_token_ids=[2, 3], per_token_logps=[-1.0] * 2,
                          loss_mask=[0, 1, 1], sampling=data.draw(st.sampled_from(
                              [Sampling(temperature=0.0), Sampling(temperature=math.inf), Sampling(max_tokens=0),
                               Sampling(max_tokens=1)]))))
    elif rule == T.NO_PROMPT_IDS:
        turns.append(Turn(node_id="empty", prompt_token_ids=[], completion_token_ids=[1],
                          per_token_logps=[-1.0], loss_mask=[1]))
    elif rule == T.PARENT_CYCLE:
        turns.append(Turn(node_id="self", parent_id="self", prompt_token_ids=[1], completion_token_ids=[],
                          per_token_logps=[], loss_mask=[0]))
    elif pick is None:
        assume(False)
    elif rule == T.INVALID_NODE_ID:
        pick.node_id = ""
    elif rule == T.DUPLICATE_NODE_ID:
        assume(len(turns) > 1)
        turns[-1].node_id = turns[0].node_id
    elif rule == T.MISSING_PARENT:
        pick.parent_id = "no-such-node"
    elif rule == T.PARENT_NOT_PREFIX:
        children = [t for t in turns if t.parent_id is not None]
        assume(children)
        child = data.draw(st.sampled_from(children))
        child.prompt_token_ids = [child.prompt_token_ids[0] + 1] + child.prompt_token_ids[1:]
    elif rule == T.INVALID_ROLE:
        pick.role = "boss"  # type: ignore[assignment]
    elif rule == T.INVALID_BRANCH:
        pick.branch = data.draw(st.sampled_from([T.Branch(id=-1, reason="main"),
                                                 T.Branch(id=0, reason="boss")]))  # type: ignore[arg-type]
    elif rule == T.INVALID_POLICY_VERSION:
        pick.policy_version = data.draw(st.sampled_from([-1, True, 1.5]))  # type: ignore[assignment]
    elif rule == T.LENGTH_MISMATCH:
        pick.loss_mask = pick.loss_mask + [0]
    elif rule == T.TRAINABLE_PROMPT:
        pick.loss_mask = [1] + pick.loss_mask[1:]
    elif rule == T.LOGPROB_MISALIGN:
        pick.per_token_logps = pick.per_token_logps + [-0.1]
    elif leaf is None:
        assume(False)
    else:
        pos = data.draw(st.integers(0, len(leaf.completion_token_ids) - 1))
        if rule == T.INVALID_TOKEN_ID:
            leaf.completion_token_ids[pos] = data.draw(st.sampled_from([-1, True, 2.0, "7"]))
        elif rule == T.INVALID_LOGPROB:
            leaf.per_token_logps[pos] = data.draw(st.sampled_from([math.nan, -math.inf, math.inf, None, True]))
        elif rule == T.POSITIVE_LOGPROB:
            leaf.per_token_logps[pos] = data.draw(st.floats(min_value=1e-6, max_value=10.0))
        elif rule == T.INVALID_LOSS_MASK:
            leaf.loss_mask[len(leaf.prompt_token_ids) + pos] = data.draw(st.sampled_from([2, -1, True, 0.5]))


@settings(max_examples=300, deadline=None)
@given(traces(max_turns=5), st.sampled_from(T.RULES), st.data())
def test_every_single_rule_corruption_is_rejected_by_name(trace: TrainingTrace, rule: str,
                                                           data: st.DataObject) -> None:
    _corrupt(rule, trace, data)
    with pytest.raises(TraceValidationError) as caught:
        trace.validate()
    assert rule in caught.value.rules


def test_violation_names_turn_and_position() -> None:
    trace = chain(3)
    trace.turns[2].completion_token_ids[1] = -5
    [violation] = trace.violations()
    assert (violation.rule, violation.turn, violation.node_id) == ("invalid_token_id", 2, "t2")
    assert violation.position == len(trace.turns[2].prompt_token_ids) + 1


def test_partial_completion_masks_are_legal() -> None:
    trace = chain(2)
    trace.turns[1].loss_mask[-1] = 0
    assert trace.validate() is trace


def test_reading_a_wrong_shape_or_truncated_file_is_a_format_error() -> None:
    data = chain(3).to_json()
    for bad in (data[: len(data) // 2], b"not json", b'{"turns": []}', b"[1, 2]"):
        with pytest.raises(TraceFormatError):
            TrainingTrace.from_json(bad)


def test_a_file_stored_against_a_missing_parent_is_a_format_error() -> None:
    stored = msgspec.json.decode(chain(2).to_json())
    stored["turns"] = stored["turns"][1:]
    with pytest.raises(TraceFormatError, match="not in the file"):
        TrainingTrace.from_json(msgspec.json.encode(stored))


def test_save_and_load_pick_the_encoding_by_suffix(tmp_path) -> None:
    trace = chain(5)
    for name in ("t.json", "t.msgpack"):
        trace.save(tmp_path / name)
        assert TrainingTrace.load(tmp_path / name) == trace
    assert (tmp_path / "t.msgpack").read_bytes()[:1] != b"{"


# --- OpenEnv interop, against the real `openenv` package -----------------------------------------

openenv_training = pytest.importorskip("openenv.core.harness.training")


@settings(max_examples=60, deadline=None)
@given(traces())
def test_our_traces_pass_openenv_and_come_back_unchanged(trace: TrainingTrace) -> None:
    theirs = openenv_training.TrainingTrace.model_validate(trace.to_openenv())
    back = TrainingTrace.from_openenv(theirs.model_dump(mode="json"), rollout_id=trace.rollout_id)
    assert (back.rollout_id, back.turns) == (trace.rollout_id, trace.turns)
    for turn, their_turn in zip(trace.turns, theirs.turns, strict=True):
        assert their_turn.prompt_token_ids == turn.prompt_token_ids
        assert their_turn.completion_token_ids == turn.completion_token_ids
        assert their_turn.per_token_logps == turn.per_token_logps
        expected_mask = turn.loss_mask if turn.role == "agent" else [0] * len(turn.loss_mask)
        assert their_turn.loss_mask == expected_mask


def test_openenv_made_traces_import_with_rebuilt_parents_and_export_back_losslessly() -> None:
    OT, OTurn = openenv_training.TrainingTrace, openenv_training.TrainingTurn
    theirs = OT(turns=[
        OTurn(node_id="aaa", prompt_token_ids=[5, 6], completion_token_ids=[7, 8], per_token_logps=[-0.1, -0.2],
              loss_mask=[0, 0, 1, 1], request={"messages": []}, response={}, metadata={"turn": 0}),
        OTurn(node_id="bbb", prompt_token_ids=[5, 6, 7, 8, 9], completion_token_ids=[10],
              per_token_logps=[-0.3], loss_mask=[0, 0, 0, 0, 0, 1], metadata={"turn": 1}),
        OTurn(node_id="ccc", prompt_token_ids=[5, 6, 7], completion_token_ids=[11], per_token_logps=[-0.4],
              loss_mask=[0, 0, 0, 0], metadata={"turn": 2}),
        OTurn(node_id="ddd", prompt_token_ids=[1], completion_token_ids=[2], per_token_logps=[-0.5],
              loss_mask=[0, 1]),
    ])
    ours = TrainingTrace.from_openenv(theirs.model_dump(mode="json"), rollout_id="imported").validate()
    assert [t.parent_id for t in ours.turns] == [None, "aaa", None, None]
    assert {t.role for t in ours.turns} == {"agent"}
    assert {t.policy_version for t in ours.turns} == {None}
    again = OT.model_validate(ours.to_openenv()).model_dump(mode="json")
    original = theirs.model_dump(mode="json")
    for turn in again["turns"]:
        turn["metadata"].pop(T.OPENENV_META_KEY)
    assert again == original


def test_openenv_json_files_load_directly(tmp_path) -> None:
    trace = chain(3)
    path = tmp_path / "openenv.json"
    path.write_bytes(msgspec.json.encode(trace.to_openenv()))
    assert TrainingTrace.load(path) == trace


def test_export_expands_delta_storage_to_full_prompts() -> None:
    trace = TrainingTrace.from_json(chain(4).to_json())
    exported = trace.to_openenv()
    assert exported["turns"][3]["prompt_token_ids"] == trace.turns[3].prompt_token_ids
    assert set(exported["turns"][0]) == set(T.OPENENV_TURN_KEYS)
    assert exported["turns"][3]["metadata"][T.OPENENV_META_KEY]["parent_id"] == "t2"
