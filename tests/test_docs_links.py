"""Every link between the project's pages points at a file that exists and, with an anchor, at a heading of it
(the anchor as GitHub makes it from the heading's text), so a renamed section cannot leave the README pointing
nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Markdown links, and bare `page.md#anchor` references in the text.
LINK = re.compile(r"\]\(([^)\s]+)\)|(?<![\w/])((?:docs/)?\w+\.md#[\w\-]+)")


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    heading numbered from -1."""
    found, seen = set(), {}
    for line in page.read_text().splitlines():
        heading = re.match(r"^#{1,6} (.*)", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    broken = []
    for page in pages:
        for match in LINK.finditer(page.read_text()):
            target = match.group(1) or match.group(2)
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: outside the project
                continue
            path, _, anchor = target.partition("#")
            file = page if not path else next((p for p in (page.parent / path, root / path) if p.exists()), None)
            if file is None:
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in github_anchors(file):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_every_link_between_the_pages_resolves():
    assert broken_links(PAGES) == []


def test_a_link_to_a_missing_heading_or_file_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Results\n\n## The full run (603 questions)\n\n"
        "[it](#the-full-run-603-questions), [gone](#the-full-run), [file](other.md), page.md#results, [web](https://x.org)\n"
    )
    assert github_anchors(page) == {"results", "the-full-run-603-questions"}
    found = broken_links([page], tmp_path)
    assert found == ["page.md: #the-full-run (no such heading)", "page.md: other.md (no such file)"]
