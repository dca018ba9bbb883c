"""Forced completions: scripted answers for driving real agent CLIs with a random model in tests.

Two queues: a chat request that carries tools takes the next text from `tools`, a tool-less one
(opencode's title call, say) from `no_tools`; an empty queue means normal sampling. A request to
`/inference/v1/generate` has only ids: it takes the `tools` queue when its prompt lists tools. The engine then
teacher-forces the text's token ids and still reports the model's own logprobs for them.

Only `create_app(..., forced_completions=True)` (`harness-rl serve engine
--enable-forced-completions`) mounts the route that fills the queues, so a server built any other
way, including every engine `harness-rl train` starts, can only sample.
"""

from collections import deque
from threading import Lock

from harness_rl.engine.tiny_model import EOS_TOKEN

TOOLS_BLOCK = "<tools>\n"


class ForcedCompletions:
    """The two FIFO queues of scripted texts."""

    def __init__(self) -> None:
        self._lock = Lock()
        self._tools: deque[str] = deque()
        self._no_tools: deque[str] = deque()

    def extend(self, tools: list[str], no_tools: list[str]) -> None:
        with self._lock:
            self._tools.extend(tools)
            self._no_tools.extend(no_tools)

    def pop(self, has_tools: bool) -> str | None:
        """The next scripted text for a request with or without tools, or None to sample."""
        with self._lock:
            queue = self._tools if has_tools else self._no_tools
            return queue.popleft() if queue else None

    def clear(self) -> None:
        with self._lock:
            self._tools.clear()
            self._no_tools.clear()

    def remaining(self) -> dict[str, list[str]]:
        with self._lock:
            return {"tools": list(self._tools), "no_tools": list(self._no_tools)}


def prompt_has_tools(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether a prompt given as ids was rendered with tools (its system turn lists them in a
    `<tools>` block, as the hermes-style templates write it): which queue a generate request takes."""
    return TOOLS_BLOCK in tokenizer.decode(prompt_ids)


def forced_token_ids(tokenizer, text: str) -> list[int]:
    """The text's token ids, ending with the end-of-turn token (appended unless already there)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if eos is None or eos == tokenizer.unk_token_id:
        eos = tokenizer.eos_token_id
    if not ids or ids[-1] != eos:
        ids.append(eos)
    return ids
