"""The documentation (issue 30): README.md is a front page read in a minute, and ``docs/`` builds into a site with
MkDocs (``mkdocs.yml``), whose strict build fails on a page or link that is not there.

Pages link to each other with relative ``.md`` links, which the build checks; a file of the repository outside
``docs/`` is named as code, never linked (``mkdocs.yml`` says why), so a link out of ``docs/`` fails too.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
#: The two set-up commands, as the README shows them and users copy them.
DEMO_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python run_sim.py"
TEST_COMMAND = ('python3 -m venv .venv && . .venv/bin/activate && pip install -q -e ".[dev,profile]" '
                '&& python -m pytest -q')


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``python -m mkdocs build --strict`` of ``root/mkdocs.yml`` into ``site``."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300)


def bash_blocks(text: str) -> list[str]:
    """The lines of every ``bash`` code block of a Markdown text."""
    return [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for line in block.splitlines()]


def test_the_site_builds_strictly_with_every_page(tmp_path):
    result = build(REPO, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    built = sorted(str(p.relative_to(tmp_path / "site")) for p in (tmp_path / "site").rglob("index.html"))
    pages = sorted("index.html" if p.stem == "index" else f"{p.stem}/index.html" for p in DOCS.glob("*.md"))
    assert built == pages


@pytest.fixture(scope="module")
def docs_copy(tmp_path_factory) -> Path:
    """``docs/`` and ``mkdocs.yml`` copied to a folder of their own, where they build as they are."""
    root = tmp_path_factory.mktemp("docs_copy")
    shutil.copytree(DOCS, root / "docs")
    shutil.copy2(REPO / "mkdocs.yml", root / "mkdocs.yml")
    intact = build(root, tmp_path_factory.mktemp("site"))
    assert intact.returncode == 0, intact.stderr[-3000:]
    return root


def drop_page(docs: Path) -> str:
    (docs / "trust.md").unlink()  # still in the nav
    return "trust.md"


def stray_page(docs: Path) -> str:
    (docs / "stray.md").write_text("# Stray\n\nA page no nav entry lists.\n")
    return "stray.md"


def link_to(target: str):
    def edit(docs: Path) -> str:
        with (docs / "index.md").open("a") as f:
            f.write(f"\nSee [there]({target}).\n")
        return target
    edit.__name__ = f"link to {target}"
    return edit


@pytest.mark.parametrize("breakage", [
    drop_page, stray_page, link_to("no_such_page.md"), link_to("trust.md#no-such-section"),
    link_to("#no-such-section"), link_to("../README.md"), link_to("../notebooks/figures/demo_crossover.png"),
], ids=lambda f: f.__name__)
def test_a_missing_page_or_a_broken_link_fails_the_build(tmp_path, docs_copy, breakage):
    root = tmp_path / "repo"
    shutil.copytree(docs_copy, root)
    culprit = breakage(root / "docs")
    broken = build(root, tmp_path / "broken")
    assert broken.returncode != 0
    assert culprit in broken.stderr, broken.stderr[-3000:]


def test_the_readme_is_a_short_front_page():
    assert len(README.read_text().splitlines()) < 160


def test_the_readme_holds_both_set_up_commands_verbatim():
    assert {DEMO_COMMAND, TEST_COMMAND} <= set(bash_blocks(README.read_text()))


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert ci == [TEST_COMMAND]


def test_the_readme_points_to_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)(?:#[\w-]*)?\)", README.read_text()))
    assert linked == {p.name for p in DOCS.glob("*.md")} - {"index.md"}


def test_every_link_and_image_of_the_readme_resolves():
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local
    for target in local:
        path, _, anchor = target.partition("#")
        assert (REPO / path).is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), flags=re.M)
            assert anchor in {slugify(h, "-") for h in headings}, target
