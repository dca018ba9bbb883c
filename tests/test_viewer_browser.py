"""The viewer page in headless Chromium (Debian's `chromium`): it draws, it holds the run, its filter works.

Skipped, saying why, where Chromium is not installed (`scripts/install_browser.sh` installs it as root).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from viewer_fixture import FixtureRun, make_run

from harness_rl.cli import main
from harness_rl.learner.rows import completion_mask

pytestmark = pytest.mark.slow
TOKEN_CAP = int(re.search(r"const TOKEN_CAP = (\d+);", (
    Path(__file__).resolve().parent.parent / "harness_rl" / "viewer" / "assets" / "viewer.js").read_text()).group(1))
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (as root: apt-get install -y chromium, or scripts/install_browser.sh)")
    return found


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[FixtureRun, Path]:
    run = make_run(tmp_path_factory.mktemp("view") / "run", tiny_model_dir, steps=3)
    model = run.path / "checkpoints" / "step-00000003" / "model"
    model.mkdir(parents=True)
    shutil.copy(tiny_model_dir / "tokenizer.json", model)
    main(["view", str(run.path)])
    return run, run.path / "view.html"


def browse(chromium: str, profile: Path, url: str, *args: str) -> str:
    done = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", "--window-size=1440,1600",
                           "--virtual-time-budget=5000", *args, url], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def dom(chromium: str, tmp_path: Path, page: Path, fragment: str = "") -> str:
    html = browse(chromium, tmp_path / "profile", page.as_uri() + fragment, "--dump-dom")
    assert 'data-ready="1"' in html, "the page's script did not finish"
    return re.sub(r"<script.*?</script>", "", html, flags=re.S)  # the rendered page, not the script's source


def test_screenshot_is_not_blank(chromium: str, page: tuple[FixtureRun, Path], tmp_path: Path):
    from PIL import Image

    png = tmp_path / "viewer.png"
    browse(chromium, tmp_path / "profile", page[1].as_uri(), f"--screenshot={png}")
    image = Image.open(png).convert("RGB")
    assert image.size == (1440, 1600)
    small = image.resize((360, 400))
    colours = small.getcolors(maxcolors=360 * 400)
    assert colours is not None and len(colours) > 500, "too few colours: the page did not draw"
    background = max(colours)[0] / (360 * 400)
    assert background < 0.75, f"{background:.0%} of the page is one colour"


def test_dom_holds_the_runs_turns_and_token_spans(chromium: str, page: tuple[FixtureRun, Path], tmp_path: Path):
    run, html_page = page
    html = dom(chromium, tmp_path, html_page)
    assert len(re.findall(r'<div class="row[ "]', html)) == len(run.rollouts)
    assert len(re.findall(r'<div class="cell[ "]', html)) == len(run.rollouts)
    # four turns (auxiliary, discarded); an undelivered completion; a completion past the token cap
    for rollout_id in ("s001-g1-r0", "s002-g2-r1", "s003-g3-r3"):
        trace = run.traces[rollout_id]
        html = dom(chromium, tmp_path, html_page, f"#rollout={rollout_id}")
        assert re.search(rf'<h2>{rollout_id}</h2>', html)
        assert len(re.findall(r'<section class="turn[ "]', html)) == len(trace.turns)
        spans = sum(min(TOKEN_CAP, len(t.completion_token_ids)) for t in trace.turns)
        assert len(re.findall(r'<span class="tok[ "]', html)) == spans
        greyed = sum(completion_mask(t)[:TOKEN_CAP].count(0) for t in trace.turns)  # mask 0: greyed
        assert len(re.findall(r'<span class="tok m0[ "]', html)) == greyed
        assert greyed or rollout_id == "s003-g3-r3"
        branches = {t.branch.id: t.branch.reason for t in trace.turns}
        assert len(re.findall(r'<span class="branch">', html)) == len(branches)  # the branch list under the graph
        assert len(re.findall(r'<span class="badge branch"', html)) == len(trace.turns)
    assert any(len(t.completion_token_ids) > TOKEN_CAP for t in run.traces["s003-g3-r3"].turns)
    assert "show all" in html


def test_a_reward_filter_in_the_address_filters_the_list(chromium: str, page: tuple[FixtureRun, Path],
                                                        tmp_path: Path):
    run, html_page = page
    for query, keep in (("#reward>=0.5", lambda r: r["reward"] is not None and r["reward"] >= 0.5),
                        ("#reward<0.5 task=digits", lambda r: r["reward"] is not None and r["reward"] < 0.5),
                        ("#error", lambda r: r["error"] is not None)):
        expected = [r["rollout_id"] for r in run.rollouts if keep(r)]
        assert 0 < len(expected) < len(run.rollouts), query
        html = dom(chromium, tmp_path, html_page, query.replace(" ", "%20"))
        assert re.findall(r'<div class="row[^"]*" data-i="\d+" data-rollout="([^"]+)"', html) == expected, query
        assert f'data-shown="{len(expected)}" data-total="{len(run.rollouts)}"' in html
        assert len(re.findall(r'<div class="cell[^"]*out"', html)) == len(run.rollouts) - len(expected)
