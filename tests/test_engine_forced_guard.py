"""Forced completions cannot be switched on by `harness-rl train`: only `serve engine` has the flag,
and no library code outside the engine package, that command and the teacher passes
`forced_completions=True`. The teacher (`harness_rl/demo/teacher.py`, behind the `tiny-agent` build) enables
them only on a private embedded engine its own stack starts and closes, never on one a run samples from."""

import re
from pathlib import Path

from harness_rl.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_only_serve_engine_offers_the_flag() -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    train_flags = {flag for action in commands["train"]._actions for flag in action.option_strings}
    assert not any("forced" in flag for flag in train_flags)
    serve = commands["serve"]._subparsers._group_actions[0].choices
    engine_flags = {flag for action in serve["engine"]._actions for flag in action.option_strings}
    assert "--enable-forced-completions" in engine_flags


def test_no_library_code_enables_forced_completions() -> None:
    pattern = re.compile(r"forced_completions\s*=\s*(True|args\.|[a-z_]+\.enable)")
    engine = ROOT / "harness_rl" / "engine"
    allowed = {ROOT / "harness_rl" / "commands" / "serve_engine.py", ROOT / "harness_rl" / "demo" / "teacher.py",
               *engine.rglob("*.py")}
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("harness_rl", "proxy", "adapters")
        for path in (ROOT / package).rglob("*.py")
        if path not in allowed and pattern.search(path.read_text())
    ]
    assert offenders == []


def test_the_teacher_serves_forced_completions_only_from_an_engine_it_starts() -> None:
    source = (ROOT / "harness_rl" / "demo" / "teacher.py").read_text()
    assert source.count("forced_completions=True") == 1
    assert 'EngineConfig(engine=["embedded"]' in source and "with Stack.start(config," in source
    for run_level in ("train.py", "evaluate.py"):
        assert "forced" not in (ROOT / "harness_rl" / "run" / run_level).read_text()
