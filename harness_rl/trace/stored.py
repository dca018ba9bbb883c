"""The stored form of a trace, and its codecs.

One stored form, `StoredTurn`, is used everywhere a turn is written: trace files and the proxy's
session logs. It is delta-encoded against an earlier turn (`base`): only the tokens past the prefix
it shares with the base's prompt+completion, and only the request messages past the base's, so a
trace grows linearly with its turns. `rebuild_turns` restores the full lists. The stored form is
lossless for every trace, valid or not, so a broken file can still be read and diagnosed.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from harness_rl.trace.turn import (
    SCHEMA_VERSION,
    Reply,
    Request,
    TraceFormatError,
    Turn,
    TurnRecord,
    common_prefix_len,
    record_of,
)


class StoredTurn(TurnRecord, tag="turn", tag_field="kind", kw_only=True, omit_defaults=True):
    """A turn as written to disk, stored against an earlier turn `base` of the same trace.

    Its prompt+completion starts with `shared` tokens of the base's prompt+completion; `tail` is
    the rest, and the first `n_prompt` tokens of the whole are the prompt. The request's first
    `messages_prefix` messages equal the base's, and `tools_inherited` says its tools do too.
    Masks are stored only where they differ from what `delivered` implies (prompt 0; completion 1
    when delivered, else 0). `parent_id` and `role` are left out of proxy session logs, where the
    capture graph decides them when a trace is built. The rest of a turn's record (`TurnRecord`) is
    stored as it is.
    """

    node_id: str
    parent_id: str | None = None
    role: str | None = None
    base: str | None = None
    shared: int = 0
    tail: list[int]
    n_prompt: int
    per_token_logps: list[float]
    completion_mask: list[int] | None = None
    prompt_mask: list[int] | None = None
    messages_prefix: int = 0
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    tools_inherited: bool = False
    reply: Reply | None = None
    metadata: dict[str, Any] = {}


class StoredTrace(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A trace file's delta form: the trace's header and its stored turns."""

    format: Literal["harness-rl.trace"]
    schema_version: int
    rollout_id: str
    metadata: dict[str, Any] = {}
    turns: list[StoredTurn]


def store_turn(turn: Turn, base: Turn | None) -> StoredTurn:
    """The stored form of `turn`, delta-encoded against `base` (None: stored whole)."""
    n_prompt = len(turn.prompt_token_ids)
    sequence = turn.sequence
    shared = common_prefix_len(base.sequence, sequence) if base is not None else 0
    prompt_mask = turn.loss_mask[:n_prompt]
    completion_mask = turn.loss_mask[n_prompt:]
    implied = 1 if turn.delivered else 0
    messages = turn.request.messages
    prefix = 0
    if base is not None and messages is not None and base.request.messages is not None:
        prefix = common_prefix_len(base.request.messages, messages)
    tools_inherited = base is not None and turn.request.tools is not None and turn.request.tools == base.request.tools
    return StoredTurn(
        **record_of(turn), node_id=turn.node_id, parent_id=turn.parent_id, role=turn.role,
        base=base.node_id if base is not None else None, shared=shared, tail=sequence[shared:], n_prompt=n_prompt,
        per_token_logps=turn.per_token_logps,
        completion_mask=completion_mask if (len(completion_mask) != len(turn.completion_token_ids)
                                            or completion_mask.count(implied) != len(completion_mask)
                                            or not set(map(type, completion_mask)) <= {int}) else None,
        prompt_mask=prompt_mask if (len(prompt_mask) != n_prompt or any(prompt_mask)) else None,
        messages_prefix=prefix, messages=messages[prefix:] if messages is not None else None,
        tools=None if tools_inherited else turn.request.tools, tools_inherited=tools_inherited,
        reply=turn.reply, metadata=turn.metadata,
    )


def rebuild_turns(stored: list[StoredTurn]) -> list[Turn]:
    """Full turns from their stored forms, in the same order; a base may come before or after its turn.

    Raises `TraceFormatError` when a turn is stored against a base that is missing, shorter than
    claimed, or part of a cycle: such a turn cannot be rebuilt exactly, and is never guessed.
    """
    index_of = {t.node_id: i for i, t in enumerate(stored)}
    built: dict[int, Turn] = {}
    resolving: set[int] = set()

    def build(index: int) -> Turn:
        if index in built:
            return built[index]
        st = stored[index]
        base: Turn | None = None
        if st.shared or st.messages_prefix or st.tools_inherited:
            base_index = index_of.get(st.base) if st.base is not None else None
            if base_index is None:
                raise TraceFormatError(f"turn {index} ({st.node_id}) is stored against {st.base!r}, which is not "
                                       "in the file")
            if index in resolving:
                raise TraceFormatError(f"turn {index} ({st.node_id}) is stored against a cycle of turns")
            resolving.add(index)
            base = build(base_index)
        built[index] = turn = _rebuild(index, st, base)
        return turn

    return [build(i) for i in range(len(stored))]


def _rebuild(index: int, st: StoredTurn, base: Turn | None) -> Turn:
    if base is None:
        sequence = list(st.tail)
    elif st.shared > len(base.prompt_token_ids) + len(base.completion_token_ids):
        raise TraceFormatError(f"turn {index} ({st.node_id}) claims {st.shared} tokens of {st.base}, which holds "
                               "fewer")
    else:
        sequence = base.sequence[:st.shared] + st.tail
    if st.n_prompt > len(sequence):
        raise TraceFormatError(f"turn {index} ({st.node_id}) has a {st.n_prompt}-token prompt in a "
                               f"{len(sequence)}-token sequence")
    prompt, completion = sequence[:st.n_prompt], sequence[st.n_prompt:]
    completion_mask = st.completion_mask if st.completion_mask is not None else \
        [1 if st.delivered else 0] * len(completion)
    prompt_mask = st.prompt_mask if st.prompt_mask is not None else [0] * len(prompt)
    messages = st.messages
    if st.messages_prefix and base is not None:
        messages = (base.request.messages or [])[:st.messages_prefix] + (messages or [])
    tools = base.request.tools if st.tools_inherited and base is not None else st.tools
    return Turn(
        **record_of(st), node_id=st.node_id, parent_id=st.parent_id, role=st.role or "agent",  # type: ignore[arg-type]
        prompt_token_ids=prompt, completion_token_ids=completion, per_token_logps=st.per_token_logps,
        loss_mask=prompt_mask + completion_mask, request=Request(messages=messages, tools=tools), reply=st.reply,
        metadata=st.metadata,
    )


def store_trace(rollout_id: str, turns: list[Turn], metadata: dict[str, Any],
                schema_version: int = SCHEMA_VERSION) -> StoredTrace:
    """A trace's delta form: each turn stored against its parent (the turn it continues), when that parent
    is in the trace."""
    by_id = {t.node_id: t for t in turns}
    stored = []
    for turn in turns:
        parent = by_id.get(turn.parent_id) if turn.parent_id is not None else None
        stored.append(store_turn(turn, parent if parent is not turn else None))
    return StoredTrace(format="harness-rl.trace", schema_version=schema_version, rollout_id=rollout_id,
                       metadata=metadata, turns=stored)


class Sniff(msgspec.Struct):
    """The top-level keys that tell the three JSON formats apart (everything else is skipped unparsed)."""

    format: str | None = None
    rollout_id: str | None = None
    turns: msgspec.Raw = msgspec.Raw(b"")


JSON_ENCODER = msgspec.json.Encoder()
MSGPACK_ENCODER = msgspec.msgpack.Encoder()
STORED_JSON = msgspec.json.Decoder(StoredTrace)
STORED_MSGPACK = msgspec.msgpack.Decoder(StoredTrace)
SNIFF_JSON = msgspec.json.Decoder(Sniff)


def decode(decoder: Any, data: bytes | str, kind: str) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise TraceFormatError(f"not a harness-rl trace: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TraceFormatError(f"not valid {kind} (or truncated): {exc}") from None


def decode_json_object(data: bytes | str) -> dict[str, Any]:
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise TraceFormatError(f"not valid JSON (or truncated): {exc}") from None
    if not isinstance(decoded, dict):
        raise TraceFormatError("not a trace: the top level is not a JSON object")
    return decoded
