"""Token in, token out: a conversation's earlier replies go back to the engine as the ids it sampled.

An agent sends its whole conversation every call, with the model's earlier replies as assistant
messages. Re-rendering those from text is not a bijection (a reply cut inside a multi-byte
character, BPE merges, tool-call JSON re-serialised, special tokens dropped), so each call would
start a new chain. Instead, per session, every reply the proxy returned is remembered with the
request behind it; a request whose messages are an earlier request's, then that exact reply, then
new messages, is spliced:

    prompt = earlier prompt + sampled completion + the template's closing + the new messages' rendering

where the new messages' rendering is the tail of the engine's own rendering of the whole conversation
past its rendering of the conversation up to the reply. Only a first call, or a history the agent
rewrote, is rendered whole; such a turn records where its prompt broke from the turn it shares most
messages with, and why.

Replies are matched in the neutral (OpenAI chat) form every dialect translates into: the same text,
the same tool calls (names, arguments compared as parsed JSON, ids up to a dialect's prefix), and the
same reasoning unless the agent dropped it.
"""

from __future__ import annotations

import json
from array import array
from typing import Any

from harness_rl.trace import PrefixBreak, Reply, Sampling, common_prefix_len
from proxy.chat import ChatMessage, text_of
from proxy.tokens import SEP

DIGEST = 8  # bytes per message digest
WARMUP_CHECKS = 4  # a session's first spliced turns, each checked against the whole conversation's rendering
CHECK_SPACING = 32  # after them, at most one spliced turn in this many is checked
TOOL_ID_PREFIXES = ("toolu_", "call_", "fc_")
CONTINUING = frozenset({"template_dropped", "reply_edited", "retokenized"})  # the agent went on from `against`


def digests(encoded: list[bytes]) -> bytes:
    """One 8-byte digest per encoded message; a conversation's prefix is a prefix of these bytes."""
    return array("q", map(hash, encoded)).tobytes()


def common_messages(a: bytes, b: bytes) -> int:
    """Leading messages two digest strings share (the usual case, `b` extends `a`, is one comparison)."""
    if b.startswith(a):
        return len(a) // DIGEST
    return common_prefix_len(a[:len(b) // DIGEST * DIGEST], b[:len(a) // DIGEST * DIGEST]) // DIGEST


def reply_matches(reply: Reply, message: ChatMessage) -> bool:
    """Whether an assistant message the agent sent is the reply the proxy gave it."""
    if message.role != "assistant" or text_of(message.content) != (reply.content or ""):
        return False
    if message.reasoning is not None and message.reasoning != (reply.reasoning or ""):
        return False
    calls = message.tool_calls or []
    if len(calls) != len(reply.tool_calls):
        return False
    return all(sent.function.name == given.name and same_arguments(sent.function.arguments, given.arguments)
               and (not sent.id or _bare(sent.id) == _bare(given.id))
               for sent, given in zip(calls, reply.tool_calls, strict=True))


def same_arguments(a: str, b: str) -> bool:
    """The same tool-call arguments: the same text, or the same JSON however it was spelled."""
    if a == b:
        return True
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def _bare(call_id: str) -> str:
    for prefix in TOOL_ID_PREFIXES:
        if call_id.startswith(prefix):
            return call_id[len(prefix):]
    return call_id


def ended_by_stop_token(finish_reason: str | None, sampling: Sampling | None) -> bool | None:
    """Whether a completion's last id is the stop token that ended it: False when it was cut short, None when a
    stop string may have ended it inside its text (the agent asked for some). One rule for a turn just answered
    and one read back from the log, so a restarted proxy splices as it did."""
    if finish_reason not in ("stop", "tool_calls"):
        return False
    return None if sampling is not None and sampling.stop else True


class Remembered:
    """What a session keeps of one answered call, to recognise its reply when the agent sends it back.

    `rendered` is the length and hash of the template's rendering of the call's conversation (token
    text): when the next conversation's rendering starts with it, the reply's rendering starts right
    there, and no second render is needed to find where the new messages begin. `stopped`: whether the
    reply ends with the stop token that ended it (`ended_by_stop_token`).
    """

    __slots__ = ("message_digests", "rendered", "reply", "stopped", "tools_digest")

    def __init__(self, message_digests: bytes, tools_digest: int | None, reply: Reply | None,
                 rendered: tuple[int, int] | None = None, stopped: bool | None = None) -> None:
        self.message_digests = message_digests
        self.tools_digest = tools_digest
        self.reply = reply
        self.rendered = rendered
        self.stopped = stopped


class ReplyIndex:
    """A session's answered calls by request, newest last; and how its spliced prompts are rendered.

    `renders_suffix` stays True while rendering the new messages alone agrees with rendering the whole
    conversation (`proxy.capture.prompts`); `check_due` spaces those checks out to about `budget` tokens a turn.
    """

    def __init__(self) -> None:
        self.calls: dict[str, Remembered] = {}
        self._by_request: dict[bytes, list[str]] = {}
        self._prefixes = _Prefix()  # every call's messages as a path of digests: `closest` walks it, not the calls
        self.renders_suffix = True
        self._spliced = 0  # turns asked `check_due`
        self._check_credit = 0  # whole-conversation tokens the checks may spend (`budget` a turn)
        self._since_check = 0

    def check_due(self, tokens: int, budget: int | None) -> bool:
        """Whether this turn's suffix rendering is checked against the whole conversation of `tokens` tokens:
        the session's first `WARMUP_CHECKS` spliced turns (a template that renders a message by its place shows
        there), then one turn in `CHECK_SPACING`, or fewer when the conversation is long (every N-th when N
        times `budget` long, so the checks cost about `budget` tokens a turn however long it grows);
        `None`: every turn, 0: never."""
        if budget is None:
            return True
        if not budget:
            return False
        self._spliced += 1
        self._check_credit = min(self._check_credit + budget, tokens)
        self._since_check += 1
        if self._spliced <= WARMUP_CHECKS or (self._check_credit >= tokens and self._since_check >= CHECK_SPACING):
            self._check_credit, self._since_check = 0, 0
            return True
        return False

    def add(self, node_id: str, remembered: Remembered) -> None:
        self.calls[node_id] = remembered
        self._by_request.setdefault(remembered.message_digests, []).append(node_id)
        node, digests = self._prefixes, remembered.message_digests
        for at in range(0, len(digests) - len(digests) % DIGEST, DIGEST):
            node = node.children.setdefault(digests[at:at + DIGEST], _Prefix())
            node.newest = node_id

    def continued_turn(self, messages: list[ChatMessage], message_digests: bytes,
                       tools_digest: int | None) -> tuple[str, int] | None:
        """The newest earlier call this request continues, and the index of its reply among the messages.

        The last assistant message that follows an earlier request exactly and equals that request's
        reply wins; its tools must be the same, since the earlier prompt was rendered with them.
        """
        for index in range(len(messages) - 1, 0, -1):
            if messages[index].role != "assistant":
                continue
            for node_id in reversed(self._by_request.get(message_digests[:index * DIGEST], ())):
                earlier = self.calls[node_id]
                if earlier.tools_digest == tools_digest and earlier.reply is not None and reply_matches(
                        earlier.reply, messages[index]):
                    return node_id, index
        return None

    def closest(self, message_digests: bytes) -> tuple[str, int] | None:
        """The (newest) earlier call sharing the most leading messages with this request, and how many: a walk
        down the request's messages, whatever the number of earlier calls."""
        node, shared = self._prefixes, 0
        while (child := node.children.get(message_digests[shared * DIGEST:(shared + 1) * DIGEST])) is not None:
            node, shared = child, shared + 1
        return (node.newest, shared) if shared else None


class _Prefix:
    """The calls whose messages begin with one sequence: the newest of them, and the messages that follow."""

    __slots__ = ("children", "newest")

    def __init__(self) -> None:
        self.children: dict[bytes, _Prefix] = {}
        self.newest = ""


def explain_break(index: ReplyIndex, messages: list[ChatMessage], message_digests: bytes, tools_digest: int | None,
                  prompt: bytes, sequence_of: Any, tito: bool) -> PrefixBreak | None:
    """Why a rendered prompt does not continue the earlier call it shares the most messages with.

    `sequence_of(node_id)` gives that call's prompt+completion token text. None when the prompt does
    continue it (a rendered chain, with token in/token out off), when it is the same request re-sent
    (a retry), or when it shares nothing with any earlier call (a new conversation).
    """
    closest = index.closest(message_digests)
    if closest is None:
        return None
    node_id, shared = closest
    earlier = index.calls[node_id]
    sequence: bytes = sequence_of(node_id)
    position = common_tokens(sequence, prompt)
    if position == sequence.count(SEP):
        return None  # the rendered prompt extends the earlier call exactly
    asked = len(earlier.message_digests) // DIGEST
    if earlier.tools_digest != tools_digest:
        cause = "tools_changed"
    elif shared < asked:
        cause = "rewritten_history"
    elif shared == len(messages):
        return None  # the same request again: a retry, which the capture graph's roles deal with
    elif messages[shared].role != "assistant":
        cause = "reply_dropped"
    elif earlier.reply is not None and reply_matches(earlier.reply, messages[shared]):
        cause = "retokenized" if not tito else "template_dropped"
    else:
        cause = "reply_edited"
    return PrefixBreak(position=position, cause=cause, against=node_id)


def common_tokens(a: bytes, b: bytes) -> int:
    """Whole tokens two token texts share from the start."""
    shared = common_prefix_len(a, b)
    return a.count(SEP, 0, a.rfind(SEP, 0, shared) + 1) if shared else 0


def fingerprint(rendered: bytes) -> tuple[int, int]:
    return len(rendered), hash(rendered)


def tail_after(anchor: tuple[int, int] | None, full: bytes, closing: bytes) -> bytes | None:
    """The new messages' rendering, when `full` starts with the earlier conversation's rendering (`anchor`):
    past the first closing of a turn after it (the reply's). None when it does not start so."""
    if anchor is None or len(full) < anchor[0] or hash(full[:anchor[0]]) != anchor[1]:
        return None
    at = (SEP + full).find(SEP + closing, anchor[0])
    return full[at + len(closing):] if at >= 0 else None


def splice_tail(before: bytes, full: bytes, closing: bytes) -> bytes | None:
    """The rendering of the new messages: `full` (the whole conversation) past `before` (up to the reply).

    All three are token texts; `closing` is how the template closes an assistant turn (end-of-turn id
    and separator). When the template renders the earlier history differently once new messages
    follow (Qwen3 drops earlier reasoning), the new messages start after the first closing past the
    tokens `before` and `full` share. None when neither holds.
    """
    if full.startswith(before):
        return full[len(before):]
    shared = full.rfind(SEP, 0, common_prefix_len(before, full)) + 1
    at = (SEP + full).find(SEP + closing, shared)  # a match starting on a token boundary at or after `shared`
    return full[at + len(closing):] if at >= 0 else None
