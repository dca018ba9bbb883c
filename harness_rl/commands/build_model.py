"""`harness-rl build-model tiny|tiny-agent`: build (or find) a model harness-rl makes offline.

Prints the model directory. `--model tiny-agent` anywhere finds or builds it on first use too; this
command does it ahead (e.g. before timing a run) and says where it is. `--rebuild` builds tiny-agent
afresh, to refresh the build the repository ships after its recipe changed.
"""

from __future__ import annotations

import argparse

from harness_rl.run.presets import BUILT_MODELS


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "build-model", help="build tiny or tiny-agent offline (cached) and print its directory",
        description="tiny: a random 0.8M-parameter Qwen2 and a BPE tokenizer, built in seconds. tiny-agent: tiny "
                    "fine-tuned (harness-rl sft) on teacher traces of mini-swe-agent replaying the reference "
                    "solutions of examples/agent-tasks/warmup and train, left undecided about finishing: the "
                    "repository ships its build (examples/models/tiny-agent); when the recipe changed, it is built "
                    "here (about 25 minutes on 2 CPU cores). "
                    "Both are deterministic and cached under $HARNESS_RL_CACHE (default ~/.cache/harness-rl).")
    parser.add_argument("name", choices=BUILT_MODELS)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of tiny's build (default: 0); tiny-agent is one build, from seed 0")
    parser.add_argument("--rebuild", action="store_true",
                        help="tiny-agent: build it afresh into the cache, ignoring the shipped and cached builds "
                             "(to refresh examples/models/tiny-agent after its recipe changed)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from harness_rl.demo.models import model_dir
    from harness_rl.demo.teacher import TeacherError
    from harness_rl.demo.tiny_agent import TINY_AGENT_SEED, TinyAgentError, build_tiny_agent

    if args.rebuild and args.name != "tiny-agent":
        print("harness-rl build-model: --rebuild is for tiny-agent (tiny builds in seconds, always the same)",
              file=sys.stderr)
        return 2
    try:
        print(build_tiny_agent(TINY_AGENT_SEED, rebuild=True) if args.rebuild else model_dir(args.name, seed=args.seed))
    except (TinyAgentError, TeacherError) as exc:
        print(f"harness-rl build-model: {exc}", file=sys.stderr)
        return 1
    return 0
