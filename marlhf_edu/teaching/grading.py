"""The exercise framework: a checker's report, its cases, the grade of a graded cell, and what is withheld.

A checker (`marlhf_edu.teaching.checks`) builds its cases with `_run`, each a function that returns None or what
went wrong, and compares tensors with `_compare`; the result is a `CheckReport`, truthy when every case passes.
`case` turns a hand-written check into a report of one case, and `grade` turns a graded cell's reports into the
partial credit nbgrader records. `withheld` swaps the code of the package's own answers for a stub that raises
`NotImplementedError`; `_withholds` marks what a checker withholds (dotted paths, `_resolve` finds them) and
`_learner` runs the learner's function inside that window.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class CheckReport:
    """Outcome of one `check_…` call; truthy iff every case passed."""

    name: str
    cases: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    passing: str = "agree with the reference"  # what a passing case did, for the PASS line
    problems: list[str | None] = field(default_factory=list)  # per case, in order: None or what went wrong
    seed: int | None = None  # the checker's `seed=`, which drew its random inputs (None: a hand-written `case`)

    def __bool__(self) -> bool:
        return not self.failures

    def case_lines(self) -> list[str]:
        """Every case on its own line, PASS or FAIL (with what went wrong)."""
        return [f"  PASS {case}" if problem is None else f"  FAIL {problem}"
                for case, problem in zip(self.cases, self.problems)]

    def require(self) -> None:
        """Print the PASS line, or raise `AssertionError` whose message is the case-by-case report."""
        if self.failures:
            raise AssertionError("\n" + repr(self))
        print(repr(self))

    def brief(self) -> str:
        """One line: PASS, or FAIL with the labels of the failing cases (no numbers, so it reads the same on any CPU)."""
        if not self.failures:
            return f"PASS {self.name}: all {len(self.cases)} cases"
        failed = [c for c in self.cases if any(f.startswith(c) for f in self.failures)]
        return f"FAIL {self.name} on: " + "; ".join(failed)

    def __repr__(self) -> str:
        if not self.failures:
            return f"PASS {self.name}: all {len(self.cases)} cases {self.passing}"
        lines = [f"FAIL {self.name}: {len(self.failures)} of {len(self.cases)} cases disagree"]
        raised = {f.partition(": raised ")[2] for f in self.failures}
        if len(self.failures) > 1 and len(raised) == 1 and "" not in raised:  # one error everywhere: say it once
            return lines[0] + f"\n  - every case raised {raised.pop()}"
        lines += [f"  - {f}" for f in self.failures]
        return "\n".join(lines)


def _stub_code(qualname: str):
    # The stub runs with the withheld function's globals, so it may only use builtins and its own constants.
    message = (f"{qualname} is withheld while your exercise is checked: write it yourself "
               "(torch and the package's other functions are allowed)")
    namespace: dict = {}
    exec(f"def stub(*args, **kwargs):\n    raise NotImplementedError({message!r})", namespace)
    return namespace["stub"].__code__


@contextlib.contextmanager
def withheld(*functions: Callable):
    """Within the block, every call to one of `functions` raises `NotImplementedError`.

    The function objects' code is swapped, so the names imported anywhere
    (`marlhf_edu.masked_mean`, `marlhf_edu.math.masked.masked_mean`, a module that
    imported it) all lead to the stub; the original code is restored on exit.
    """
    targets = [inspect.unwrap(getattr(f, "__func__", f)) for f in functions]  # a classmethod: its function
    saved = [f.__code__ for f in targets]
    for f in targets:
        if f.__code__.co_freevars:  # a closure's code cannot be swapped for one without free variables
            raise TypeError(f"cannot withhold {f.__qualname__}: it is a closure")
    try:
        for f in targets:
            f.__code__ = _stub_code(f"{f.__module__}.{f.__qualname__}")
        yield
    finally:
        for f, code in zip(targets, saved):
            f.__code__ = code


def _withholding(fn: Callable, functions: tuple[Callable, ...]) -> Callable:
    """`fn`, called with the package's `functions` withheld."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        with withheld(*functions):
            return fn(*args, **kwargs)
    return guarded


def _withholds(*names: str):
    """Decorator: the checker withholds these package functions (dotted paths) while the learner's code runs."""
    def mark(check):
        check.withholds = names
        return check
    return mark


def _resolve(path: str) -> Callable:
    """The function at a dotted path: a module's function, or a class's method (`gguf.quants.Q4_1.dequantize_blocks`)."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ValueError(f"cannot resolve {path!r}")


def _learner(fn: Callable, check: Callable) -> Callable:
    return _withholding(fn, tuple(_resolve(p) for p in check.withholds))


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _compare(label: str, got, expected: torch.Tensor, atol: float, rtol: float) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{label}: expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"{label}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    got = got.detach().double()
    expected = expected.detach().double()
    if torch.isnan(got).any():
        return f"{label}: result contains NaN"
    bad = ~torch.isclose(got, expected, atol=atol, rtol=rtol)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0].tolist())
        at = f" at index {idx}" if got.dim() else ""
        return f"{label}: got {got[idx].item():.6g}{at}, expected {expected[idx].item():.6g}"
    return None


def _run(name: str, cases: list[tuple[str, Callable[[], str | None]]],
         passing: str = "agree with the reference", seed: int | None = None) -> CheckReport:
    report = CheckReport(name, passing=passing, seed=seed)
    for label, case in cases:
        report.cases.append(label)
        # a warning or stderr line from the learner's code would make nbgrader give the whole cell 0, whatever
        # the cases say (nbgrader.utils.determine_grade): both are kept out of the cell's output
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                problem = case()
            except Exception as err:  # a learner's bug must become a report line, not a crash
                problem = f"{label}: raised {type(err).__name__}" + (f": {err}" if str(err) else "")
        report.problems.append(problem or None)
        if problem:
            report.failures.append(problem)
    return report


def case(label: str, test: Callable[[], bool], withhold: Callable | None = None) -> CheckReport:
    """One hand-written case as a report of one case, for `grade`: passes when `test()` returns True; False or an
    exception fails it (the exception becomes the report line, as in the checkers). `withhold`: the checker of the
    same exercise; `test` runs with what that checker withholds withheld (a graded cell's cases all do, so no
    case can be passed by calling the package's answer)."""
    if withhold is not None:
        test = _learner(test, withhold)
    return _run(label, [(label, lambda: None if test() else f"{label}: wrong result")])


def grade(reports: list[CheckReport], points: float, partial: bool = True) -> float:
    """The credit of a graded cell: `points` times the share of all the `reports`' cases that pass, rounded to
    0.01 (with `partial=False`: `points` when every case passes, else 0). Prints every case, PASS or FAIL, then
    the score; returns the score, which the cell shows as its last value: nbgrader reads a graded cell's
    numeric value as its partial credit (`nbgrader.utils.determine_grade`; an error, or anything on stderr,
    gives 0). So one right case of seven earns a seventh of the points, where `require()` gave what an empty
    stub gets. The problem sets grade all or nothing: the function they hand out already passes the cases its
    bug does not touch. A checker run more than once (hidden tests draw other inputs with another `seed=`) prints
    one block: its cases, each PASS where it passed on every seed, else FAIL with the seed it failed on."""
    total = sum(len(r.cases) for r in reports)
    passed = sum(p is None for r in reports for p in r.problems)
    if not total:
        raise ValueError("grade: no cases to grade")
    groups: dict[str, list[CheckReport]] = {}  # one block per checker, in the order they first ran
    for report in reports:
        groups.setdefault(report.name, []).append(report)
    for name, runs in groups.items():
        if all(r.cases == [r.name] for r in runs):  # hand-written `case`s: each one line says it all
            for r in runs:
                print(r.case_lines()[0].strip())
            continue
        ok = sum(p is None for r in runs for p in r.problems)
        n = sum(len(r.cases) for r in runs)
        if len(runs) == 1 or any(r.cases != runs[0].cases for r in runs):  # one run, or runs of different cases
            for r in runs:
                seed = f" (seed {r.seed})" if len(runs) > 1 and r.seed is not None else ""
                print(f"{name}{seed}: {sum(p is None for p in r.problems)} of {len(r.cases)} cases pass")
                print("\n".join(r.case_lines()))
            continue
        seeds = ", ".join(str(r.seed) for r in runs)
        print(f"{name}, seeds {seeds}: {ok} of {n} cases pass")
        for i, label in enumerate(runs[0].cases):
            failed = [(r.seed, r.problems[i]) for r in runs if r.problems[i] is not None]
            if not failed:
                print(f"  PASS {label}")
            for seed, problem in failed:
                print(f"  FAIL {problem} (seed {seed})")
    share = passed / total if partial else float(passed == total)
    score = round(points * share, 2)
    rule = "" if partial else ", all or nothing"
    print(f"score: {score:g} of {points:g} points ({passed} of {total} cases pass{rule})")
    return score


def _padded_mask(gen: torch.Generator, B: int, T: int, left: bool = False) -> torch.Tensor:
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return mask.flip(1) if left else mask
