"""marlhf_edu.teaching.book.Table: the chapters' tables, Markdown where a notebook renders it and aligned text where not."""

import html
import re

import pytest
from markdown_it import MarkdownIt
from mdit_py_plugins.gfm import gfm_plugin

from marlhf_edu.teaching.book import Table

HEADER = ["run", "refused", "RM score"]
ROWS = [["first RM; T = 1 | EOS $1 *not* [bold] <b>_x_ &lt;", "6% → 3%", "-0.69 → -0.50"],
        ["b", "12% → 12%", "+2.52 → +3.20"]]


def test_plain_text_aligns_the_columns():
    lines = repr(Table(HEADER, ROWS)).splitlines()
    assert len(lines) == 3
    # the first column is left-aligned, the others right-aligned: every row ends each column at one offset
    ends = [[m.end() for m in re.finditer(r"\S+(?: \S+)*", line)] for line in lines]
    assert ends[0][-1] == ends[1][-1] == ends[2][-1]
    assert lines[2].startswith("b  ") and all(line == line.rstrip() for line in lines)
    assert repr(Table(["a", "b"], [["x", "1"]], align="ll")).splitlines()[1] == "x  1"


def test_markdown_is_a_table_whose_cells_read_as_written():
    """The site renders the Markdown as GitHub Markdown (site/conf.py; myst-nb parses it as below): each cell
    must come back as its text, with no `|` splitting a cell, no emphasis, link or HTML made of its characters."""
    md = Table(HEADER, ROWS)._repr_markdown_()
    rendered = MarkdownIt("commonmark").use(gfm_plugin).render(md)
    cells = [html.unescape(c) for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", rendered)]
    assert [c.replace("\u00a0", " ") for c in cells] == HEADER + ROWS[0] + ROWS[1]
    assert rendered.count('style="text-align:right"') == 2 * 3  # two right-aligned columns, three rows
    # a figure breaks only before its interval; labels (left-aligned) break anywhere
    assert cells[4] == "6%\u00a0→\u00a03%" and cells[3].startswith("first RM; T = 1")
    interval = Table(["", "change"], [["a b", "+2.0 (-0.8, +4.7)"]])._repr_markdown_()
    assert "| a b | +2.0 (-0.8,\u00a0+4.7) |" in interval


def test_bad_tables_name_the_row():
    with pytest.raises(ValueError, match="row 1 has 2 cells, the header 3"):
        Table(HEADER, [ROWS[0], ["b", "1"]])
    with pytest.raises(ValueError, match="row 0 has a line break"):
        Table(["a", "b"], [["x\ny", "1"]])
    with pytest.raises(ValueError, match="align 'lx'"):
        Table(["a", "b"], [], align="lx")
