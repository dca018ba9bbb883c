"""`harness-rl traces`: violations located, spans shown, bad files answered in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from test_trace import chain

from harness_rl.cli import main
from harness_rl.trace import Branch, PrefixBreak


@pytest.fixture
def good(tmp_path: Path) -> Path:
    trace = chain(3)
    trace.turns[1].loss_mask[-1] = 0
    trace.turns[1].prompt_source = "spliced"
    trace.turns[2].role = "auxiliary"
    trace.turns[2].prompt_source = "rendered"
    trace.turns[2].prefix_break = PrefixBreak(position=7, cause="retokenized", against="t1")
    trace.turns[0].branch = trace.turns[1].branch = Branch(id=0, reason="main")
    trace.turns[2].branch = Branch(id=1, reason="side_call", origin="t1")
    path = tmp_path / "good.msgpack"
    trace.save(path)
    return path


def test_validate_ok(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["traces", "validate", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: ok (3 turns)\n"


def test_validate_prints_every_violation_with_turn_and_position(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    trace = chain(3)
    trace.turns[2].per_token_logps[1] = 0.25
    trace.turns[0].loss_mask[1] = 1
    path = tmp_path / "bad.json"
    trace.save(path)
    assert main(["traces", "validate", str(path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: trainable_prompt: a prompt position has loss_mask 1 (turn 0, node t0, position 1)",
        f"{path}: positive_logprob: logprob 0.25 is above 0 (turn 2, node t2, position 1)",
    ]


def test_show_lists_branches_roles_lengths_and_trained_spans(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["traces", "show", str(good)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rollout r1: 3 turns, 2 branches, 3 trained tokens (agent turns)"
    assert lines[1] == "  branch 0 main: turns 0, 1 (agent, 4 sampled tokens)"
    assert lines[2] == "  branch 1 side_call from turn 1: turns 2 (auxiliary, 2 sampled tokens)"
    assert lines[4].split() == ["0", "t0", "(root)", "agent", "0:main", "0", "4", "2", "tool_calls", "-", "0-1"]
    assert lines[5].split() == ["1", "t1", "t0", "agent", "0:main", "1", "9", "2", "tool_calls", "spliced", "0"]
    assert lines[6].split()[3:5] == ["auxiliary", "1:side_call"] and lines[6].split()[9] == "rendered"
    assert lines[7].strip() == "prefix broke at token 7 of t1: retokenized"


def test_show_reads_a_proxy_session_log(fake_proxy, fake_engine, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy_agent import TOOLS, Agent

    agent = Agent(fake_proxy)
    messages = [{"role": "user", "content": "go"}]
    for step in range(2):
        answer = agent.chat(messages, tools=TOOLS).json()["choices"][0]["message"]
        messages += [answer, {"role": "user", "content": f"more {step}"}]
    log = Path(fake_proxy.proxy.config.store_dir) / f"{agent.session['id']}.jsonl"
    assert main(["traces", "show", str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"rollout {agent.session['id']}: 2 turns")
    assert main(["traces", "validate", str(log)]) == 0


def test_export_writes_openenv_json(good: Path, tmp_path: Path) -> None:
    out = tmp_path / "openenv.json"
    assert main(["traces", "export", str(good), str(out)]) == 0
    exported = msgspec.json.decode(out.read_bytes())
    assert exported["schema_version"] == 1 and len(exported["turns"]) == 3
    assert exported["turns"][2]["loss_mask"] == [0] * 16


@pytest.mark.parametrize("content, reason", [
    (b"\x00\x01 not json at all", "not valid JSON"),
    (b'{"schema_version": 1, "rows": []}', "not a harness-rl trace"),
    (None, "truncated"),
])
def test_bad_files_get_one_clear_line_and_no_traceback(tmp_path: Path, good: Path, content: bytes | None,
                                                       reason: str) -> None:
    path = tmp_path / "broken.json"
    if content is None:
        data = chain(3).to_json()
        content = data[: len(data) // 2]
    path.write_bytes(content)
    done = subprocess.run([sys.executable, "-m", "harness_rl.cli", "traces", "validate", str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 2  # no trace to check (1 is for a trace that breaks the contract)
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"harness-rl: {path}: ") and reason in line


def test_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["traces", "show", str(tmp_path / "nope.json")])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"harness-rl: {tmp_path / 'nope.json'}: no such file\n"


@pytest.mark.parametrize("action", ["validate", "show", "export"])
def test_input_that_holds_no_trace_is_refused_and_nothing_written(tmp_path: Path, action: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A folder, a proxy store's other JSON lines, an empty file: exit 2, one line, no export written."""
    lines = tmp_path / "notes.jsonl"
    lines.write_text('{"note": "not a session log"}\n')
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    out = tmp_path / "out.json"
    for path, reason in ((tmp_path, "is a directory"), (lines, "not a proxy session log"), (empty, "truncated")):
        with pytest.raises(SystemExit) as exited:
            main(["traces", action, str(path), *([str(out)] if action == "export" else [])])
        assert exited.value.code == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"harness-rl: {path}: ") and reason in line
    assert not out.exists()
