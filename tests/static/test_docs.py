"""The documentation holds together: every relative link in a tracked Markdown file
points at a file that exists, and every ``#anchor`` at a heading of that file (GitHub's
anchors: lower-cased, punctuation dropped, spaces as hyphens); the README stays a
landing page."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.harness.runs import ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                          "*.md"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / f for f in out if (ROOT / f).is_file()]


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code removed (links there are examples)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (duplicates numbered -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in LINK.findall(without_code(path.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto: - not checked offline
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.relative_to(root)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.relative_to(root)}: {target}: no heading #{anchor}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(path):
    assert not broken_links(path), "\n".join(broken_links(path))


def test_the_checker_finds_a_dead_link_and_a_dead_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## The run: `dir`\n[ok](b.md#sub-part) "
                                   "[self](#the-run-dir) [gone](c.md) [bad](b.md#nope) "
                                   "`[code](x.md)`\n")
    (tmp_path / "b.md").write_text("# B\n### Sub part\n")
    found = broken_links(tmp_path / "a.md", tmp_path)
    assert found == ["a.md: c.md: no such file", "a.md: b.md#nope: no heading #nope"]


def test_the_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    linked = set(LINK.findall(readme))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not index: {pages - linked}"
    for section in ("## Quick start", "## Exit codes", "## Commands"):
        assert section in readme


def test_the_readme_lists_every_exit_code_and_no_other():
    from train.core.errors import EXIT_CODES
    section = (ROOT / "README.md").read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    assert [int(c) for c in re.findall(r"^\| (\d+) \|", section, flags=re.M)] == list(EXIT_CODES)
