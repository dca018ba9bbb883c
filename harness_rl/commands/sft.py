"""`harness-rl sft`: rejection-sampling fine-tuning (behaviour cloning) from captured traces.

Flags are generated from `harness_rl.learner.config.SftConfig`.
"""

from __future__ import annotations

import argparse
import sys

from harness_rl.flags import add_flags, flags_of
from harness_rl.learner.config import SftConfig

EXIT_BAD_INPUT = 2
FLAGS = flags_of(SftConfig)
REQUIRED = ("traces", "model", "output_dir")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "sft", help="fine-tune a model on the trained tokens of traces that reached a reward",
        description="Rejection-sampling fine-tuning: keep the traces whose metadata reward is at least "
                    "--min-reward, and train cross-entropy on their agent turns' sampled tokens (the "
                    "learner's rows, packing and masks). Writes a model directory usable as --model.")
    add_flags(parser, FLAGS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import msgspec

    from harness_rl.flags import collect, flag_for_path
    from harness_rl.learner.sft import SftError, sft

    try:
        config = msgspec.convert(collect(args, FLAGS), SftConfig)
    except msgspec.ValidationError as exc:
        text, _, where = str(exc).partition(" - at `")
        print(f"harness-rl sft: {flag_for_path(FLAGS, where.rstrip('`'))}: {text}", file=sys.stderr)
        return EXIT_BAD_INPUT
    missing = [f"--{name.replace('_', '-')}" for name in REQUIRED if not getattr(config, name)]
    if missing:
        print(f"harness-rl sft: {', '.join(missing)}: required", file=sys.stderr)
        return EXIT_BAD_INPUT
    from harness_rl.demo.models import model_dir
    from harness_rl.demo.teacher import TeacherError
    from harness_rl.demo.tiny_agent import TinyAgentError

    try:
        summary = sft(msgspec.structs.replace(config, model=str(model_dir(config.model, seed=config.seed))))
    except (SftError, TinyAgentError, TeacherError) as error:
        print(f"harness-rl sft: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    chosen = summary.selection
    print(f"sft: {len(chosen.kept)} traces kept ({chosen.below_min_reward} below {summary.min_reward:g}, "
          f"{chosen.no_reward} without reward, {chosen.invalid} invalid) | {summary.rows} rows, "
          f"{summary.trained_tokens} trained of {summary.forwarded_tokens} tokens | {summary.steps} steps | "
          f"loss {summary.initial_loss:.3f} -> {summary.final_loss:.3f} | {summary.duration_s:.1f}s | "
          f"wrote {config.output_dir}")
    return 0
