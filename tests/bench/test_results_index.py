"""bench/results/ explains itself: every JSON and log there is named by a note (.md) beside it, every
file is named date-machine-topic, and the folder's README lists every note once, newest first."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
INDEX = RESULTS / "README.md"
NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-[a-z0-9]+-[a-z0-9][a-z0-9.-]*\.(md|json|log)$")
_INDEX_LINK = re.compile(r"^- \[.+\]\(([^)]+\.md)\)", re.M)


def unexplained(folder: Path) -> list[str]:
    """The result files (.json, .log) of `folder` whose name no note (.md) there contains."""
    notes = " ".join(p.read_text() for p in folder.glob("*.md"))
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".json", ".log") and p.name not in notes)


def notes(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.md") if p.name != "README.md")


def test_every_result_file_is_named_by_a_note():
    missing = unexplained(RESULTS)
    assert not missing, ("result files no note in bench/results/ names: write (or extend) the note of the same "
                         f"date-machine-topic that says what was measured, with which command, and names them: {missing}")


def test_result_files_are_named_date_machine_topic():
    bad = sorted(p.name for p in RESULTS.iterdir() if p != INDEX and not NAME.match(p.name))
    assert not bad, f"name these like 2026-11-30-h200-train.json (date, machine, topic; .md, .json or .log): {bad}"


def test_the_index_lists_every_note_once_newest_first():
    listed = _INDEX_LINK.findall(INDEX.read_text())
    assert sorted(listed) == notes(RESULTS), (
        "bench/results/README.md must list every note exactly once, one '- [title](note.md): ...' line each: "
        f"missing {sorted(set(notes(RESULTS)) - set(listed))}, extra or repeated "
        f"{sorted(n for n in set(listed) if listed.count(n) > 1 or n not in notes(RESULTS))}")
    dates = [NAME.match(n).group(1) for n in listed]
    assert dates == sorted(dates, reverse=True), "bench/results/README.md lists the notes newest first: reorder it"


def test_a_result_file_without_a_note_is_found(tmp_path: Path):
    (tmp_path / "2026-01-02-h200-train.json").write_text("{}")
    (tmp_path / "2026-01-02-h200-train.log").write_text("")
    (tmp_path / "2026-01-02-h200-train.md").write_text("Results: 2026-01-02-h200-train.json.\n")
    assert unexplained(tmp_path) == ["2026-01-02-h200-train.log"]
