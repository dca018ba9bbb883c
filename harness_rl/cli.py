"""The `harness-rl` command line.

Each command lives in its own small module under `harness_rl/commands/` that declares its flags
and imports its heavy machinery only when run, so `harness-rl serve proxy` never loads torch.
"""

import argparse
import sys
from typing import NoReturn

from harness_rl import __version__
from harness_rl.commands import (
    build_model,
    doctor,
    evaluate,
    harnesses,
    serve_engine,
    serve_proxy,
    serve_vllm,
    sft,
    traces,
    train,
    view,
)


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line naming the flag (`harness-rl train: argument --max-steps: ...`), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="harness-rl",
        description="Train LLM agents with GRPO on the outcomes of real agent harnesses.",
    )
    parser.add_argument("--version", action="version", version=f"harness-rl {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser("serve", help="run a server (the intercept proxy, the embedded engine, or real vLLM)")
    servers = serve.add_subparsers(dest="server", metavar="SERVER", required=True)
    serve_proxy.register(servers)
    serve_engine.register(servers)
    serve_vllm.register(servers)

    train.register(commands)
    traces.register(commands)
    sft.register(commands)
    evaluate.register(commands)
    build_model.register(commands)
    harnesses.register(commands)
    view.register(commands)
    doctor.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; arguments after `--` pass through to commands that take them (`serve vllm`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(ours)
    if passthrough and not hasattr(args, "passthrough"):
        parser.error(f"unrecognized arguments: -- {' '.join(passthrough)}")
    if hasattr(args, "passthrough"):
        args.passthrough = passthrough
    args.argv = ours  # what a command that starts itself again (train under torchrun) passes on
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
