"""Mistral's own tokenizer for the tests, as vLLM loads it with `--tokenizer-mode mistral`.

mistral-common lives in vLLM's venv only (its numpy pin conflicts with the project's), so the tests start this file
there as a child and ask it over pipes, one JSON line per question:

    .tools/vllm-venv/bin/python tests/mistral_tokenizer.py DIR     # DIR holds tekken.json or tokenizer.model.vN

Its first line tells the vocabulary's size and the bos, eos and pad ids; then each `{"text": ...}` is answered with
the text's ids (control tokens written in the text, such as `[TOOL_CALLS]`, become their ids, as a Hugging Face
tokenizer does with its special tokens), and each `{"ids": [...]}` with their text, control tokens kept (decoded
between them: mistral-common keeping them would write SentencePiece's pieces, `▁` for a space, `<0x0A>` for a
newline).
`MistralTokenizerChild` is the tests' end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import IO, Any


class MistralTokenizerChild:
    """The tests' end of the child: the part of a Hugging Face tokenizer's interface the real-family tier uses."""

    def __init__(self, python: Path, tokenizer_dir: Path) -> None:
        self._child = subprocess.Popen([str(python), __file__, str(tokenizer_dir)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        facts = self._read()
        self.vocab_size: int = facts["vocab_size"]
        self.bos_token_id: int = facts["bos"]
        self.eos_token_id: int = facts["eos"]
        self.pad_token_id: int | None = facts["pad"]

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert not add_special_tokens, "a reply is encoded without bos"
        return self._ask({"text": text})

    def decode(self, ids: list[int]) -> str:
        return self._ask({"ids": list(ids)})

    def close(self) -> None:
        assert self._child.stdin is not None
        self._child.stdin.close()
        self._child.wait(timeout=60)

    def _ask(self, question: dict[str, Any]) -> Any:
        assert self._child.stdin is not None
        self._child.stdin.write(json.dumps(question) + "\n")
        self._child.stdin.flush()
        return self._read()

    def _read(self) -> Any:
        assert self._child.stdout is not None
        line = self._child.stdout.readline()
        if not line:
            raise RuntimeError(f"the Mistral tokenizer child exited ({self._child.wait()}); its error is above")
        return json.loads(line)


def serve(tokenizer_dir: str, answers: IO[str]) -> None:
    """Answer questions from stdin on `answers` with vLLM's MistralTokenizer of `tokenizer_dir`."""
    from vllm.tokenizers.mistral import MistralTokenizer

    tokenizer = MistralTokenizer.from_pretrained(tokenizer_dir)
    special = dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True))
    names = {token_id: piece for piece, token_id in special.items()}
    pieces = re.compile("(" + "|".join(map(re.escape, sorted(special, key=len, reverse=True))) + ")")
    pad = tokenizer.pad_token_id
    facts = {"vocab_size": len(tokenizer), "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
             "pad": pad if pad >= 0 else None}
    print(json.dumps(facts), file=answers, flush=True)
    for line in sys.stdin:
        question = json.loads(line)
        if "text" in question:
            answer: Any = [i for part in pieces.split(question["text"]) if part for i in (
                [special[part]] if part in special else tokenizer.encode(part, add_special_tokens=False))]
        else:
            answer = text_of(tokenizer, question["ids"], names)
        print(json.dumps(answer), file=answers, flush=True)


def text_of(tokenizer: Any, ids: list[int], names: dict[int, str]) -> str:
    """The ids' text: each control token by its name, the ids between them decoded."""
    text, run = [], []
    for token_id in ids:
        if token_id in names:
            text += [tokenizer.decode(run, skip_special_tokens=True), names[token_id]]
            run = []
        else:
            run.append(token_id)
    return "".join([*text, tokenizer.decode(run, skip_special_tokens=True)])


if __name__ == "__main__":
    # vLLM logs to stdout: answers go out on the pipe's own descriptor, everything else to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    serve(sys.argv[1], answers)
