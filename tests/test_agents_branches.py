"""Real CLIs through subagents and compactions (benchmarks/branches_bench.py, one rollout each): every branch is
its own chained row, every agent token trains, summaries train only when asked, titles never."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from test_agents_cli import agent_clis  # noqa: F401  (the fixture that installs the CLIs)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("agent_clis")]
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "branches_bench.py"
ROWS = {"claude-code": 3, "opencode": 2, "codex": 2}  # main (+ subagent) + after the compaction


def load_bench():
    spec = importlib.util.spec_from_file_location("branches_bench", BENCH)
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("harness", sorted(ROWS))
def test_each_conversation_is_its_own_chained_row(harness: str, engine_url: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    tally = bench.main(["--rollouts", "1", "--only", harness], engine_url=engine_url)[harness]
    print(capsys.readouterr().out)  # the bench's report, shown with -s
    assert tally.problems == [] and tally.rewards == [1.0]
    assert tally.reasons == [bench.SCENARIOS[harness].reasons]
    assert tally.rows == [ROWS[harness]] and tally.rows_with_summary == [ROWS[harness] + 1]
    assert tally.later >= ROWS[harness] and tally.chained == tally.later  # every later turn of every branch chains
    for (role, reason), (sampled, trained) in tally.share.items():
        assert sampled > 0 and trained == (sampled if role == "agent" else 0), (role, reason)
    for (role, reason), (sampled, trained) in tally.share_with_summary.items():
        assert trained == (sampled if role in ("agent", "summary") else 0), (role, reason)
    assert tally.share_with_summary[("summary", "summary")][1] > 0
