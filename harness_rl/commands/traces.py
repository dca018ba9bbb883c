"""`harness-rl traces validate|show|export FILE`: inspect trace files without a traceback in sight."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from harness_rl.trace import TraceFormatError, TrainingTrace, Turn


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("traces", help="validate, show or export trace files")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    validate = actions.add_parser("validate", help="check trace files, OpenEnv JSON or proxy session logs against "
                                                   "the trace contract; exit 1 on any violation")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")
    validate.set_defaults(run=run_validate)

    show = actions.add_parser("show", help="print the branches (main, subagents, compactions, ...) and each turn: "
                                           "role, branch, parent, lengths, prompt source and trained spans (trace "
                                           "files, OpenEnv JSON, proxy session logs)")
    show.add_argument("file", type=Path, metavar="FILE")
    show.set_defaults(run=run_show)

    export = actions.add_parser("export", help="write a trace in OpenEnv's TrainingTrace JSON")
    export.add_argument("file", type=Path, metavar="FILE")
    export.add_argument("output", type=Path, metavar="OUT")
    export.set_defaults(run=run_export)


def _load(path: Path) -> TrainingTrace:
    """Read a trace file, OpenEnv JSON or proxy session log, or exit 2 with one line saying why it holds no trace
    (exit 1 is kept for a trace that breaks the contract)."""
    try:
        if path.suffix == ".jsonl":
            from proxy.capture.recovery import trace_from_log

            return trace_from_log(path)
        return TrainingTrace.load(path)
    except FileNotFoundError:
        reason = "no such file"
    except IsADirectoryError:
        reason = "is a directory"
    except (TraceFormatError, OSError, ValueError) as exc:
        reason = str(exc)
    print(f"harness-rl: {path}: {reason}", file=sys.stderr)
    raise SystemExit(2)


def run_validate(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        trace = _load(path)
        violations = trace.violations()
        if violations:
            failed = True
            for violation in violations:
                print(f"{path}: {violation}")
        else:
            print(f"{path}: ok ({len(trace.turns)} turns)")
    return 1 if failed else 0


def trained_spans(turn: Turn) -> list[tuple[int, int]]:
    """Half-open [start, end) completion positions whose loss mask is 1."""
    spans: list[tuple[int, int]] = []
    start = None
    mask = turn.completion_mask
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _format_spans(spans: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in spans) or "none"


def branch_lines(trace: TrainingTrace) -> list[str]:
    """One line per branch: its id, why it began and from which turn, its turns and what its agent calls sampled."""
    index = {turn.node_id: i for i, turn in enumerate(trace.turns)}
    branches: dict[int, list[int]] = {}
    for i, turn in enumerate(trace.turns):
        if turn.branch is not None:
            branches.setdefault(turn.branch.id, []).append(i)
    lines = []
    for branch_id, members in sorted(branches.items()):
        branch = trace.turns[members[0]].branch
        assert branch is not None
        origin = f" from turn {index.get(branch.origin, branch.origin)}" if branch.origin is not None else ""
        roles = sorted({trace.turns[i].role for i in members})
        sampled = sum(len(trace.turns[i].completion_token_ids) for i in members)
        lines.append(f"  branch {branch_id} {branch.reason}{origin}: turns {', '.join(map(str, members))} "
                     f"({'/'.join(roles)}, {sampled} sampled tokens)")
    return lines


def run_show(args: argparse.Namespace) -> int:
    trace = _load(args.file)
    trained = sum(sum(t.completion_mask) for t in trace.turns if t.role == "agent")
    branches = branch_lines(trace)
    print(f"rollout {trace.rollout_id}: {len(trace.turns)} turns, {len(branches) or 'no'} branches, {trained} trained "
          "tokens (agent turns)")
    for line in branches:
        print(line)
    print(f"{'#':>3}  {'node':<14} {'parent':<14} {'role':<9} {'branch':<20} {'ver':>4} {'prompt':>7} {'compl':>6}  "
          f"{'finish':<10} {'source':<9} trained completion positions")
    for i, turn in enumerate(trace.turns):
        version = "-" if turn.policy_version is None else str(turn.policy_version)
        branch = f"{turn.branch.id}:{turn.branch.reason}" if turn.branch is not None else "-"
        print(f"{i:>3}  {turn.node_id:<14} {turn.parent_id or '(root)':<14} {turn.role:<9} {branch:<20} {version:>4} "
              f"{len(turn.prompt_token_ids):>7} {len(turn.completion_token_ids):>6}  "
              f"{turn.finish_reason or '-':<10} {turn.prompt_source or '-':<9} {_format_spans(trained_spans(turn))}")
        if turn.prefix_break is not None:
            brk = turn.prefix_break
            print(f"{'':>5}prefix broke at token {brk.position}{f' of {brk.against}' if brk.against else ''}: "
                  f"{brk.cause}")
    violations = trace.violations()
    if violations:
        print(f"{len(violations)} violations; run `harness-rl traces validate {args.file}`", file=sys.stderr)
    return 0


def run_export(args: argparse.Namespace) -> int:
    trace = _load(args.file)
    violations = trace.violations()
    if violations:
        raise SystemExit(f"harness-rl: {args.file}: refusing to export an invalid trace: {violations[0]}")
    args.output.write_bytes(msgspec.json.encode(trace.to_openenv()))
    print(f"wrote {args.output} ({len(trace.turns)} turns, OpenEnv TrainingTrace schema 1)")
    return 0
