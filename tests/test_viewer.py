"""`harness-rl view`: what the page embeds, read back from the HTML, against the run it was made from."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import msgspec
import pytest
from viewer_fixture import FixtureRun, make_run

from harness_rl.cli import main
from harness_rl.learner.rows import completion_mask
from harness_rl.trace import PrefixBreak, TrainingTrace
from harness_rl.viewer.load import Texts, load_run, turn_views
from harness_rl.viewer.tokens import find_tokenizer, open_tokenizer


@pytest.fixture
def fixture_run(tmp_path: Path, tiny_model_dir: Path) -> FixtureRun:
    """Three steps of four rollouts; the tokenizer sits in a checkpoint, as `harness-rl train` leaves it."""
    run = make_run(tmp_path / "run", tiny_model_dir, steps=3)
    model = run.path / "checkpoints" / "step-00000003" / "model"
    model.mkdir(parents=True)
    shutil.copy(tiny_model_dir / "tokenizer.json", model)
    return run


def embedded(page: Path) -> dict:
    html = page.read_text()
    match = re.search(r'<script type="application/json" id="data">(.*?)</script>', html, re.S)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def test_page_embeds_every_rollout_turn_and_token(fixture_run: FixtureRun, tiny_model_dir: Path, tmp_path: Path):
    page = tmp_path / "page.html"
    assert main(["view", str(fixture_run.path), "-o", str(page)]) == 0
    data = embedded(page)
    assert data["tokenizer"].endswith("step-00000003/model/tokenizer.json")
    assert [r["rollout_id"] for r in data["rollouts"]] == [r["rollout_id"] for r in fixture_run.rollouts]
    assert [m["step"] for m in data["metrics"]] == [1, 2, 3]
    tokenizer = open_tokenizer(tiny_model_dir)
    for row, view in zip(fixture_run.rollouts, data["rollouts"], strict=True):
        assert (view.get("reward"), view.get("advantage"), view.get("step")) == (row["reward"], row["advantage"],
                                                                                 row["step"])
        trace = fixture_run.traces.get(row["rollout_id"])
        if trace is None:
            assert "turns" not in view and view["trace_note"] == "no trace recorded"
            assert view["error"] == row["error"]
            continue
        assert len(view["turns"]) == len(trace.turns)
        for turn, shown in zip(trace.turns, view["turns"], strict=True):
            assert shown["ids"] == turn.completion_token_ids
            assert shown["mask"] == "".join(map(str, completion_mask(turn)))  # what the learner trains
            assert shown["logps"] == [round(lp, 3) for lp in turn.per_token_logps]
            assert "".join(data["vocab"][str(i)] for i in shown["ids"]) == tokenizer.decode(turn.completion_token_ids)
            assert shown["role"] == turn.role and shown.get("parent_id") == turn.parent_id
    # shapes the fixture put in: auxiliary and discarded turns train nothing, an undelivered completion neither
    by_id = {r["rollout_id"]: r for r in data["rollouts"]}
    roles = {t["node_id"]: t for t in by_id["s001-g1-r0"]["turns"]}
    assert set(roles["aux"]["mask"]) == {"0"} and set(roles["retry"]["mask"]) == {"0"} and "1" in roles["t1"]["mask"]
    lost = {t["node_id"]: t for t in by_id["s001-g1-r1"]["turns"]}["lost"]
    assert lost["delivered"] is False and set(lost["mask"]) == {"0"}
    learner = {t["node_id"]: t for t in by_id["s001-g1-r2"]["turns"]}["t1"]["learner_logps"]
    assert learner == [round(lp, 3) for lp in fixture_run.traces["s001-g1-r2"].turns[1].metadata["learner_logps"]]
    # a child turn shows only the messages its parent did not hold; the system prompt is stored once for all
    t1 = by_id["s001-g1-r0"]["turns"][1]
    assert [m["role"] for m in t1["messages"]] == ["assistant", "tool"] and t1["message_count"] == 4
    assert data["texts"].count(data["texts"][by_id["s001-g1-r0"]["turns"][0]["messages"][0]["text"]]) == 1


def test_page_is_self_contained(fixture_run: FixtureRun, tmp_path: Path):
    page = tmp_path / "page.html"
    main(["view", str(fixture_run.path), "-o", str(page)])
    html = page.read_text()
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", html)
    assert not re.search(r"https?://|@import|url\(", html.split('id="data">')[0] + html.split("</script>")[-2])
    assert html.count("<script") == 2  # the data and the inline script


def test_without_a_tokenizer_the_page_shows_ids(fixture_run: FixtureRun, tmp_path: Path, capsys):
    shutil.rmtree(fixture_run.path / "checkpoints")
    assert find_tokenizer(fixture_run.path) is None
    main(["view", str(fixture_run.path)])
    assert "no tokenizer: token ids" in capsys.readouterr().out
    data = embedded(fixture_run.path / "view.html")
    assert data["tokenizer"] is None and data["vocab"] == {}
    assert "new_prompt_text" not in data["rollouts"][0]["turns"][0]


def test_the_configured_model_directory_gives_the_tokenizer(fixture_run: FixtureRun, tiny_model_dir: Path):
    shutil.rmtree(fixture_run.path / "checkpoints")
    (fixture_run.path / "config.toml").write_text(f'[engine]\nmodel = "{tiny_model_dir}"\n')
    assert find_tokenizer(fixture_run.path) == tiny_model_dir / "tokenizer.json"


def test_trace_files_alone(fixture_run: FixtureRun, tiny_model_dir: Path, tmp_path: Path):
    traces = sorted((fixture_run.path / "traces").glob("s002-*.json"))
    page = tmp_path / "traces.html"
    assert main(["view", *map(str, traces), "--tokenizer", str(tiny_model_dir), "-o", str(page)]) == 0
    data = embedded(page)
    assert data["charts"] == [] and data["metrics"] == []
    assert [(r["rollout_id"], r["reward"], r["task"]) for r in data["rollouts"]] == [
        (t.stem, fixture_run.traces[t.stem].metadata["reward"], "digits") for t in traces]


def test_steps_limit_which_traces_are_embedded(fixture_run: FixtureRun, tmp_path: Path):
    page = tmp_path / "page.html"
    main(["view", str(fixture_run.path), "--steps", "3:", "-o", str(page)])
    data = embedded(page)
    assert {r["step"] for r in data["rollouts"] if "turns" in r} == {3}
    assert len(data["rollouts"]) == len(fixture_run.rollouts)
    assert {r["trace_note"] for r in data["rollouts"] if r["step"] < 3 and r.get("reward") is not None} == {
        "trace not embedded (outside --steps)"}


def test_a_full_page_keeps_the_newest_steps(fixture_run: FixtureRun, tmp_path: Path):
    page = tmp_path / "page.html"
    main(["view", str(fixture_run.path), "--max-mb", "0.03", "-o", str(page)])
    data = embedded(page)
    kept = [r for r in data["rollouts"] if "turns" in r]
    left = [r for r in data["rollouts"] if r.get("trace_note", "").startswith("trace not embedded: the page is full")]
    assert kept and left and len(kept) + len(left) == len(fixture_run.traces)
    assert min(r["step"] for r in kept) >= max(r["step"] for r in left)
    # texts of the rollout that did not fit were taken back out
    used = {m["text"] for r in kept for t in r["turns"] for m in t.get("messages", []) if "text" in m}
    used |= {t["new_prompt_text"] for r in kept for t in r["turns"]}
    replies = [t["reply"] for r in kept for t in r["turns"] if "reply" in t]
    used |= {reply[k] for reply in replies for k in ("content", "reasoning") if k in reply}
    assert used == set(range(len(data["texts"])))


def refused(argv: list[str], capsys) -> str:
    """The one line `harness-rl view` refuses `argv` with (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        main(["view", *argv])
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    return line


def test_bad_arguments_say_what_is_wrong(fixture_run: FixtureRun, tmp_path: Path, capsys):
    nowhere = tmp_path / "nowhere"
    assert refused([str(nowhere)], capsys) == f"harness-rl view: {nowhere}: no such file or directory"
    assert refused([str(fixture_run.path), "--tokenizer", str(tmp_path)], capsys).startswith(
        "harness-rl view: no tokenizer.json at")
    assert "is not FIRST:LAST" in refused([str(fixture_run.path), "--steps", "a:b"], capsys)
    (fixture_run.path / "traces" / "s001-g1-r0.json").write_text("{not json")
    main(["view", str(fixture_run.path), "-o", str(tmp_path / "p.html")])
    broken = next(r for r in embedded(tmp_path / "p.html")["rollouts"] if r["rollout_id"] == "s001-g1-r0")
    assert broken["trace_note"].startswith("trace unreadable:") and "turns" not in broken


def test_prompt_source_and_prefix_break_are_shown(fixture_run: FixtureRun, tiny_model_dir: Path):
    trace = fixture_run.traces["s001-g1-r0"]
    t0, t1 = trace.turns[0], trace.turns[1]
    position = len(t0.sequence) + 2
    rewritten = [*t1.prompt_token_ids[:position], 7, *t1.prompt_token_ids[position + 1:]]
    broke = PrefixBreak(position=position, cause="tool arguments re-serialised", against="t1")
    turns = [
        msgspec.structs.replace(t0, prompt_source="rendered"),
        msgspec.structs.replace(t1, prompt_source="spliced"),
        msgspec.structs.replace(t1, node_id="again", parent_id=None, prompt_token_ids=rewritten,
                                loss_mask=[0] * len(rewritten) + t1.completion_mask, prompt_source="rendered",
                                prefix_break=broke),
    ]
    tokens = open_tokenizer(tiny_model_dir)
    views = turn_views(TrainingTrace(rollout_id="x", turns=turns), tokens, Texts())
    assert [v.prompt_source for v in views] == ["rendered", "spliced", "rendered"]
    found = views[2].prefix_break
    assert (found.position, found.cause, found.against, found.window_start) == (
        position, "tool arguments re-serialised", "t1", position - 8)
    assert found.ours == rewritten[position - 8:position + 8]
    assert found.theirs == t1.sequence[position - 8:position + 8]
    assert found.ours[8] == 7 != found.theirs[8]
    assert all(str(i) in tokens.vocab for i in found.ours + found.theirs)


def test_branches_are_embedded_with_their_reason_and_origin(fixture_run: FixtureRun):
    trace = fixture_run.traces["s001-g1-r0"]  # main (two turns), a title side call, a dropped retry
    views = turn_views(trace, None, Texts())
    assert [(v.branch.id, v.branch.reason, v.branch.origin) for v in views] == [
        (0, "main", None), (0, "main", None), (1, "side_call", None), (2, "retry", "t1")]


def test_the_mask_shown_is_what_the_runs_train_roles_train(fixture_run: FixtureRun):
    """A run trained with `--train-roles agent --train-roles auxiliary` shows its title call's tokens trained."""
    def title_masks() -> list[str]:
        view = load_run(fixture_run.path, None)
        return [t.mask for r in view.rollouts if r.rollout_id == "s001-g1-r0" for t in r.turns or []
                if t.role == "auxiliary"]

    (shown,) = title_masks()
    assert set(shown) == {"0"}
    (fixture_run.path / "config.toml").write_text('[learner]\ntrain_roles = ["agent", "auxiliary"]\n')
    (shown,) = title_masks()
    assert set(shown) == {"1"}


def test_serve_answers_the_page_on_loopback(fixture_run: FixtureRun, tmp_path: Path):
    page = tmp_path / "served.html"
    server = subprocess.Popen([sys.executable, "-m", "harness_rl.cli", "view", str(fixture_run.path), "-o", str(page),
                               "--serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        url = re.search(r"serving on (http://127\.0\.0\.1:\d+/)", line)
        assert url, line + server.stderr.read()
        with urllib.request.urlopen(url.group(1), timeout=30) as answer:
            assert answer.headers["Content-Type"] == "text/html; charset=utf-8"
            assert answer.read() == page.read_bytes()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url.group(1) + "other", timeout=30)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_folder_or_file_without_traces_is_refused_and_nothing_written(fixture_run: FixtureRun, tmp_path: Path,
                                                                       capsys, monkeypatch):
    """A folder that is no run, or a file that is no trace, would give a page of nothing that passes for a run that
    recorded nothing: one line, exit 2, no view.html (in the folder, or here for trace files)."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("no run here")
    assert refused([str(folder)], capsys) == (
        f"harness-rl view: {folder} holds no run (none of metrics.jsonl, rollouts.jsonl, traces/*.json): give the "
        "--output-dir of harness-rl train, or trace files")
    not_a_trace = folder / "readme.txt"
    line = refused([str(not_a_trace)], capsys)
    assert line.startswith(f"harness-rl view: {not_a_trace} holds no trace: trace unreadable: ")
    good = next((fixture_run.path / "traces").glob("*.json"))
    assert refused([str(good), str(not_a_trace), "-o", str(tmp_path / "p.html")], capsys).startswith(
        f"harness-rl view: {not_a_trace} holds no trace")
    assert sorted(p.name for p in folder.iterdir()) == ["readme.txt"] and not (tmp_path / "p.html").exists()
    assert not (tmp_path / "view.html").exists()
