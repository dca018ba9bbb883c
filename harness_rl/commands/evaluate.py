"""`harness-rl eval`: sample an agent on task splits and report success, reward, turns and chaining.

Flags are generated from `harness_rl.run.config.EvalConfig` (the engine, proxy and rollouts settings of
`train`, plus `--tasks` repeated per split and `--num-samples`).
"""

from __future__ import annotations

import argparse

from harness_rl.commands.help_layout import RUN_GROUPS, preset_default_text
from harness_rl.flags import add_flag_groups, flags_of
from harness_rl.run.config import EVAL_EXCLUDED, EvalConfig
from harness_rl.run.presets import PRESETS

FLAGS = flags_of(EvalConfig, exclude=EVAL_EXCLUDED)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval", help="measure an agent on tasks: success, reward, turns, tokens, chained turns",
        usage="%(prog)s [FLAG ...]",
        description="Run --num-samples rollouts of every task of every --tasks split through the capture proxy "
                    "(no training), and report per task and per split: success rate, mean reward, agent turns, "
                    "tool calls, generated tokens and the share of later agent turns that chain onto their "
                    "predecessor. Writes RUN/eval.json, RUN/rollouts.jsonl and RUN/traces/ (as train does).")
    run_section = add_flag_groups(parser, FLAGS, RUN_GROUPS, preset_default_text)[0]
    run_section.add_argument("--config", metavar="FILE", help="TOML or JSON settings (a run's config.toml works: "
                                                              "its learner and output sections are ignored); flags "
                                                              "override")
    run_section.add_argument("--preset", choices=sorted(PRESETS), help="start from these defaults (default: the "
                                                                       "model's: tiny or none given: demo, "
                                                                       "tiny-agent: agent; else real)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from harness_rl.demo import models
    from harness_rl.flags import collect
    from harness_rl.run import config as cfg
    from harness_rl.run import preflight
    from harness_rl.settings import ConfigError

    try:
        layers = [cfg.load_file(args.config)] if args.config else []
        flags = collect(args, FLAGS)
        if args.preset:
            flags["preset"] = args.preset
        config = cfg.resolve_eval(*layers, flags)
        preflight.check_eval(config)
        models.check(config.engine.model, config.rollouts.harness)
    except ConfigError as exc:
        print(f"harness-rl eval: {exc}", file=sys.stderr)
        return 2

    from harness_rl.commands.stopping import sigterm_as_ctrl_c
    from harness_rl.demo.teacher import TeacherError
    from harness_rl.demo.tiny_agent import TinyAgentError
    from harness_rl.run.evaluate import evaluate, table
    from harness_rl.run.train import RunStopped

    try:
        with sigterm_as_ctrl_c():
            model_dir = models.model_dir(config.engine.model, seed=config.seed, harness=config.rollouts.harness)
            report = evaluate(config, model_dir)
    except KeyboardInterrupt:
        print("harness-rl eval: interrupted; rollouts and sessions closed", file=sys.stderr)
        return 130
    except (RunStopped, TinyAgentError, TeacherError) as exc:
        print(f"harness-rl eval: stopped: {exc}", file=sys.stderr)
        return 1
    print(table(report))
    if config.baseline is not None:
        import msgspec

        from harness_rl.run.evaluate import EvalReport, comparison
        from harness_rl.run.preflight import baseline_file

        before = msgspec.json.decode(baseline_file(config.baseline).read_bytes(), type=EvalReport)
        print(f"\nbefore: {before.model} ({before.output_dir}); after: {report.model}")
        print(comparison(before, report))
    print(f"eval: {sum(s.samples for s in report.splits)} rollouts in {report.duration_s:.0f}s "
          f"(load average {' '.join(f'{v:.2f}' for v in report.load_average)}); outputs in {report.output_dir}")
    return 0
