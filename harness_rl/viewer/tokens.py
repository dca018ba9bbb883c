"""Token text for the viewer: find the run's tokenizer offline and decode with `tokenizers` alone.

Only `tokenizer.json` files already on disk are read (a checkpoint's `model/`, a local model
directory, or the Hugging Face cache); nothing is downloaded and transformers is never imported.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer the user named cannot be used."""


class TokenText:
    """Decodes token ids to text; one instance per page, remembering every id it was asked for."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self._tokenizer = Tokenizer.from_file(str(path))
        self.vocab: dict[str, str] = {}

    def pieces(self, ids: list[int]) -> None:
        """Record each id's own text in `vocab` (what a span shows)."""
        for token_id in ids:
            key = str(token_id)
            if key not in self.vocab:
                self.vocab[key] = self._tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def open_tokenizer(path: Path) -> TokenText:
    """The tokenizer at `path` (a `tokenizer.json` or a directory holding one), or TokenizerError."""
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"no {TOKENIZER_FILE} at {path}")
    try:
        return TokenText(file)
    except ImportError:
        raise TokenizerError("reading token text needs the tokenizers package: pip install tokenizers") from None
    except Exception as exc:  # the tokenizers library raises its own exception type for bad files
        raise TokenizerError(f"{file}: not a tokenizer: {exc}") from None


def find_tokenizer(run_dir: Path) -> Path | None:
    """The run's `tokenizer.json`: the newest checkpoint's, else the configured model's, if on disk."""
    checkpoints = sorted(run_dir.glob(f"checkpoints/step-*/model/{TOKENIZER_FILE}"), reverse=True)
    if checkpoints:
        return checkpoints[0]
    model = configured_model(run_dir)
    if model is None:
        return None
    local = Path(model).expanduser()
    if (local / TOKENIZER_FILE).is_file():
        return local / TOKENIZER_FILE
    return _hub_cache_tokenizer(model)


def configured_model(run_dir: Path) -> str | None:
    """The model named in the run's `config.toml` (`[engine] model` or top-level `model`) or `config.json`."""
    config: dict[str, Any] = {}
    try:
        if (run_dir / "config.toml").is_file():
            config = tomllib.loads((run_dir / "config.toml").read_text())
        elif (run_dir / "config.json").is_file():
            config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    engine = config.get("engine")
    model = engine.get("model") if isinstance(engine, dict) else config.get("model")
    return model if isinstance(model, str) and model else None


def _hub_cache_tokenizer(repo_id: str) -> Path | None:
    """A `tokenizer.json` of `repo_id` already in the local Hugging Face cache (never downloaded)."""
    if repo_id.count("/") != 1:
        return None
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    cache = Path(os.environ.get("HF_HUB_CACHE", hf_home / "hub"))
    snapshots = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob(f"*/{TOKENIZER_FILE}"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None
