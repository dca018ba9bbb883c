"""`harness-rl doctor --engine URL [--model DIR]`: is a running engine set up for exact capture?

One pass/fail line per requirement with the fix for each failure; exit 1 on any failure. With a local
model directory, also the mismatch at equal weights (the learner's forward pass against the engine's
sampled logprobs), which loads torch; the HTTP checks do not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness_rl.learner.sync_backends import AT_URL, AUTO, choices_for


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check that a running engine (vLLM or harness-rl's) can capture exactly",
        description="Probe a running engine for what exact capture needs: token ids, processed logprobs, token-id "
                    "strings, a tool parser, the context length, the weight-sync routes, the policy version and the "
                    "token-in routes. Each failure names its fix (the vLLM flag to add). Exit 1 on any failure.",
    )
    parser.add_argument("--engine", required=True, metavar="URL", help="the engine's base URL, e.g. http://gpu:8000")
    parser.add_argument("--model", default=None,
                        help="a local model directory: also measure the mismatch at equal weights against it "
                             "(the engine must serve these weights); otherwise only the served model's name")
    parser.add_argument("--served-model-name", default=None,
                        help="the name the engine serves the model under (default: its first model)")
    parser.add_argument("--min-context", type=int, default=65536,
                        help="the context length the run needs (default: %(default)s)")
    parser.add_argument("--weight-sync", default=AUTO, choices=choices_for(AT_URL),
                        help="the weight sync the run will use; auto: any (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of the mismatch measurement (default: %(default)s)")
    parser.add_argument("--max-kl", type=float, default=1e-3,
                        help="largest mean k3 KL at equal weights that passes (default: %(default)s)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from harness_rl.tools.doctor import diagnose, measure_mismatch

    model_dir = Path(args.model) if args.model and Path(args.model).is_dir() else None
    served = args.served_model_name or (None if model_dir is not None else args.model)
    report = asyncio.run(diagnose(args.engine, model=served, min_context=args.min_context,
                                  weight_sync=args.weight_sync))
    print(f"harness-rl doctor: {report.url}")
    print(report.text())
    failed = not report.ok
    if model_dir is not None and report.checks and report.checks[0].name != "engine answers":
        check = measure_mismatch(args.engine, model_dir, model=served, temperature=args.temperature,
                                 max_kl=args.max_kl)
        print(check.line())
        failed = failed or check.status == "fail"
    print("exact capture: NOT READY" if failed else "exact capture: ready")
    return 1 if failed else 0
