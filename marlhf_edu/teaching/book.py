"""Helpers the chapters use to show code and keep outputs reproducible."""

from __future__ import annotations

import inspect
import os
import random
import re
import warnings


class Source:
    """The source of a package object, shown as highlighted code in a notebook.

    Its plain-text form is the source itself, so nbval compares the code a
    chapter shows with the code the package runs.
    """

    def __init__(self, obj):
        self.obj = obj
        self.text = inspect.getsource(obj)

    def __repr__(self) -> str:
        return self.text.rstrip("\n")

    def _repr_markdown_(self) -> str:
        return f"```python\n{self.text}```"


def show(obj) -> Source:
    """Display the package's own implementation of `obj` (function, class or module)."""
    return Source(obj)


# ASCII punctuation that Markdown could read as markup (`&lt;` as an entity; `$` opens math in MyST); a backslash
# keeps each literal, as CommonMark allows before any ASCII punctuation
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_\[\]<>|$~#!&])")


class Table:
    """Rows of a chapter's table: `header` (n labels) and `rows` (each n cells, formatted by the chapter).

    Where a notebook renders Markdown (JupyterLab, the book's site) it is a Markdown table whose long labels
    wrap inside their column (a right-aligned figure such as "+2.0 (-0.8, +4.7)" only before its bracket),
    so a wide table still fits the site's text column. Its plain-text form, which nbval compares and a
    terminal shows, is the same cells aligned in columns. `align` has one letter a column, `l` or `r`
    (default: the first column left, the others right). Chapters 06, 09 to 13 and 15 print their wide tables
    with it; chapter 13, which compares many runs, most.
    """

    def __init__(self, header, rows, align: str | None = None):
        self.header = [str(h) for h in header]
        self.rows = [[str(c) for c in row] for row in rows]
        self.align = align or "l" + "r" * (len(self.header) - 1)
        for i, row in enumerate(self.rows):
            if len(row) != len(self.header):
                raise ValueError(f"Table: row {i} has {len(row)} cells, the header {len(self.header)}: {row}")
        for i, row in enumerate([self.header, *self.rows]):
            if any("\n" in cell for cell in row):  # a Markdown table row is one line
                where = "the header" if i == 0 else f"row {i - 1}"
                raise ValueError(f"Table: {where} has a line break in a cell: {row}")
        if len(self.align) != len(self.header) or set(self.align) - {"l", "r"}:
            raise ValueError(f"Table: align {self.align!r} needs one of 'l' or 'r' for each of "
                             f"{len(self.header)} columns")

    def __repr__(self) -> str:
        lines = [self.header, *self.rows]
        widths = [max(len(line[k]) for line in lines) for k in range(len(self.header))]
        return "\n".join("  ".join(cell.ljust(w) if a == "l" else cell.rjust(w)
                                   for cell, w, a in zip(line, widths, self.align)).rstrip() for line in lines)

    def _repr_markdown_(self) -> str:
        def row(cells, figures=False):
            if figures:  # a right-aligned cell is a figure: it may break before its bracketed interval, nowhere else
                cells = [re.sub(r" (?![(\[])", "\u00a0", c) if a == "r" else c for c, a in zip(cells, self.align)]
            return "| " + " | ".join(_MARKDOWN_PUNCTUATION.sub(r"\\\1", c) for c in cells) + " |"

        rule = "|" + "|".join(" --- " if a == "l" else " ---: " for a in self.align) + "|"
        return "\n".join([row(self.header), rule, *(row(r, figures=True) for r in self.rows)])


def setup(seed: int = 0) -> None:
    """First cell of every chapter: seed everything, quiet printing, offline mode.

    Deterministic seeds and rounded printing make stored outputs reproduce
    under `pytest --nbval`; progress bars and library warnings are turned off
    so nothing variable reaches stderr.
    """
    import numpy as np
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")
    # transformers and datasets bars follow their own switches, not TQDM_DISABLE; with ipywidgets installed
    # (nbgrader brings it) they would become widget outputs with random ids in stored notebooks
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_printoptions(precision=4, sci_mode=False, linewidth=100)
    np.set_printoptions(precision=4, suppress=True, linewidth=100)
    try:
        import matplotlib

        matplotlib.rcParams.update({"figure.figsize": (6.4, 3.6), "figure.dpi": 80, "axes.grid": True,
                                    "grid.alpha": 0.3, "svg.hashsalt": "marlhf-edu"})
    except ImportError:  # plotting is optional outside the book
        pass


class quietly:
    """Context manager: run library code (a trl trainer, say) with its console output captured.

    Trainers print timing-dependent log lines; the chapters print the numbers
    they teach themselves, rounded, so stored outputs stay reproducible.
    The captured text stays available as `.stdout` / `.stderr`.
    """

    def __enter__(self):
        import contextlib
        import io

        self._out, self._err = io.StringIO(), io.StringIO()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self._out))
        self._stack.enter_context(contextlib.redirect_stderr(self._err))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        self.stdout, self.stderr = self._out.getvalue(), self._err.getvalue()
        return False
