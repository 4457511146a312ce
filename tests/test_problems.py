"""The silent-bug problem sets: every shipped bug runs, is caught by its checker, and its fix passes.

The broken and fixed functions are read from the problem-set sources themselves (chapters/problems/), so
what a learner receives is what is tested.
"""

import contextlib
import io
import pathlib
import re

import jupytext
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETS = sorted((ROOT / "chapters" / "problems").glob("*.md"))


def bugs(md):
    """(namespace, broken name, fixed name, graded cell source) for each bug, with the cells before it executed."""
    namespace, found = {}, []
    for cell in jupytext.read(md).cells:
        if cell.cell_type != "code":
            continue
        if cell.source.startswith("# graded:"):
            fixed = re.search(r"check_fix_\w+\((fixed_\w+)\)", cell.source).group(1)
            found.append((dict(namespace), fixed.removeprefix("fixed_"), fixed, cell.source))
        with contextlib.redirect_stdout(io.StringIO()):
            exec(cell.source, namespace)
    return found


def test_three_problem_sets_with_four_to_six_bugs():
    assert [p.stem for p in SETS] == ["p1_math", "p2_loop", "p3_multi_adapter"]
    for md in SETS:
        assert 4 <= len(bugs(md)) <= 6, md.stem


@pytest.mark.parametrize("md", SETS, ids=lambda p: p.stem)
def test_each_bug_fails_its_check_and_its_fix_passes(md):
    for namespace, broken, fixed, graded in bugs(md):
        assert broken in namespace, f"{md.stem}: the broken `{broken}` is not defined before its graded cell"
        # the graded cell, hidden tests included, passes with the fix ...
        with contextlib.redirect_stdout(io.StringIO()):
            exec(graded, dict(namespace))
        # ... and fails with the shipped bug, in its visible part and in its hidden part alike
        visible, _, hidden = graded.partition("### BEGIN HIDDEN TESTS")
        imports = "\n".join(line for line in graded.splitlines() if line.startswith("from "))
        for part in (visible, imports + "\n" + hidden.replace("### END HIDDEN TESTS", "")):
            with pytest.raises(AssertionError, match="FAIL check_fix_"):
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(part.replace(fixed, broken), dict(namespace))


def test_bugs_are_silent():
    """A shipped bug runs without raising on its own demo (the cell before the fix ran in `bugs` already)."""
    for md in SETS:
        for namespace, broken, _, _ in bugs(md):
            assert callable(namespace[broken])
