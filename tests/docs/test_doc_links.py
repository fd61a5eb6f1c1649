"""Every relative link of the README and the docs reaches a file that exists and, with an
``#anchor``, a heading of that file (GitHub's anchor of it); the reference pages stay short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of ``path``: lower case, punctuation but hyphens and
    underscores dropped, spaces as hyphens, a repeated one numbered -1, -2..."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in _prose(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = counts.get(slug, 0)
        counts[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _prose(path):
        text = re.sub(r"`[^`]*`", "", line)  # links are not written inside inline code
        found += [(number, target) for target in LINK.findall(text)]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for number, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{page.name}:{number}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{page.name}:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_a_broken_link_and_anchor_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title here\n\n[a](page.md#title-here) [b](nothing.md) "
                    "[c](#no-heading) `[d](ignored.md)`\n", encoding="utf-8")
    assert _anchors(page) == {"title-here"}
    assert [t for _, t in _links(page)] == ["page.md#title-here", "nothing.md", "#no-heading"]


def test_performance_page_is_a_reference_of_about_300_lines():
    lines = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300


def test_readme_status_cells_are_at_most_300_characters():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Status: what runs where", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert len(rows) >= 6, "the status table is missing"
    long = {row.split("|")[1].strip(): len(cell.strip())
            for row in rows for cell in row.strip().strip("|").split("|")
            if len(cell.strip()) > 300}
    assert not long, f"status cells over 300 characters: {long}"
