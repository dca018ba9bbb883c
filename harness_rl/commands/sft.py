"""`harness-rl sft`: rejection-sampling fine-tuning (behaviour cloning) from captured traces."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "sft", help="fine-tune a model on the trained tokens of traces that reached a reward",
        description="Rejection-sampling fine-tuning: keep the traces whose metadata reward is at least "
                    "--min-reward, and train cross-entropy on their agent turns' sampled tokens (the "
                    "learner's rows, packing and masks). Writes a model directory usable as --model.")
    parser.add_argument("--traces", required=True, metavar="DIR|GLOB",
                        help="a directory of *.json traces (e.g. runs/<run>/traces) or a glob of trace files")
    parser.add_argument("--model", required=True, metavar="M", help="a local model directory, or tiny")
    parser.add_argument("--output-dir", required=True, type=Path, metavar="D",
                        help="where the fine-tuned model directory goes (must not exist or be empty)")
    parser.add_argument("--min-reward", type=float, default=1.0, metavar="R",
                        help="keep traces whose reward is at least R (default 1.0)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the selected traces (default 3)")
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    parser.add_argument("--token-budget", type=int, default=16384,
                        help="tokens per packed micro-batch, one optimizer step each (default 16384)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the batch order (and the tiny model)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness_rl.sft import SftConfig, SftError, sft

    if args.epochs < 1 or args.token_budget < 1 or args.learning_rate <= 0:
        print("harness-rl sft: --epochs, --token-budget and --learning-rate must be positive", file=sys.stderr)
        return EXIT_BAD_INPUT
    config = SftConfig(traces=args.traces, model=args.model, output_dir=args.output_dir,
                       min_reward=args.min_reward, epochs=args.epochs, learning_rate=args.learning_rate,
                       token_budget=args.token_budget, seed=args.seed)
    try:
        summary = sft(config)
    except SftError as error:
        print(f"harness-rl sft: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    chosen = summary.selection
    print(f"sft: {len(chosen.kept)} traces kept ({chosen.below_min_reward} below {summary.min_reward:g}, "
          f"{chosen.no_reward} without reward, {chosen.invalid} invalid) | {summary.rows} rows, "
          f"{summary.trained_tokens} trained of {summary.forwarded_tokens} tokens | {summary.steps} steps | "
          f"loss {summary.initial_loss:.3f} -> {summary.final_loss:.3f} | {summary.duration_s:.1f}s | "
          f"wrote {args.output_dir}")
    return 0
