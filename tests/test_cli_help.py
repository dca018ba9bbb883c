"""The help guides: `train`'s flags in sections by part with the common ones first and worked examples at the
end, a bare `harness-rl` lists its commands, no flag with a default claims to be required, and every path a
help names is in the repository. Fast: only parsers are built."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness_rl.cli import build_parser, commands_of, main
from harness_rl.commands import evaluate, serve_proxy, sft, train
from harness_rl.flags import Flag

ROOT = Path(__file__).resolve().parents[1]
GENERATED: dict[str, list[Flag]] = {"harness-rl train": train.FLAGS, "harness-rl eval": evaluate.FLAGS,
                                    "harness-rl sft": sft.FLAGS, "harness-rl serve proxy": serve_proxy.FLAGS}
# Top-level folders a help text could name (docs/ and reference/ do not exist here: naming them is the mistake).
REPOSITORY_PATH = re.compile(r"(?<![\w./~$-])(?:adapters|benchmarks|docs|examples|harness_rl|proxy|reference|scripts"
                             r"|tests)/[\w./<>-]*")


@pytest.fixture(autouse=True)
def wide_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """Help unwrapped (argparse wraps to $COLUMNS), so a flag is one line and no path is cut at a hyphen."""
    monkeypatch.setenv("COLUMNS", "1000")


def parsers(parser: argparse.ArgumentParser | None = None) -> Iterator[argparse.ArgumentParser]:
    """Every parser of the command line: `harness-rl`, each command and each subcommand."""
    parser = parser or build_parser()
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                yield from parsers(command)


def command(prog: str) -> argparse.ArgumentParser:
    return next(parser for parser in parsers() if parser.prog == prog)


def sections(help_text: str) -> dict[str, list[str]]:
    """A help's sections, each with the flags it lists in order."""
    out: dict[str, list[str]] = {}
    for line in help_text.splitlines():
        if re.fullmatch(r"\S.*:", line):
            out[line[:-1]] = current = []
        elif line.startswith("  -") and out:
            current.append(re.split(r"[ ,]", line.strip())[0])
    return out


RUN_SECTIONS = ["options", "run and tasks", "agent and sandbox", "engine and weight sync", "learner and loss",
                "rollouts, sampling and rewards", "proxy", "checkpoints and logging", "examples"]


def test_train_help_is_sectioned_by_part_with_the_common_flags_first() -> None:
    shown = sections(command("harness-rl train").format_help())
    assert list(shown) == RUN_SECTIONS
    assert shown["run and tasks"][:10] == ["--harness", "--tasks", "--model", "--engine", "--max-steps",
                                           "--output-dir", "--resume", "--seed", "--num-generations",
                                           "--nproc-per-node"]
    assert shown["run and tasks"][10:] == ["--config", "--preset", "--print-config"]
    # the few placed by the explicit table, not by the section their field lives in
    assert "--sync-every" in shown["engine and weight sync"]  # learner.sync_every
    assert {"--temperature", "--truncation"} <= set(shown["rollouts, sampling and rewards"])  # proxy.sampling
    assert shown["agent and sandbox"] == ["--sandbox", "--agent-timeout", "--max-turns"]
    assert {"--save-every", "--save-total-limit", "--report-to"} <= set(shown["checkpoints and logging"])
    assert {"--epsilon", "--loss-normalization", "--lora-rank"} <= set(shown["learner and loss"])
    listed = [flag for section in shown.values() for flag in section]
    assert sorted(listed) == sorted(["-h", *(flag.name for flag in train.FLAGS), "--config", "--preset",
                                     "--print-config"])  # each flag once, none lost


def test_eval_and_serve_proxy_help_are_sectioned_by_the_same_helper() -> None:
    shown = sections(command("harness-rl eval").format_help())
    assert list(shown) == [s for s in RUN_SECTIONS if s not in ("learner and loss", "checkpoints and logging",
                                                               "examples")]
    assert shown["run and tasks"][:5] == ["--harness", "--tasks", "--num-samples", "--model", "--engine"]
    proxy = sections(command("harness-rl serve proxy").format_help())
    assert list(proxy) == ["options", "engines", "address and store", "sampling", "capture", "limits and timeouts"]
    assert proxy["engines"][0] == "--upstream" and "--engine-wait" in proxy["engines"]
    assert {"--port", "--store", "--admin-token-file"} <= set(proxy["address and store"])
    assert "--request-timeout-s" in proxy["limits and timeouts"]


def test_train_help_ends_with_three_worked_examples_that_parse() -> None:
    text = command("harness-rl train").format_help()
    examples = text[text.index("\nexamples:\n"):]
    commands = [line for line in examples.replace("\\\n", " ").splitlines() if "harness-rl" in line
                and not line.lstrip().startswith("#")]
    trains = [c for c in commands if "harness-rl train" in c]
    assert len(trains) == 3
    assert trains[0].strip() == "harness-rl train"  # the CPU demo
    assert "--engine http://127.0.0.1:8000" in trains[1] and "--harness opencode" in trains[1]
    assert "--nproc-per-node 4" in trains[2]
    for line in commands:  # every flag an example uses exists and takes the value shown
        argv = [word for word in shlex.split(line) if "=" not in word and word != "&"]
        assert argv[0] == "harness-rl", line
        args, unknown = build_parser().parse_known_args(argv[1:])
        assert unknown == [], line


def test_bare_harness_rl_lists_every_command_one_line_each_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    registered = commands_of(build_parser())
    assert {"serve", "train", "eval", "traces", "sft", "doctor", "view"} <= set(registered)
    assert main([]) == 2
    head, *lines = capsys.readouterr().err.splitlines()
    assert head == "harness-rl: name a command (harness-rl COMMAND --help for its flags):"
    assert [line.split()[0] for line in lines] == list(registered)
    assert all(registered[line.split()[0]] in line for line in lines)
    assert main(["serve"]) == 2
    assert [line.split()[0] for line in capsys.readouterr().err.splitlines()[1:]] == ["proxy", "engine", "vllm"]


@pytest.mark.parametrize("argv, line", [
    (["train", "--max-stesp", "3"],
     "harness-rl train: unrecognized arguments: --max-stesp 3 (harness-rl train --help lists its flags)"),
    (["serve", "proxy", "--bogus"],
     "harness-rl serve proxy: unrecognized arguments: --bogus (harness-rl serve proxy --help lists its flags)"),
    (["train", "--max-steps", "many"], "harness-rl train: argument --max-steps: expected int, got 'many'"),
])
def test_a_usage_mistake_is_one_line_naming_the_command(argv: list[str], line: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def flag_helps() -> Iterator[tuple[Flag, str]]:
    for parser in parsers():
        by_name = {flag.name: flag for flag in GENERATED.get(parser.prog, [])}
        for action in parser._actions:
            for name in action.option_strings:
                if name in by_name and action.help:
                    yield by_name[name], action.help


def test_no_flag_with_a_default_says_it_is_required() -> None:
    said: dict[str, str] = {}
    for flag, text in flag_helps():
        last = text[text.rindex("("):]  # the generated ending: what the flag not given comes to
        assert "(default: (required)" not in text
        if "required" in last:
            assert flag.default in ("", []), (flag.name, text)
            said[flag.name] = last
    assert said["--model"] == "(required for a real run; demo preset: tiny; agent preset: tiny-agent)"
    assert said["--tasks"] == ("(required for a real run; demo preset: examples/tasks/digits; agent preset: "
                               "examples/agent-tasks/train)")
    assert said["--upstream"] == "(required)" and said["--traces"] == "(required)"  # serve proxy's, sft's


def test_every_repository_path_a_help_names_exists() -> None:
    named = {path.rstrip(".,;:)") for parser in parsers() for path in REPOSITORY_PATH.findall(parser.format_help())}
    assert {"examples/tasks/digits", "examples/agent-tasks/train", "examples/tasks"} <= named
    missing = sorted(path for path in named if not (ROOT / path.split("<")[0]).exists())
    assert missing == []
