"""The product's own text: README.md and docs/ link only to files that exist, stay short enough to read
(README at most 250 lines, each docs page at most 500), and no tracked file tells the project's history
("session N")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_LINES = 250
DOCS_PAGE_LINES = 500

# [text](target) and ![alt](target), not inside code spans or fenced blocks (stripped first)
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HISTORY = re.compile(r"session [0-9]", flags=re.I)


def relative_links(page: Path) -> list[tuple[str, str]]:
    """(path, #fragment or "") of the page's Markdown links that point into this repository (no scheme,
    no absolute path; a bare #fragment is the page itself); links inside code are not links."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith("/"):
            continue
        path, _, fragment = target.partition("#")
        targets.append((path or page.name, fragment))
    return targets


def anchors(page: Path) -> set[str]:
    """The #fragments a Markdown page's headings get, as GitHub makes them: lower case, punctuation
    other than hyphens and underscores dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_link_reader_finds_links_and_skips_code_and_urls(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "See [a](a.md) and ![fig](img/f.png), [b](b.md#part), [web](https://x.org/y.md), [top](#top).\n"
        "`[not](code.md)`\n```\n[nor](fenced.md)\n```\n"
    )
    assert relative_links(page) == [("a.md", ""), ("img/f.png", ""), ("b.md", "part"), ("page.md", "top")]
    page.write_text("# Top\n## Faults, signals and `resume`\n```\n# not a heading\n```\n")
    assert anchors(page) == {"top", "faults-signals-and-resume"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_an_existing_file(page):
    broken = []
    for target, fragment in relative_links(page):
        resolved = (page.parent / target).resolve()
        if not resolved.exists():
            broken.append(target)
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}#{fragment}")
    assert broken == [], f"{page.relative_to(REPO)} links to missing files or headings: {broken}"


def test_the_readme_is_at_most_250_lines():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines: move detail into docs/"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(REPO)))
def test_each_docs_page_is_at_most_500_lines(page):
    lines = len(page.read_text().splitlines())
    assert lines <= DOCS_PAGE_LINES, f"{page.relative_to(REPO)} has {lines} lines: split it"


def tracked_files() -> list[str]:
    """The files git tracks; outside a git checkout (an unpacked sdist), every file but the git-ignored
    kinds (dot-folders such as .venv and .tools, runs/)."""
    if (REPO / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
        )
        return [name for name in listed.stdout.split("\0") if name]
    return [
        p.relative_to(REPO).as_posix()
        for p in REPO.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") or part == "runs" for part in p.relative_to(REPO).parts)
    ]


def test_no_tracked_file_tells_the_projects_history():
    found = []
    for name in tracked_files():
        path = REPO / name
        if not path.is_file():  # a file deleted in the work tree, not yet in the index
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a binary file (a figure)
            continue
        found += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]
    assert found == [], f"'session N' in tracked files (state the fact, not its history): {found[:20]}"
