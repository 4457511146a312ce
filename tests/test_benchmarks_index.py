"""benchmarks/README.md indexes every record in benchmarks/: one table row per top-level file or folder, linked
from the row's first cell, and every link in it leads to something that exists. A record added without its row
fails here."""

from __future__ import annotations

import pathlib
import re

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
INDEX = BENCH / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def entries() -> set[str]:
    """Top-level records: every file or folder but the index itself, hidden names and symbolic links (a test in
    test_classroom.py makes one here for a moment; records are never links)."""
    return {p.name for p in BENCH.iterdir()
            if p.name != "README.md" and not p.name.startswith(".") and not p.is_symlink()}


def local_links(text: str) -> list[str]:
    return [t.split("#")[0] for t in LINK.findall(text)
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def row_records(text: str) -> list[str]:
    """The record each table row links from its first cell, as a top-level name (no ./, no trailing /)."""
    records = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        first = line.strip("|").split("|")[0]
        links = local_links(first)
        if links:
            records.append(links[0].removeprefix("./").rstrip("/"))
    return records


def test_every_record_has_one_row():
    records = row_records(INDEX.read_text())
    missing = sorted(entries() - set(records))
    assert not missing, f"benchmarks/README.md has no row for: {missing}"
    extra = sorted(set(records) - entries())
    assert not extra, f"benchmarks/README.md has rows for records that are not there: {extra}"
    twice = sorted({r for r in records if records.count(r) > 1})
    assert not twice, f"benchmarks/README.md has more than one row for: {twice}"


def test_every_link_exists():
    broken = [t for t in local_links(INDEX.read_text()) if not (BENCH / t).exists()]
    assert not broken, f"benchmarks/README.md links to paths that do not exist: {broken}"


def test_the_last_token_runs_have_their_own_index():
    """benchmarks/smollm2_last_token/ (the 20 runs made before the EOS fix, one topic) indexes its runs the same way."""
    folder = BENCH / "smollm2_last_token"
    text = (folder / "README.md").read_text()
    runs = {p.name for p in folder.iterdir() if p.is_dir()}
    records = row_records(text)
    assert len(runs) == 20 and sorted(records) == sorted(runs), sorted(runs ^ set(records))
    broken = [t for t in local_links(text) if not (folder / t).exists()]
    assert not broken, broken
