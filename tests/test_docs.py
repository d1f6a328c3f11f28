"""The documentation holds together: every relative link in the README and the docs (and the other
top-level pages and result notes) points at a file that exists, and at a heading that exists when it
names one; and the README and docs/ state current facts, with dated narrative kept to bench/results/
and CHANGELOG.md (the README's one results caption excepted)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CURRENT_DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINKED_DOCS = [*CURRENT_DOCS, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
               *sorted((ROOT / "bench" / "results").glob("*.md"))]
# The README's results table says when and where its figures were measured, in the line above it.
CAPTION = "**Latest results"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# A date in prose: not part of a path or a file name such as bench/results/2026-11-30-h200-train.json.
_DATE = re.compile(r"(?<![\w/.-])20\d\d-[01]\d-[0-3]\d(?![\w-])")


def _prose(text: str) -> str:
    """The text with fenced code blocks blanked (line count kept): links and headings there are code."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated heading numbered from -1."""
    seen: dict[str, int] = {}
    for title in _HEADING.findall(_prose(text)):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file, or heading, does not exist, as 'target (why)'."""
    broken = []
    text = page.read_text()
    for target in _LINK.findall(_prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{target} (no such heading in {linked.name})")
    return broken


def dated_lines(text: str, allow_caption: bool = False) -> list[str]:
    """Lines of prose that carry a date, except the results caption where allowed."""
    lines = _prose(text).splitlines()
    return [line for line in lines if _DATE.search(line)
            and not (allow_caption and line.startswith(CAPTION))]


def test_every_relative_link_resolves():
    broken = {str(p.relative_to(ROOT)): b for p in LINKED_DOCS if (b := broken_links(p))}
    assert not broken, f"links to files or headings that do not exist (fix the link or the heading): {broken}"


def test_readme_and_docs_hold_no_dated_narrative():
    dated = {str(p.relative_to(ROOT)): d for p in CURRENT_DOCS if (d := dated_lines(p.read_text(), p == README))}
    assert not dated, ("dated text in the README or docs/: move the measurement's story to a note in bench/results/ "
                       f"(or the change to CHANGELOG.md) and keep the current fact here: {dated}")


def test_the_readme_has_one_dated_results_caption_above_its_table():
    lines = README.read_text().splitlines()
    captions = [i for i, line in enumerate(lines) if line.startswith(CAPTION)]
    assert len(captions) == 1, f"README.md needs exactly one results caption starting {CAPTION!r}"
    after = [line for line in lines[captions[0] + 1:] if line.strip()]
    assert after and after[0].startswith("|"), "the results caption must be the line above the results table"
    assert _DATE.search(lines[captions[0]]), "the results caption must say when its figures were measured"


def test_the_checks_catch_what_they_are_for(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-code-heading-yes) [self](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](other.md#nope)\n\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nope (no such heading in other.md)"]
    text = ("Measured on 2026-11-30, one H200.\nSee bench/results/2026-11-30-h200-train.json.\n"
            f"{CAPTION} (2026-12-04)\n")
    assert dated_lines(text) == ["Measured on 2026-11-30, one H200.", f"{CAPTION} (2026-12-04)"]
    assert dated_lines(text, allow_caption=True) == ["Measured on 2026-11-30, one H200."]
