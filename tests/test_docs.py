"""The docs: the site builds strictly, every repository path the pages name exists, and the README stays a
front door.

Repository paths are written in the docs as backticked paths from the repository's root
(`harness_rl/run/train.py`), in prose or in code blocks, never as links (links are only between pages, and
from the README into docs/): a path counts when it starts with one of the repository's folders below, and
placeholders (`<name>`, `*`, `{id}`) are left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("harness_rl", "proxy", "adapters", "tests", "benchmarks", "examples", "scripts", "docs")
README_MAX_LINES = 250

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"[<>*{}|$]")


def named_paths(text: str) -> set[str]:
    """The repository paths a page names, in code spans and code blocks."""
    blocks = FENCE.findall(text)
    code = [span for _, span in SPAN.findall(FENCE.sub("", text))] + blocks
    found = set()
    for token in (token for piece in code for token in re.split(r"[\s()\[\],;='\"]+", piece)):
        path = token.split("::")[0].split(":")[0].split("#")[0].rstrip(".")
        if "/" in path and path.split("/")[0] in FOLDERS and not PLACEHOLDER.search(path):
            found.add(path)
    return found


def missing(page: Path, text: str) -> list[str]:
    """Paths and relative links of a page that lead nowhere in the repository."""
    gone = [f"`{path}`" for path in sorted(named_paths(text)) if not (ROOT / path).exists()]
    for target in LINK.findall(FENCE.sub("", text)):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            gone.append(f"link {target}")
    return gone


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=root,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = mkdocs_build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "one_step" / "index.html").is_file()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    for name in ("mkdocs.yml", "README.md", "docs"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, tmp_path / name)
    with (tmp_path / "docs" / "index.md").open("a") as index:
        index.write("\n[gone](no-such-page.md) and [no heading](proxy.md#no-such-heading)\n")
    done = mkdocs_build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr and "#no-such-heading" in done.stderr


def test_every_repository_path_the_docs_name_exists() -> None:
    gone = {str(page.relative_to(ROOT)): found for page in PAGES if (found := missing(page, page.read_text()))}
    assert gone == {}


def test_a_planted_broken_path_is_found() -> None:
    text = ("Run `harness_rl/run/train.py` and `harness_rl/run/no_such_module.py`, not a placeholder like\n"
            "`adapters/harnesses/<name>.py`.\n"
            "```bash\npython benchmarks/no_such_bench.py --engine URL\n```\n"
            "See [the proxy](proxy.md) and [nothing](no-such-page.md).\n")
    assert missing(ROOT / "docs" / "index.md", text) == [
        "`benchmarks/no_such_bench.py`", "`harness_rl/run/no_such_module.py`", "link no-such-page.md"]


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES
    assert "make test" in (ROOT / "README.md").read_text()  # the test command .ci/run calls
