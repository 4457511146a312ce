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


def score_of(source: str, namespace: dict) -> tuple[float, float, str]:
    """`(score, points, printed report)` of a graded cell's source run in a copy of `namespace`: the score is what
    its last line, `grade(checks, points=N)`, returns (the partial credit nbgrader records)."""
    points = float(re.match(r"# graded: (\d+)", source).group(1)) if source.startswith("# graded:") else None
    lines = source.splitlines()
    assert lines[-1].startswith("grade(checks, points=") and lines[-1].endswith(", partial=False)"), lines[-1]
    points = points or float(re.search(r"points=(\d+)", lines[-1]).group(1))
    out = io.StringIO()
    scope = dict(namespace)
    with contextlib.redirect_stdout(out):
        exec("\n".join(lines[:-1] + ["__score__ = " + lines[-1]]), scope)
    return scope["__score__"], points, out.getvalue()


@pytest.mark.parametrize("md", SETS, ids=lambda p: p.stem)
def test_each_bug_fails_its_check_and_its_fix_passes(md):
    for namespace, broken, fixed, graded in bugs(md):
        assert broken in namespace, f"{md.stem}: the broken `{broken}` is not defined before its graded cell"
        # the graded cell, hidden tests included, gives full marks with the fix ...
        score, points, report = score_of(graded, namespace)
        assert score == points and "FAIL" not in report, report
        # ... and none with the shipped bug (all or nothing: it passes the cases its bug does not touch), in its
        # visible part and in its hidden part alike
        visible, _, hidden = graded.partition("### BEGIN HIDDEN TESTS")
        hidden, _, last = hidden.partition("### END HIDDEN TESTS\n")
        imports = "\n".join(line for line in graded.splitlines() if line.startswith("from "))
        for part in (visible + last, imports + "\nchecks = []\n" + hidden + last):
            score, points, report = score_of(part.replace(fixed, broken), namespace)
            assert score == 0 and "check_fix_" in report and "  FAIL " in report, (md.stem, broken, report)


def test_bugs_are_silent():
    """A shipped bug runs without raising on its own demo (the cell before the fix ran in `bugs` already)."""
    for md in SETS:
        for namespace, broken, _, _ in bugs(md):
            assert callable(namespace[broken])
