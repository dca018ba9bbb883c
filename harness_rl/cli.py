"""The `harness-rl` command line.

Each command lives in its own small module under `harness_rl/commands/` that declares its flags
and imports its heavy machinery only when run, so `harness-rl serve proxy` never loads torch.
"""

import argparse
import functools
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
    _name_commands(parser)
    return parser


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Each parser leaves itself as `command_parser` (the deepest one chosen wins), so a usage error names the command
    it is one of; one given no subcommand (`harness-rl`, `harness-rl serve`) lists its commands and exits 2, as
    argparse does for any other argument that is missing."""
    parser.set_defaults(command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.required = False
            parser.set_defaults(run=functools.partial(_list_commands, parser))
            for command in action.choices.values():
                _name_commands(command)


def commands_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The commands a parser takes and their one-line help, in the order they were registered."""
    return {choice.dest: choice.help or "" for action in parser._actions
            if isinstance(action, argparse._SubParsersAction) for choice in action._get_subactions()}


def _list_commands(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    commands = commands_of(parser)
    width = max(map(len, commands))
    lines = [f"{parser.prog}: name a command ({parser.prog} COMMAND --help for its flags):",
             *(f"  {name:<{width}}  {text}" for name, text in commands.items())]
    print("\n".join(lines), file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run a command; arguments after `--` pass through to commands that take them (`serve vllm`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = build_parser()
    args, unknown = parser.parse_known_args(ours)
    command: argparse.ArgumentParser = args.command_parser
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)} ({command.prog} --help lists its flags)")
    if passthrough and not hasattr(args, "passthrough"):
        command.error(f"unrecognized arguments: -- {' '.join(passthrough)}")
    if hasattr(args, "passthrough"):
        args.passthrough = passthrough
    args.argv = ours  # what a command that starts itself again (train under torchrun) passes on
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
