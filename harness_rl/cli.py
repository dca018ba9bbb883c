"""The `harness-rl` command line.

Each command lives in its own small module under `harness_rl/commands/` that declares its flags
and imports its heavy machinery only when run, so `harness-rl serve proxy` never loads torch.
"""

import argparse
import sys
from typing import NoReturn

from harness_rl import __version__
from harness_rl.commands import build_model, evaluate, harnesses, serve_engine, serve_proxy, sft, traces, train, view


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

    serve = commands.add_parser("serve", help="run a server (the intercept proxy or the embedded engine)")
    servers = serve.add_subparsers(dest="server", metavar="SERVER", required=True)
    serve_proxy.register(servers)
    serve_engine.register(servers)

    train.register(commands)
    traces.register(commands)
    sft.register(commands)
    evaluate.register(commands)
    build_model.register(commands)
    harnesses.register(commands)
    view.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
