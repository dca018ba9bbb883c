"""The prompt ids of one agent call: spliced onto the earlier turn it continues, or rendered whole.

Token in, token out (`proxy.capture.tito`) sends an agent's earlier replies back as the ids the engine sampled,
so a call that continues one needs only the rendering of what follows the reply. That part is rendered
alone, at a cost that does not grow with the conversation: the reply and the messages after it, behind a
one-message probe (`PROBE`), with the call's tools and template arguments; the new messages' rendering
is what follows the reply's closing. The probe's own rendering (`head`) is learned once per tool set and
must open every such suffix, so a template that renders the probe differently once more follows is seen
at once.

Most templates render a message the same wherever it sits; not all do (one that numbers tool calls
across the conversation, one that moves the system prompt next to the last user message). So on a sample
of turns (a session's first four spliced turns, then one in 32, or one in N of a conversation N times
`check_tokens` long: `ReplyIndex.check_due`), the whole conversation is rendered too and
the suffix's tail must be where the whole rendering ends. A difference, or a suffix the engine cannot
render, makes that turn use the whole rendering, records why on the turn (`render_note`), and the
session renders whole from then on. Whatever was rendered, the turn records the ids that were sampled
from, so a trace is exact either way; the check keeps the prompt what the template would make.

An engine whose every rendering ends with the next turn's opening, asked or not (vLLM's harmony rendering of
gpt-oss), shows no closing apart from that opening (`Closing.opening`): there the reply and what follows it are
rendered behind the probe, and the reply alone so, and the new messages' rendering is what the first has past
the second less the opening; the stop token the reply sampled (`<|call|>`, `<|return|>`) closes it.

With the model's tokenizer and template at hand (`proxy.capture.local_render`), renders are made in the proxy
instead, the engine's rendering of the whole conversation serving as the check; when they disagree, the
proxy's renderer is turned off and the engine renders the new messages again before the template is
blamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import msgspec

from harness_rl.trace import PrefixBreak, PromptSource
from proxy.capture.local_render import LocalRendering, LocalTemplate, LocalTemplateError, shape_of
from proxy.capture.session import Session
from proxy.capture.tito import common_tokens, explain_break, fingerprint, splice_tail, tail_after
from proxy.chat import ChatCall
from proxy.errors import ProxyError
from proxy.tokens import SEP
from proxy.upstream.client import PROBE, ChatRender, Closing, EngineClient, Rendered

log = logging.getLogger(__name__)
AUTO = "auto"
START_QUERY_S = 5.0  # how long a starting proxy waits for its engine to name its model
MAX_HEADS = 256  # probe renderings kept, one per distinct tool set and template arguments
_ENCODER = msgspec.json.Encoder()

SUFFIX = "suffix"  # the new messages rendered alone, unchecked
CHECKED = "suffix, checked"  # ... and equal to the whole conversation's rendering
WHOLE = "whole"  # the whole conversation rendered (this session renders whole)


class Prompt(msgspec.Struct, frozen=True):
    ids: Rendered  # what the engine samples from
    source: PromptSource
    prefix_break: PrefixBreak | None = None
    rendered: tuple[int, int] | None = None  # `tito.fingerprint` of the whole conversation's rendering, if made
    render_note: str | None = None  # how a spliced prompt's new messages were rendered (SUFFIX, CHECKED, WHOLE)
    render_mismatch: str | None = None  # why a rendering made alone, or in the proxy, was not used
    rendered_by: str = "engine"  # or "proxy"


class PromptMaker:
    """Makes each call's prompt ids (see the module's docstring); with `local`, renders in the proxy where it can."""

    def __init__(self, engine: EngineClient, *, tito: bool, check_tokens: int | None,
                 local_render: str | None = None) -> None:
        self.engine = engine
        self.tito = tito
        self.check_tokens = check_tokens
        self.local_render = local_render  # a model directory, "auto" (the engine's, if readable here) or None
        self.settled = False  # whether "auto" has become a directory or None, and the choice been said
        self.said: str | None = None  # the line that said it (the faces print it: `serve proxy`, `train`)
        self.local: LocalRendering | None = None
        self._loading = asyncio.Lock()
        self._heads: dict[tuple[bool, bytes], Rendered] = {}

    async def make(self, session: Session, call: ChatCall, conversation: ChatRender, message_digests: bytes,
                   tools_digest: int | None) -> Prompt:
        continued = session.replies.continued_turn(call.messages, message_digests, tools_digest) \
            if self.tito else None
        if continued is None:
            full, mismatch, by = await self._rendered_whole(conversation, call, tools_digest)
            reason = explain_break(session.replies, call.messages, message_digests, tools_digest, full.text,
                                   session.graph.sequence, self.tito)
            return Prompt(full, "rendered", reason, rendered=fingerprint(full.text), render_mismatch=mismatch,
                          rendered_by=by)
        node_id, reply_at = continued
        closing = await self.engine.closing()
        replies = session.replies
        if closing is None or (closing.opening and not replies.renders_suffix):
            return await self._unspliced(session, node_id, conversation)
        if closing.opening:
            return await self._after_opening(session, node_id, reply_at, conversation, closing)
        marker = closing.marker
        earlier = session.graph.sequence(node_id)
        if not replies.renders_suffix:
            return await self._whole(session, node_id, reply_at, conversation, earlier, closing, WHOLE)
        local = await self._local_ready()
        check = replies.check_due(session.graph.nodes[node_id].tokens, self.check_tokens) or (
            local and self.local is not None and self.local.warming)
        (tail, why), whole = await asyncio.gather(self._suffix_tail(conversation, reply_at, marker, local),
                                                  self._render_if(check, conversation))
        if tail is not None and whole is not None and not _ends_with_tail(whole.text, tail, marker):
            why = _mismatch(whole.text, tail)
        if why is not None and local:  # the proxy's rendering, or a template that renders by place: ask the engine
            ours, first = tail, why
            local = False
            (tail, why) = await self._suffix_tail(conversation, reply_at, marker, False)
            if tail is not None and whole is not None and not _ends_with_tail(whole.text, tail, marker):
                why = _mismatch(whole.text, tail)
            if tail != ours:  # the engine renders the new messages otherwise: the proxy's rendering is to blame
                self._local_disagrees(first)
        if why is not None or tail is None:
            replies.renders_suffix = False
            return await self._whole(session, node_id, reply_at, conversation, earlier, closing, WHOLE, why, whole)
        if local and whole is not None and self.local is not None:
            self.local.agreed()
        prompt = _spliced(session, node_id, earlier, closing, tail, CHECKED if check else SUFFIX,
                          rendered=fingerprint(whole.text) if whole is not None else None)
        return msgspec.structs.replace(prompt, rendered_by="proxy" if local else "engine")

    async def _after_opening(self, session: Session, node_id: str, reply_at: int, conversation: ChatRender,
                             closing: Closing) -> Prompt:
        """A continued call on an engine whose every rendering ends with the next turn's opening (vLLM's harmony
        for gpt-oss), where no probe shows a closing apart from the reply. The new messages' rendering is the
        reply and what follows it rendered behind the probe, past the reply alone rendered so, less the opening
        both end with. The reply is closed by the stop token it sampled (`Closing.after`); one a stop string may
        have ended is rendered whole. Checked against the whole conversation as a suffix is; a difference makes
        the session render whole from then on."""
        replies = session.replies
        stopped = replies.calls[node_id].stopped
        if stopped is None:
            return await self._unspliced(session, node_id, conversation)
        following = [PROBE, *conversation.messages[reply_at:]]
        check = replies.check_due(session.graph.nodes[node_id].tokens, self.check_tokens)
        try:
            alone, more, whole = await asyncio.gather(
                self.engine.render(msgspec.structs.replace(conversation, messages=following[:2])),
                self.engine.render(msgspec.structs.replace(conversation, messages=following)),
                self._render_if(check, conversation))
        except ProxyError as exc:
            if exc.status >= 500:
                raise
            replies.renders_suffix = False
            return await self._unspliced(session, node_id, conversation,
                                         f"the engine cannot render the new messages alone: {exc.message}")
        reply_end = len(alone.text) - len(closing.opening)
        tail = more.text[reply_end:]
        why = None
        if not (SEP + alone.text).endswith(SEP + closing.opening) or not more.text.startswith(alone.text[:reply_end]):
            why = "the template renders the reply differently when more messages follow it"
        elif whole is not None and not _ends_with_tail(whole.text, tail, b""):
            why = _mismatch(whole.text, tail)
        if why is not None:
            replies.renders_suffix = False
            return await self._unspliced(session, node_id, conversation, why, whole)
        earlier = session.graph.sequence(node_id)
        return _spliced(session, node_id, earlier, closing, tail, CHECKED if check else SUFFIX,
                        rendered=fingerprint(whole.text) if whole is not None else None, stopped=stopped)

    async def _rendered_whole(self, conversation: ChatRender, call: ChatCall,
                              tools_digest: int | None) -> tuple[Rendered, str | None, str]:
        """The whole conversation's prompt ids, rendered here when the proxy can (and checked against the engine's
        as `LocalRendering.check_due` says for its shape; the engine's when they differ)."""
        local = self.local.render(conversation) if await self._local_ready() and self.local is not None else None
        if local is None:
            return await self.engine.render(conversation), None, "engine"
        assert self.local is not None
        shape = shape_of(call.messages, conversation, tools_digest)
        if not self.local.check_due(shape):
            return local, None, "proxy"
        full = await self.engine.render(conversation)
        if full.text == local.text:
            self.local.agreed(shape)
            return local, None, "proxy"
        mismatch = (f"rendered in the proxy ({local.count} tokens), the conversation differs from the engine's "
                    f"rendering ({full.count} tokens) after {common_tokens(full.text, local.text)} tokens")
        self._local_disagrees(mismatch)
        return full, mismatch, "engine"

    async def _suffix_tail(self, conversation: ChatRender, reply_at: int, marker: bytes,
                           local: bool) -> tuple[bytes | None, str | None]:
        """The rendering of the messages after the reply at `reply_at`, rendered alone; or None and why not."""
        suffix = msgspec.structs.replace(conversation, messages=[PROBE, *conversation.messages[reply_at:]])
        try:
            head, rendered = await asyncio.gather(self._head(conversation, local), self._render(suffix, local))
        except ProxyError as exc:
            if exc.status >= 500:
                raise
            return None, f"the engine cannot render the new messages alone: {exc.message}"
        if not rendered.text.startswith(head.text):
            return None, "the template renders the probe differently when more messages follow it"
        at = (SEP + rendered.text).find(SEP + marker, len(head.text))
        if at < 0:
            return None, "the reply rendered alone has no closing"
        return rendered.text[at + len(marker):], None

    async def _render(self, request: ChatRender, local: bool) -> Rendered:
        """Rendered in the proxy when asked and it can, else by the engine."""
        rendered = self.local.render(request) if local and self.local is not None else None
        return rendered if rendered is not None else await self.engine.render(request)

    async def _render_if(self, wanted: bool, conversation: ChatRender) -> Rendered | None:
        return await self.engine.render(conversation) if wanted else None

    async def _head(self, conversation: ChatRender, local: bool) -> Rendered:
        """The probe's rendering with this call's tools and template arguments (learned once per set)."""
        key = (local, _ENCODER.encode(msgspec.structs.replace(conversation, messages=[])))
        head = self._heads.get(key)
        if head is None:
            head = await self._render(msgspec.structs.replace(conversation, messages=[PROBE],
                                                              add_generation_prompt=False), local)
            if len(self._heads) >= MAX_HEADS:
                self._heads.clear()
            self._heads[key] = head
        return head

    async def settle_source(self) -> None:
        """Choose the tokenizer files prompts are rendered with, and say which in one line, once: as the proxy
        starts, or at the first call after its engine first answers (until then, the engine renders)."""
        if self.settled:
            return
        source = self.local_render
        if source == AUTO:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.engine.served_model(), START_QUERY_S)
            if self.settled or not self.engine.described:  # settled meanwhile by a call, or no answer yet
                return
            root = self.engine.model_root
            source = model_files_here(root)
            where = ("the engine's model directory" if source == root else
                     f"this machine's Hugging Face cache of {root}")
            why_not = (f"its model {root} has no tokenizer.json on this machine (a local directory, or the Hugging "
                       "Face cache); --local-render DIR names one")
        else:
            where, why_not = "--local-render", "--local-render none"
        self.local_render, self.settled = source, True
        self.said = (f"prompts are rendered by the engine: {why_not}" if source is None else
                     f"prompts are rendered in the proxy with the tokenizer and chat template in {source} ({where})")
        log.info("%s", self.said)

    async def _local_ready(self) -> bool:
        """Whether renders are made in the proxy; the first call loads the files and asks the engine to agree (once,
        while other calls wait: an engine that cannot answer leaves it to the next call)."""
        if self.local_render is not None or not self.settled:
            async with self._loading:
                await self.settle_source()
                if self.settled and self.local_render is not None:
                    local = await self._load_local(self.local_render)
                    if local is not None:
                        await local.ready()
                    self.local, self.local_render = local, None
        return self.local is not None and self.local.usable

    async def _load_local(self, source: str) -> LocalRendering | None:
        """The tokenizer and template in `source`, or None (saying why) where they cannot be used."""
        try:
            template = await asyncio.to_thread(LocalTemplate.load, source)  # a large tokenizer takes a while
        except (LocalTemplateError, OSError, ValueError) as exc:
            self.said = f"prompts are rendered by the engine, not in the proxy: {exc}"
            log.warning("%s", self.said)
            return None
        return LocalRendering(template, self.engine)

    def _local_disagrees(self, why: str) -> None:
        if self.local is not None:
            self.local.turn_off(f"its rendering differs from the engine's: {why}")

    async def _whole(self, session: Session, node_id: str, reply_at: int, conversation: ChatRender, earlier: bytes,
                     closing: Closing, note: str, mismatch: str | None = None, full: Rendered | None = None) -> Prompt:
        """Splice with the tail of the whole conversation's rendering (rendered here unless given)."""
        full = full or await self.engine.render(conversation)
        marker = closing.marker
        tail = tail_after(session.replies.calls[node_id].rendered, full.text, marker)
        if tail is None:  # the template re-rendered the earlier history: find the reply's end the long way
            before = msgspec.structs.replace(conversation, messages=conversation.messages[:reply_at + 1],
                                             add_generation_prompt=False)
            tail = splice_tail((await self.engine.render(before)).text, full.text, marker)
        if tail is None:
            dropped = PrefixBreak(position=common_tokens(earlier, full.text), cause="template_dropped",
                                  against=node_id)
            return Prompt(full, "rendered", dropped, rendered=fingerprint(full.text), render_mismatch=mismatch)
        return _spliced(session, node_id, earlier, closing, tail, note, fingerprint(full.text), mismatch)

    async def _unspliced(self, session: Session, node_id: str, conversation: ChatRender, mismatch: str | None = None,
                         full: Rendered | None = None) -> Prompt:
        """No splice can be made (the engine cannot say how its template closes a turn, or the new messages
        rendered alone did not fit): render whole (unless given), the chain broken where it breaks."""
        full = full or await self.engine.render(conversation)
        dropped = PrefixBreak(position=common_tokens(session.graph.sequence(node_id), full.text),
                              cause="template_dropped", against=node_id)
        return Prompt(full, "rendered", dropped, rendered=fingerprint(full.text), render_mismatch=mismatch)


def model_files_here(root: str | None) -> str | None:
    """Where this machine holds the served model's tokenizer and chat template: the engine's model directory when
    it is one here, or, for a hub id (`vllm serve Qwen/Qwen3-8B`), its snapshot in the Hugging Face cache."""
    if not root:
        return None
    if Path(root, "tokenizer.json").is_file():
        return root
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(root, "tokenizer.json")
    except ValueError:  # not a hub id (a directory of another machine)
        return None
    return str(Path(cached).parent) if isinstance(cached, str) else None


def _spliced(session: Session, node_id: str, earlier: bytes, closing: Closing, tail: bytes, note: str,
             rendered: tuple[int, int] | None = None, mismatch: str | None = None, stopped: bool = False) -> Prompt:
    """earlier prompt + sampled completion + the template's closing + the new messages' rendering."""
    close = closing.after(earlier, stopped)
    count = session.graph.nodes[node_id].tokens + close.count(SEP) + tail.count(SEP)
    return Prompt(Rendered(earlier + close + tail, count), "spliced", rendered=rendered, render_note=note,
                  render_mismatch=mismatch)


def _ends_with_tail(full: bytes, tail: bytes, marker: bytes) -> bool:
    """Whether the whole rendering ends with `tail` right after a turn's closing (`marker`, which may be empty), on
    a token boundary."""
    head = full[:len(full) - len(tail)]
    before = head[:len(head) - len(marker)]
    return full.endswith(tail) and head.endswith(marker) and (not before or before.endswith(SEP))


def _mismatch(full: bytes, tail: bytes) -> str:
    """Where the new messages rendered alone stop matching the end of the whole conversation's rendering."""
    n_tail, n_full = tail.count(SEP), full.count(SEP)
    reversed_tail = SEP.join(tail.split(SEP)[-2::-1]) + SEP
    reversed_full = SEP.join(full.split(SEP)[-2::-1]) + SEP
    same_end = common_tokens(reversed_tail, reversed_full)
    return (f"the new messages rendered alone ({n_tail} tokens) differ from the end of the whole conversation's "
            f"rendering ({n_full} tokens): the last {same_end} tokens agree")
