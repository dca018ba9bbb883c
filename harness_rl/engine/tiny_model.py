"""Build the tiny model offline and deterministically: tokenizer, chat template, random weights.

The tokenizer is a byte-level BPE trained in about a second on the interpreter's own standard
library sources plus agent-style chat text generated from the seed, so nothing is downloaded.
Its `tokenizer.json` is saved as transformers loads it: transformers 5 builds a Qwen2 tokenizer's normalizer
and pre-tokenizer from its class, not from the trained file, so a reader of the file alone (the proxy's
local rendering) would otherwise cut some texts ("a\n\nb") into other ids than the engine does.
The model is a random-init Qwen2 small enough for CPU tests yet with a 64k context, and with an
end-of-turn habit: a constant feature in every embedding drives a fixed `<|im_end|>` logit, so a
sampled reply stops after a few dozen tokens instead of running to `max_tokens`.
"""

import json
import random
import shutil
import sysconfig
from pathlib import Path
from typing import Any

from harness_rl.engine.chat_template import CHAT_TEMPLATE

RECIPE_VERSION = "2"  # bump whenever the build changes, so stale cached builds are rebuilt
VOCAB_SIZE = 4096
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
EOS_WEIGHT = 0.55
CORPUS_BYTES = 3_000_000
STAMP_NAME = "harness_rl_recipe.json"

_WORDS = (
    "the a to of and in is it for on with that this file test run code error fix add read write "
    "list find replace function class return value import module path line change patch build "
    "check output input user assistant tool call result task repo commit diff bug issue pass fail "
    "python shell command directory string number true false null none data config json name "
    "arguments content message update create delete search open close start stop done next"
).split()
_TOOLS = ["bash", "read", "write", "edit", "glob", "grep", "list", "todowrite", "webfetch", "task"]


def default_cache_dir(seed: int) -> Path:
    """`$HARNESS_RL_CACHE/tiny-<seed>`, else `~/.cache/harness-rl/tiny-<seed>`."""
    import os

    root = os.environ.get("HARNESS_RL_CACHE") or Path.home() / ".cache" / "harness-rl"
    return Path(root) / f"tiny-{seed}"


def build_tiny_model(cache_dir: Path, seed: int = 0) -> Path:
    """Build the tiny model into `cache_dir` (or reuse a complete build there) and return it.

    The build happens in a staging directory renamed into place once complete, so concurrent
    builders (parallel test runs sharing `~/.cache`) never see or delete a half-written model.
    """
    from transformers import AutoTokenizer

    cache_dir = Path(cache_dir)
    expected = {"recipe": RECIPE_VERSION, "seed": seed}
    if is_cached(cache_dir, expected):
        return cache_dir
    staging = cache_dir.with_name(cache_dir.name + f".building-{random.getrandbits(32):08x}")
    staging.mkdir(parents=True)
    try:
        tokenizer = _build_tokenizer(seed)
        tokenizer.save_pretrained(staging)
        _build_model(tokenizer, seed).save_pretrained(staging)
        AutoTokenizer.from_pretrained(staging).save_pretrained(staging)  # as read beside a Qwen2 config.json
        publish(staging, cache_dir, expected)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cache_dir


def is_cached(directory: Path, expected: dict[str, Any]) -> bool:
    """Whether `directory` is a finished build of the recipe `expected` (its stamp is written last)."""
    try:
        return bool(json.loads((directory / STAMP_NAME).read_text()) == expected)
    except (OSError, ValueError):
        return False


def publish(staging: Path, cache_dir: Path, expected: dict[str, Any]) -> None:
    """Stamp a finished build and move it into place in one rename; a stale or half-written `cache_dir`
    is replaced, and a concurrent build that finished first is kept."""
    (staging / STAMP_NAME).write_text(json.dumps(expected, indent=2))
    if cache_dir.exists() and not is_cached(cache_dir, expected):
        shutil.rmtree(cache_dir, ignore_errors=True)
    try:
        staging.rename(cache_dir)
    except OSError:
        if not is_cached(cache_dir, expected):
            raise


def _corpus(seed: int) -> list[str]:
    """Standard-library sources (a fixed sorted list) plus generated agent chat text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total > CORPUS_BYTES:
            break
    rng = random.Random(seed)
    texts.extend(_chat_sample(rng) for _ in range(2000))
    return texts


def _chat_sample(rng: random.Random) -> str:
    def sentence() -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."

    call = json.dumps({"name": rng.choice(_TOOLS), "arguments": {"command": sentence(), "path": "src/a.py"}})
    return (
        f"<|im_start|>user\n{sentence()}<|im_end|>\n<|im_start|>assistant\n{sentence()}\n"
        f"<tool_call>\n{call}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
        f"{sentence()}\n</tool_response><|im_end|>\n"
    )


def _build_tokenizer(seed: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKUP_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(seed), trainer=trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=65536,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(tokenizer, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos_id, 0] = EOS_WEIGHT
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model
