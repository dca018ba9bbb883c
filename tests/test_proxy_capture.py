"""The capture graph: exact expected parents, roots and roles, whatever order turns arrive in."""

from __future__ import annotations

import itertools
import random

import pytest

from proxy.capture.graph import CaptureGraph, Node
from proxy.tokens import count_tokens, ids_text, token_ids, token_text

SYSTEM = list(range(100, 140))


def build(turns: list[tuple[str, list[int], list[int], bool, float]]) -> CaptureGraph:
    graph = CaptureGraph()
    for node_id, prompt, completion, tools, started in turns:
        graph.add(node(node_id, prompt, completion, tools, started), token_text(prompt + completion))
    return graph


def node(node_id: str, prompt: list[int], completion: list[int], tools: bool, started: float) -> Node:
    """A turn whose request is its prompt: two turns with one prompt are one request sent twice (a retry)."""
    return Node(node_id, len(token_text(prompt)), len(token_text(prompt + completion)) - len(token_text(prompt)),
                tools, started, request_key=token_text(prompt))


def linear_chat() -> list[tuple[str, list[int], list[int], bool, float]]:
    """Three turns, each prompt = previous prompt + completion + tool result + generation prompt."""
    p1 = SYSTEM + [1, 2, 3]
    c1 = [500, 501, 2]
    p2 = p1 + c1 + [7, 8, 9]
    c2 = [502, 503, 2]
    p3 = p2 + c2 + [10, 11]
    c3 = [504, 2]
    return [("a", p1, c1, True, 1.0), ("b", p2, c2, True, 2.0), ("c", p3, c3, True, 3.0)]


def test_linear_chat_parents_and_roles() -> None:
    graph = build(linear_chat())
    parents, roles = graph.roles()
    assert parents == {"a": None, "b": "a", "c": "b"}
    assert roles == {"a": "agent", "b": "agent", "c": "agent"}


def test_sequences_come_back_exactly() -> None:
    turns = linear_chat()
    graph = build(turns)
    for node_id, prompt, completion, _, _ in turns:
        assert graph.sequence(node_id) == token_text(prompt + completion)
        assert token_ids(graph.sequence(node_id)) == prompt + completion


def test_rewritten_history_starts_a_new_root() -> None:
    turns = linear_chat()
    p1, c1 = turns[0][1], turns[0][2]
    compacted = SYSTEM + [42, 43] + [9, 9]  # the agent summarised its history: no exact prefix any more
    rewritten = [("d", compacted, [600, 2], True, 4.0), ("e", compacted + [600, 2, 5], [601, 2], True, 5.0)]
    graph = build(turns + rewritten)
    parents, roles = graph.roles()
    assert parents == {"a": None, "b": "a", "c": "b", "d": None, "e": "d"}
    assert set(roles.values()) == {"agent"}
    assert p1 + c1 != compacted[:len(p1 + c1)]


def test_retry_of_same_prompt_is_discarded() -> None:
    turns = linear_chat()
    p2 = turns[1][1]
    retry = ("b_retry", p2, [777, 2], True, 2.5)  # same prompt as b; the agent went on from b
    graph = build([turns[0], turns[1], retry, turns[2]])
    parents, roles = graph.roles()
    assert parents == {"a": None, "b": "a", "b_retry": "a", "c": "b"}
    assert roles == {"a": "agent", "b": "agent", "b_retry": "discarded", "c": "agent"}


def test_retried_last_turn_keeps_the_latest() -> None:
    turns = linear_chat()
    p3 = turns[2][1]
    graph = build(turns + [("c_again", p3, [505, 2], True, 3.5)])
    _, roles = graph.roles()
    assert roles["c"] == "discarded" and roles["c_again"] == "agent"


def test_duplicate_prompt_roots_keep_the_continued_one() -> None:
    turns = linear_chat()
    first_again = ("a_dup", turns[0][1], [900, 2], True, 0.5)
    graph = build([first_again] + turns)
    parents, roles = graph.roles()
    assert parents["a_dup"] is None and parents["a"] is None
    assert roles["a_dup"] == "discarded" and roles["a"] == "agent"


def test_toolless_side_call_is_auxiliary() -> None:
    title = ("title", [100, 999, 1, 2, 3], [800, 801, 2], False, 0.1)  # opencode's title call, no tools
    graph = build([title] + linear_chat())
    _, roles = graph.roles()
    assert roles == {"title": "auxiliary", "a": "agent", "b": "agent", "c": "agent"}


def test_toolless_session_is_all_agent() -> None:
    turns = [(n, p, c, False, t) for n, p, c, _, t in linear_chat()]
    _, roles = build(turns).roles()
    assert set(roles.values()) == {"agent"}


def test_toolless_turn_inside_a_tool_path_stays_agent() -> None:
    turns = linear_chat()
    turns[1] = (turns[1][0], turns[1][1], turns[1][2], False, turns[1][4])
    _, roles = build(turns).roles()
    assert roles["b"] == "agent"


def test_arrival_order_does_not_matter() -> None:
    turns = linear_chat()
    p2 = turns[1][1]
    extra = [("b_retry", p2, [777, 2], True, 2.5), ("title", [100, 999, 1], [800, 2], False, 0.1),
             ("c_again", turns[2][1], [505, 2], True, 3.5)]
    everything = turns + extra
    expected = build(everything).roles()
    for order in itertools.permutations(everything):
        assert build(list(order)).roles() == expected
    assert expected[0] == {"a": None, "b": "a", "c": "b", "b_retry": "a", "title": None, "c_again": "b"}


def test_late_shorter_turn_reparents_existing_children() -> None:
    turns = linear_chat()
    graph = build([turns[2], turns[0]])  # c arrives before b
    assert graph.parents()[0] == {"c": "a", "a": None}
    graph.add(node("b", turns[1][1], turns[1][2], True, 2.0), token_text(turns[1][1] + turns[1][2]))
    assert graph.parents()[0] == {"a": None, "b": "a", "c": "b"}


def test_prompt_ending_inside_a_completion_is_no_child_of_it() -> None:
    p1, c1 = SYSTEM + [1], [500, 501, 502, 2]
    graph = build([("a", p1, c1, True, 1.0), ("x", p1 + c1[:2], [9, 2], True, 2.0)])
    parents, roles = graph.roles()
    assert parents == {"a": None, "x": None}


def test_empty_completions_with_equal_prompts_do_not_form_a_cycle() -> None:
    p = SYSTEM + [1, 2]
    graph = build([("a", p, [], True, 1.0), ("b", p, [], True, 2.0)])
    parents, _ = graph.roles()
    assert parents == {"a": None, "b": "a"}


def test_delta_base_shares_the_longest_prefix() -> None:
    turns = linear_chat()
    graph = build(turns[:2])
    p3, c3 = turns[2][1], turns[2][2]
    base = graph.add(node("c", p3, c3, True, 3.0), token_text(p3 + c3))
    assert base.node_id == "b" and base.shared == len(token_text(turns[1][1] + turns[1][2]))
    retry = graph.add(node("c2", p3, [123], True, 4.0), token_text(p3 + [123]))
    assert retry.node_id == "c" and retry.shared == len(token_text(p3))


def test_shared_prefix_is_cut_back_to_a_whole_token() -> None:
    graph = build([("a", [100, 12345], [7], True, 1.0)])
    base = graph.add(node("b", [100, 12399], [7], True, 2.0), token_text([100, 12399, 7]))
    assert base.node_id == "a" and base.shared == len(b"100,") and count_tokens(b"100,") == 1


def test_engine_id_text_is_canonical_and_checked() -> None:
    assert ids_text(b"[1, 22,\n 333]") == (b"1,22,333,", 3)
    assert ids_text(b"[7]") == (b"7,", 1)
    assert ids_text(b"[]") == (b"", 0)
    for bad in (b"[1,-2]", b"[1.5]", b"[1e3]", b'["a"]', b"[[1]]", b"{}", b"null"):
        assert ids_text(bad) is None


@pytest.mark.parametrize("seed", range(5))
def test_random_forest_matches_brute_force_longest_prefix(seed: int) -> None:
    """Ids whose digits prefix each other's (1, 11, 12, 123) make the tree split inside tokens."""
    rng = random.Random(seed)
    alphabet = [0, 1, 11, 12, 123, 2, 5]
    seqs: list[tuple[str, list[int], list[int]]] = []
    for i in range(60):
        if seqs and rng.random() < 0.8:
            _, p, c = rng.choice(seqs)
            cut = rng.randint(1, len(p) + len(c))
            prompt = (p + c)[:cut] + [rng.choice(alphabet) for _ in range(rng.randint(0, 3))]
        else:
            prompt = [rng.choice(alphabet) for _ in range(rng.randint(1, 4))]
        seqs.append((f"n{i}", prompt, [rng.choice(alphabet) for _ in range(rng.randint(1, 3))]))
    graph = build([(n, p, c, True, float(i)) for i, (n, p, c) in enumerate(seqs)])
    parents, _ = graph.parents()
    order = {n: i for i, (n, _, _) in enumerate(seqs)}
    for node_id, prompt, _ in seqs:
        candidates = [(len(p) + len(c), n) for n, p, c in seqs
                      if n != node_id and len(p) + len(c) <= len(prompt) and prompt[:len(p) + len(c)] == p + c]
        best = max((length for length, _ in candidates), default=None)
        if best is None:
            assert parents[node_id] is None
        else:
            assert parents[node_id] in {n for length, n in candidates if length == best}
            parent = parents[node_id]
            assert count_tokens(graph.sequence(parent)) == best
        for n, p, c in seqs:
            assert graph.sequence(n) == token_text(p + c)
    assert len(order) == 60
