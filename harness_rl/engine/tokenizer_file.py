"""A model directory whose `tokenizer.json` is the tokenizer transformers loads from it.

transformers 5 builds some tokenizers from their class rather than from the file beside the weights
(Qwen2's normalizer and pre-tokenizer, for one), so a renderer that reads only the files (the proxy's
local rendering: `tokenizers` and the chat template, without transformers) can encode the same text
to other ids. A hub model's file usually is what its class builds; the tiny model's is not. Saving the
loaded tokenizer beside links to the other files gives a directory where both agree, and vLLM serves
it with the same ids as the original.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def with_loaded_tokenizer(model_dir: Path, out_dir: Path) -> Path:
    """`out_dir`: the model's files linked (its tokenizer files copied as transformers saves them); kept if built."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").is_file():
        return out_dir
    partial = out_dir.with_name(out_dir.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for item in Path(model_dir).iterdir():
        if item.name not in TOKENIZER_FILES:
            (partial / item.name).symlink_to(item.resolve())
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(partial)
    try:
        partial.rename(out_dir)
    except OSError:  # another process built it first
        shutil.rmtree(partial, ignore_errors=True)
    return out_dir
