"""Rejection-sampling fine-tuning (RFT), or behaviour cloning, from captured traces.

The algorithm: from a pile of captured traces keep those whose verifier reward reached a threshold
(the verifier is the rejection step), turn each into the learner's own rows (`rows.trace_rows`:
turns merged by exact token prefix, mask 1 exactly on the agent turns' sampled completion tokens),
pack the rows padding-free (`packing.pack`), and minimise the mean cross-entropy of the masked
tokens with AdamW: one optimizer step per packed micro-batch, every micro-batch once per epoch, in
an order drawn from the seed. Plain maximum likelihood: no advantages, no ratio, no reference model.

What it drops, and why:
- traces below the threshold, and traces without a reward (unscorable: `None` never passes);
- traces that cannot be read or fail validation (the learner would refuse them too); counted;
- every mask-0 token: prompts, tool outputs, chat-template tokens, auxiliary and discarded turns
  (titles, retries) and completion tokens the proxy masked. The agent did not choose them or never
  received them; cloning them would teach the model to imitate its environment;
- behaviour logprobs and policy versions: maximum likelihood needs no importance correction, so a
  trace from any policy (a teacher, a bigger model, forced completions) trains the same way.

Deterministic given the seed on a CPU (on a GPU up to the kernels' own nondeterminism).
"""

from __future__ import annotations

import glob
import math
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from harness_rl.cpu_threads import set_threads
from harness_rl.learner.config import SftConfig
from harness_rl.learner.distributed import torch_device
from harness_rl.learner.learner import attention_kernel
from harness_rl.learner.packing import MicroBatch, pack, packed_logprobs
from harness_rl.learner.rows import trace_rows
from harness_rl.learner.samples import Sample
from harness_rl.trace import TraceFormatError, TraceValidationError, TrainingTrace

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SUMMARY_FILE = "sft.json"


class SftError(ValueError):
    """Bad input to `sft` (no traces match, none pass, no model): a one-line message for the user."""


class Selection(msgspec.Struct, kw_only=True):
    """Which trace files passed the rejection step, and how many did not, by reason."""

    kept: list[str]
    below_min_reward: int = 0
    no_reward: int = 0
    invalid: int = 0


class SftSummary(msgspec.Struct, kw_only=True):
    """What a run did (written to `output_dir/sft.json`)."""

    model: str
    min_reward: float
    epochs: int
    learning_rate: float
    token_budget: int
    seed: int
    selection: Selection
    rows: int
    trained_tokens: int
    forwarded_tokens: int
    steps: int
    epoch_loss: list[float]  # mean token NLL over each epoch, as trained (weights moving)
    initial_loss: float  # mean token NLL of all trained tokens before training
    final_loss: float  # and after
    duration_s: float


def trace_files(source: str) -> list[Path]:
    """A directory's `*.json` files, or a glob's matches, sorted; SftError when there are none."""
    path = Path(source).expanduser()
    files = sorted(path.glob("*.json")) if path.is_dir() else sorted(Path(p) for p in glob.glob(source))
    files = [f for f in files if f.is_file()]
    if not files:
        raise SftError(f"no trace files match {source!r} (a directory of *.json traces or a glob)")
    return files


def trace_reward(trace: TrainingTrace) -> float | None:
    """`metadata["reward"]` when it is a finite number, else None (unscorable)."""
    value = trace.metadata.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def select_traces(files: Sequence[Path], min_reward: float) -> tuple[list[TrainingTrace], Selection]:
    """The rejection step: the valid traces whose reward is at least `min_reward`."""
    traces: list[TrainingTrace] = []
    selection = Selection(kept=[])
    for file in files:
        try:
            trace = TrainingTrace.load(file).validate()
        except (TraceFormatError, TraceValidationError, OSError):
            selection.invalid += 1
            continue
        reward = trace_reward(trace)
        if reward is None:
            selection.no_reward += 1
        elif reward < min_reward:
            selection.below_min_reward += 1
        else:
            traces.append(trace)
            selection.kept.append(str(file))
    return traces, selection


def sft_batches(traces: Sequence[TrainingTrace], token_budget: int) -> list[MicroBatch]:
    """The traces' rows that train anything, packed; every masked agent token is a target exactly once."""
    samples = [Sample(row, trace.rollout_id, advantage=1.0, weight=1.0)
               for trace in traces for row in trace_rows(trace) if row.n_trained]
    return pack(samples, token_budget)


def batch_nll(model: PreTrainedModel, batch: MicroBatch) -> torch.Tensor:
    """Summed negative log-likelihood of the batch's trained tokens (temperature 1)."""
    logps, _ = packed_logprobs(model, batch, temperature=1.0)
    return -logps.sum()


def mean_nll(model: PreTrainedModel, batches: Sequence[MicroBatch], device: torch.device) -> float:
    """Mean token NLL over all batches, without gradients."""
    total, tokens = 0.0, 0
    with torch.no_grad(), _autocast(device):
        for batch in batches:
            total += float(batch_nll(model, batch.to(device)))
            tokens += batch.n_trained
    return total / tokens


def sft(config: SftConfig, progress: bool = True) -> SftSummary:
    """Select, pack, train, and write a complete model directory to `config.output_dir`."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model_dir = model_path(config.model)
    output_dir = Path(config.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise SftError(f"--output-dir {output_dir} is a file: name a new directory")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise SftError(f"{output_dir} already exists and is not empty: choose another --output-dir")
    traces, selection = select_traces(trace_files(config.traces), config.min_reward)
    if not traces:
        raise SftError(f"none of the traces passes --min-reward {config.min_reward:g} "
                       f"({selection.below_min_reward} below it, {selection.no_reward} without a reward, "
                       f"{selection.invalid} unreadable or invalid)")
    batches = sft_batches(traces, config.token_budget)
    if not batches:
        raise SftError("the selected traces hold no trained tokens (no agent turn with a loss mask of 1)")

    random.seed(config.seed)
    torch.manual_seed(config.seed)
    order_rng = random.Random(config.seed)
    device = torch.device(torch_device(config.device))
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                      attn_implementation=attention_kernel(device))
    model.to(device)
    if device.type == "cpu":
        set_threads(model)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf

    model.eval()
    initial_loss = mean_nll(model, batches, device)
    model.train()
    epoch_loss: list[float] = []
    bar = tqdm(total=config.epochs * len(batches), desc="sft", unit="step", disable=not progress)
    for epoch in range(config.epochs):
        order = list(range(len(batches)))
        order_rng.shuffle(order)
        total, tokens = 0.0, 0
        for index in order:
            batch = batches[index].to(device)
            with _autocast(device):
                nll = batch_nll(model, batch)
            (nll / batch.n_trained).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total, tokens = total + nll.item(), tokens + batch.n_trained
            bar.update()
            bar.set_postfix(epoch=epoch + 1, loss=f"{total / tokens:.3f}")
        epoch_loss.append(total / tokens)
    bar.close()
    model.eval()
    final_loss = mean_nll(model, batches, device)

    save_model_dir(model, AutoTokenizer.from_pretrained(model_dir), output_dir)
    summary = SftSummary(
        model=str(config.model), min_reward=config.min_reward, epochs=config.epochs,
        learning_rate=config.learning_rate, token_budget=config.token_budget, seed=config.seed,
        selection=selection, rows=sum(len(b.row_lengths) for b in batches),
        trained_tokens=sum(b.n_trained for b in batches), forwarded_tokens=sum(b.n_tokens for b in batches),
        steps=config.epochs * len(batches), epoch_loss=epoch_loss, initial_loss=initial_loss,
        final_loss=final_loss, duration_s=time.perf_counter() - started)
    (output_dir / SUMMARY_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    return summary


def model_path(model: str) -> Path:
    """The model directory to start from (`tiny` and `tiny-agent` are resolved to theirs by the command)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        raise SftError(f"--model {model}: not a model directory (no config.json); give a local model dir, tiny "
                       "or tiny-agent")
    return path


def save_model_dir(model: Any, tokenizer: Any, output_dir: Path) -> None:
    """Weights, config, generation config and tokenizer, staged then renamed so it is never half written."""
    staging = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if output_dir.exists():
        output_dir.rmdir()  # checked empty before training
    staging.rename(output_dir)


def _autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
