"""Helpers the chapters use to show code and keep outputs reproducible."""

from __future__ import annotations

import inspect
import os
import random
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
