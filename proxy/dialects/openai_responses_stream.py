"""OpenAI Responses streamed: typed events as the engine samples, in the order codex and the SDKs read them.

`response.created` and `response.in_progress`; a reasoning item whose summary and reasoning text grow
with each reasoning delta, closed when the text starts; a message item whose `output_text` grows with
each content delta; once the turn is recorded, each function call as a whole item, then
`response.completed` (or `response.incomplete` when the answer hit its token limit) with the full
Response, whose items are the very items streamed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from harness_rl.trace import Reply
from proxy.chat import Answer, ChatCall
from proxy.dialects.openai_responses import call_item, message_item, reasoning_item, response_dict
from proxy.live import AnswerHead, TextKind

_ENCODER = msgspec.json.Encoder()


class ResponsesStream:
    def __init__(self, head: AnswerHead, call: ChatCall) -> None:
        self.head = head
        self.call = call
        self.key = head.id.removeprefix("resp_")
        self.sequence = 0
        self.index = -1  # the open item's output index
        self.kind: TextKind | None = None  # the open item's kind
        self.texts = {"reasoning": "", "content": ""}
        self.messages = 0  # message items streamed

    def _event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _ENCODER.encode(body) + b"\n\n"

    def _at(self, **more: Any) -> dict[str, Any]:
        return {"item_id": self._item_id(), "output_index": self.index, **more}

    def _item_id(self) -> str:
        return f"rs_{self.key}" if self.kind == "reasoning" else f"msg_{self.key}"

    def open(self) -> bytes:
        head = self.head
        opening = response_dict(Answer(id=head.id, created=head.created, model=head.model, reply=Reply(),
                                       finish_reason="", prompt_tokens=head.prompt_tokens, completion_tokens=0),
                                self.call, output=[], status="in_progress")
        return self._event("response.created", response=opening) + self._event("response.in_progress",
                                                                              response=opening)

    def _start(self, kind: TextKind) -> bytes:
        self.index += 1
        self.kind = kind
        if kind == "reasoning":
            item = {**reasoning_item(self.key, ""), "summary": [], "content": []}
            return (self._event("response.output_item.added", output_index=self.index, item=item)
                    + self._event("response.reasoning_summary_part.added", **self._at(summary_index=0),
                                  part={"type": "summary_text", "text": ""}))
        self.messages += 1
        item = {**message_item(self.key, "", "in_progress"), "content": []}
        return (self._event("response.output_item.added", output_index=self.index, item=item)
                + self._event("response.content_part.added", **self._at(content_index=0),
                              part={"type": "output_text", "text": "", "annotations": []}))

    def _close(self, status: str) -> bytes:
        kind, text = self.kind, self.texts[self.kind] if self.kind else ""
        if kind is None:
            return b""
        if kind == "reasoning":
            item = reasoning_item(self.key, text)
            out = (self._event("response.reasoning_summary_text.done", **self._at(summary_index=0), text=text)
                   + self._event("response.reasoning_summary_part.done", **self._at(summary_index=0),
                                 part=item["summary"][0])
                   + self._event("response.reasoning_text.done", **self._at(content_index=0), text=text))
        else:
            item = message_item(self.key, text, status)
            out = (self._event("response.output_text.done", **self._at(content_index=0), text=text, logprobs=[])
                   + self._event("response.content_part.done", **self._at(content_index=0),
                                 part=item["content"][0]))
        self.kind = None
        return out + self._event("response.output_item.done", output_index=self.index, item=item)

    def text(self, kind: TextKind, text: str) -> bytes:
        if not text:
            return b""
        out = b"" if self.kind == kind else self._close("completed") + self._start(kind)
        self.texts[kind] += text
        if kind == "reasoning":
            return out + (self._event("response.reasoning_summary_text.delta", **self._at(summary_index=0),
                                      delta=text)
                          + self._event("response.reasoning_text.delta", **self._at(content_index=0), delta=text))
        return out + self._event("response.output_text.delta", **self._at(content_index=0), delta=text, logprobs=[])

    def finish(self, answer: Answer) -> bytes:
        status = "incomplete" if answer.finish_reason == "length" else "completed"
        reply = answer.reply
        out = [self._close(status)]
        if not self.messages and not (reply.tool_calls or reply.reasoning):  # an empty answer is an empty message
            out.append(self._start("content") + self._close(status))
        for i, tool_call in enumerate(reply.tool_calls):
            self.index += 1
            item = call_item(self.key, i, tool_call, status)
            at = {"item_id": item["id"], "output_index": self.index}
            out.append(self._event("response.output_item.added", output_index=self.index,
                                   item={**item, "status": "in_progress", "arguments": ""}))
            if item["arguments"]:
                out.append(self._event("response.function_call_arguments.delta", **at, delta=item["arguments"]))
            out.append(self._event("response.function_call_arguments.done", **at, name=item["name"],
                                   arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=self.index, item=item))
        final = response_dict(answer, self.call)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=final))
        return b"".join(out)
