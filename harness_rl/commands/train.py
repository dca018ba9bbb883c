"""`harness-rl train`: GRPO on real agent rollouts. With no flags, the embedded CPU demo.

Every flag is generated from a field of `harness_rl.run.config.RunConfig` (help and default included);
`--config FILE` sets the same fields from TOML or JSON, and flags override it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from harness_rl.commands.help_layout import RUN_GROUPS, preset_default_text
from harness_rl.flags import add_flag_groups, flags_of
from harness_rl.run.config import RunConfig
from harness_rl.run.presets import PRESETS

FLAGS = flags_of(RunConfig)
WORKED_EXAMPLES = """\
examples:
  # the embedded CPU demo: the tiny model, the echo harness, the digits task
  harness-rl train

  # a real agent against vLLM on one GPU
  # (first: hf download Qwen/Qwen3-8B --local-dir /models/Qwen3-8B)
  harness-rl serve vllm /models/Qwen3-8B --port 8000 &
  harness-rl train --harness opencode --model /models/Qwen3-8B \\
      --engine http://127.0.0.1:8000 --tasks examples/tasks \\
      --num-generations 8 --max-steps 100 --output-dir runs/qwen3-opencode

  # eight GPUs: vLLM on four (a copy of the model on each), the learner
  # sharded with FSDP2 over the other four
  CUDA_VISIBLE_DEVICES=0,1,2,3 harness-rl serve vllm /models/Qwen3-8B \\
      --port 8000 --data-parallel-size 4 &
  CUDA_VISIBLE_DEVICES=4,5,6,7 harness-rl train --nproc-per-node 4 \\
      --harness opencode --model /models/Qwen3-8B \\
      --engine http://127.0.0.1:8000 --tasks examples/tasks \\
      --output-dir runs/qwen3-fsdp
"""


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train", help="train with GRPO on real agent rollouts (no flags: the embedded CPU demo)",
        usage="%(prog)s [FLAG ...]", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=WORKED_EXAMPLES,
        description="Run agents on tasks through the capture proxy, score them with each task's\n"
                    "verifier, and train with GRPO; new weights go back into the engine after\n"
                    "every step.\n\n"
                    "Defaults are those of a real run. With --model tiny or no --model, the demo\n"
                    "preset changes a few for the CPU demo; with tiny-agent, the agent preset\n"
                    "(each flag says what they set).")
    run_section = add_flag_groups(parser, FLAGS, RUN_GROUPS, preset_default_text)[0]
    run_section.add_argument("--config", metavar="FILE", help="TOML or JSON file of settings (as --print-config "
                                                              "writes); flags override it")
    run_section.add_argument("--preset", choices=sorted(PRESETS), help="start from these defaults (default: the "
                                                                       "model's: tiny or none given: demo, "
                                                                       "tiny-agent: agent; else real)")
    run_section.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML "
                                                                         "and exit")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import signal

    from harness_rl.demo import models
    from harness_rl.flags import collect
    from harness_rl.run import config as cfg
    from harness_rl.run import preflight
    from harness_rl.run.resume import resolve_run
    from harness_rl.settings import ConfigError

    try:
        layers = [cfg.load_file(args.config)] if args.config else []
        flags = collect(args, FLAGS)
        if args.preset:
            flags["preset"] = args.preset
        config = resolve_run([*layers, flags])
        if args.print_config:
            print(cfg.to_toml(config), end="")
            return 0
        preflight.check(config)
        models.check(config.engine.model, config.rollouts.harness)
    except ConfigError as exc:
        print(f"harness-rl train: {exc}", file=sys.stderr)
        return 2

    if config.learner.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        command = torchrun_command(config.learner.nproc_per_node, args.argv)
        print(f"harness-rl train: starting {shlex.join(command)}", file=sys.stderr, flush=True)
        os.execv(sys.executable, command)  # torchrun takes this process's place, signals and exit code included

    from harness_rl.commands.stopping import sigterm_as_ctrl_c
    from harness_rl.demo.teacher import TeacherError
    from harness_rl.demo.tiny_agent import TinyAgentError
    from harness_rl.learner import distributed
    from harness_rl.run.train import RunStopped, follow, train

    ranks = distributed.join_learner(config.learner.device, config.learner.collective_timeout_s)
    try:
        if not ranks.leader:  # rank 0 stops the run; these ranks (torchrun's processes) write their shards
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # of its last checkpoint first
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            follow(config)
            return 0
        with sigterm_as_ctrl_c():
            model_dir = models.model_dir(config.engine.model, seed=config.seed, harness=config.rollouts.harness)
            train(config, model_dir)
    except KeyboardInterrupt:
        return 130
    except (RunStopped, TinyAgentError, TeacherError) as exc:
        print(f"harness-rl train: stopped: {exc}", file=sys.stderr)
        return 1
    finally:
        distributed.leave()
    return 0


def torchrun_command(processes: int, argv: list[str]) -> list[str]:
    """This command (`argv`) again under torchrun, one process per GPU of this machine. Each process gets the same
    flags, `--nproc-per-node` among them, so rank 0 records it in the run's config.toml (a resume restarts torchrun
    from it); torchrun sets LOCAL_RANK, so no process starts torchrun again."""
    return [sys.executable, "-m", "harness_rl.torchrun", "--standalone", "--nproc-per-node", str(processes),
            "-m", "harness_rl", *argv]
