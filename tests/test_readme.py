"""README.md is short (what it is, the two commands, a "where is X" table, links) and its table
names files that exist; every link between the docs lands on a file and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_LINES = 150
# what a newcomer asks first: each must have a row in the table
ASKED = ("the train step", "how a variant's config is composed", "what happens on a preemption",
         "where the pod-hour figure comes from", "how a run is launched on a slice")


def where_is_rows() -> dict[str, str]:
    text = README.read_text()
    table = text.split("## Where is X", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return {what.strip(): where.strip() for what, where in rows[1:]}  # rows[0] is the header


def named_paths(cell: str) -> list[str]:
    """The repository paths a table cell names in backticks (`runtime/loop.py`, `conf/experiment/<group>/`)."""
    return [p for p in re.findall(r"`([^`\s]+)`", cell) if "/" in p or p.endswith((".py", ".md"))]


def test_the_readme_is_at_most_150_lines_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, "README.md grew past 150 lines: move the detail into docs/"
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text


def test_the_where_is_x_table_answers_the_first_questions_with_files_that_exist():
    rows = where_is_rows()
    for asked in ASKED:
        assert any(what.startswith(asked) for what in rows), f"README's table has no row for {asked!r}"
    for what, where in rows.items():
        paths = named_paths(where)
        assert paths, f"the row {what!r} names no file"
        for p in paths:
            pattern = re.sub(r"<[^>]+>", "*", p)
            assert list(REPO.glob(pattern.rstrip("/"))), f"README's row {what!r} names {p}, which does not exist"


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    heads = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}
    return heads | set(re.findall(r'<a id="([^"]+)"', text))


def test_every_link_between_the_docs_lands():
    docs = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "experiments" / "README.md",
            *sorted((REPO / "experiments").glob("*/README.md"))]
    broken = []
    for doc in docs:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            full = (doc.parent / path).resolve() if path else doc
            if not full.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and full.suffix == ".md" and anchor not in _anchors(full):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken
