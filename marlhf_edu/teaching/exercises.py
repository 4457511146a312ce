"""Checkers for the chapters' exercises.

Each `check_…` runs the learner's function and the package's reference on the
same random and edge-case inputs and reports, case by case, where behaviour
differs. It never reads the learner's source: any correct implementation
passes. The report is truthy when every case passes; `report.require()` raises
`AssertionError` with the case-by-case report. The graded (nbgrader) test cells
collect reports (`case` turns a hand-written check into one) and end with
`grade(reports, points)`, which prints every case and returns the partial
credit nbgrader records. `seed=` draws other random cases for hidden tests.

While the learner's function runs, the package's own implementation of what
the exercise asks for is *withheld*: calling it (under any import path) raises
`NotImplementedError`, so an exercise cannot be passed by calling the package.
The references are computed outside that window. Each checker lists what it
withholds in its `withholds` attribute (`tools/book.py` drops the chapter's
`show()` of those functions from the student copy).
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

from marlhf_edu.data.formats import pku_saferlhf_to_preference
from marlhf_edu.data.template import format_completion
from marlhf_edu.loading.gguf_blocks import dequantize_q4_1
from marlhf_edu.math.dpo import ipo_loss, ipo_preferred_margin, margin_trajectory
from marlhf_edu.math.evaluation import mean_interval
from marlhf_edu.math.gae import gae_advantages
from marlhf_edu.math.grpo import group_relative_advantages
from marlhf_edu.math.kl import kl_penalty
from marlhf_edu.math.logprobs import logprobs_from_logits
from marlhf_edu.math.masked import last_valid_index, masked_mean, masked_whiten
from marlhf_edu.math.policy_gradient import expected_estimate
from marlhf_edu.math.ppo_objective import policy_loss, value_loss
from marlhf_edu.math.reward import pairwise_reward_loss
from marlhf_edu.math.scoring import position_ids_from_mask
from marlhf_edu.memory.plan import LLAMA_2_7B, MemorySettings, ModelShape, kv_cache_bytes, linear_weight_bytes
from marlhf_edu.ppo.trainer import response_mask_from_ids


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


@_withholds("marlhf_edu.math.masked.masked_mean")
def check_masked_mean(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(values, mask) -> scalar` against `masked_mean` (kept for the API; chapter 00 now grades `check_sequence_means`)."""
    fn = _learner(fn, check_masked_mean)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 7, generator=gen)

    def case(label, values, mask, atol=1e-6):
        def run():
            expected = masked_mean(values, mask)
            return _compare(label, _first_tensor(fn(values.clone(), mask.clone())), expected, atol, 1e-5)
        return label, run

    right = _padded_mask(gen, 4, 7)
    garbage = torch.where(right, x, torch.full_like(x, 1e6))
    nan_pad = torch.where(right, x, torch.full_like(x, float("nan")))
    return _run("check_masked_mean", seed=seed, cases=[
        case("all tokens valid", x, torch.ones(4, 7)),
        case("right padding (float mask)", x, right.float()),
        case("left padding (bool mask)", x, _padded_mask(gen, 4, 7, left=True)),
        case("padding holds 1e6", garbage, right.float()),
        case("padding holds NaN", nan_pad, right.float()),
        case("one valid token", x, torch.zeros(4, 7).index_put_((torch.tensor([2]), torch.tensor([3])), torch.tensor(1.0))),
    ])


@_withholds("marlhf_edu.math.masked.masked_mean")
def check_sequence_means(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(values, mask) -> (B,)`: each row's mean over its own valid tokens. Chapter 00's exercise.

    The reference is `masked_mean(values, mask, dim=1)`; rows of different
    lengths weigh their tokens differently, which a batch-wide mean hides.
    """
    fn = _learner(fn, check_sequence_means)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=gen)

    def case(label, values, mask):
        def run():
            expected = masked_mean(values, mask, dim=1)
            return _compare(label, _first_tensor(fn(values.clone(), mask.clone())), expected, 1e-6, 1e-5)
        return label, run

    right, left = _padded_mask(gen, 5, 8), _padded_mask(gen, 5, 8, left=True)
    one_each = torch.zeros(5, 8, dtype=torch.bool)
    one_each[torch.arange(5), torch.randint(0, 8, (5,), generator=gen)] = True
    return _run("check_sequence_means", seed=seed, cases=[
        case("all tokens valid", x, torch.ones(5, 8)),
        case("right padding (float mask)", x, right.float()),
        case("left padding (bool mask)", x, left),
        case("padding holds 1e6", torch.where(right, x, 1e6), right.float()),
        case("padding holds NaN", torch.where(left, x, float("nan")), left.long()),
        case("one valid token per row", x, one_each),
        case("a single row", x[:1], right[:1].float()),
    ])


@_withholds("marlhf_edu.math.reward.pairwise_reward_loss")
def check_pairwise_reward_loss(fn: Callable, seed: int = 1) -> CheckReport:
    """Check `fn(chosen, rejected, margin=None) -> scalar`. Chapter 01's exercise."""
    fn = _learner(fn, check_pairwise_reward_loss)
    gen = torch.Generator().manual_seed(seed)
    c, r = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    margin = torch.randint(0, 4, (16,), generator=gen).float()

    def case(label, chosen, rejected, m=None):
        def run():
            expected = pairwise_reward_loss(chosen, rejected, m)
            got = fn(chosen, rejected) if m is None else fn(chosen, rejected, m)
            return _compare(label, _first_tensor(got), expected, 1e-5, 1e-5)
        return label, run

    return _run("check_pairwise_reward_loss", seed=seed, cases=[
        case("random scores", c, r),
        case("equal scores give log 2", c, c.clone()),
        case("with margins", c, r, margin),
        case("rejected far above chosen (stability)", torch.full((4,), -200.0), torch.full((4,), 200.0)),
        case("chosen far above rejected", torch.full((4,), 200.0), torch.full((4,), -200.0)),
    ])


@_withholds("marlhf_edu.math.logprobs.logprobs_from_logits", "marlhf_edu.ppo.backends.response_logprobs")
def check_logprobs_from_logits(fn: Callable, seed: int = 2) -> CheckReport:
    """Check `fn(logits, labels) -> (B, T)` log-probs (the label's log-softmax)."""
    fn = _learner(fn, check_logprobs_from_logits)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 5), generator=gen)

    def case(label, z, y, atol=1e-5):
        def run():
            expected = logprobs_from_logits(z, y)
            return _compare(label, fn(z.clone(), y.clone()), expected, atol, 1e-5)
        return label, run

    return _run("check_logprobs_from_logits", seed=seed, cases=[
        case("random logits", logits, labels),
        case("large logits (overflow of a naive softmax)", logits * 1000.0, labels, atol=1e-2),
        case("one-token batch", logits[:1, :1], labels[:1, :1]),
        case("bf16 logits", logits.bfloat16(), labels, atol=2e-2),
    ])


@_withholds("marlhf_edu.math.logprobs.logprobs_from_logits", "marlhf_edu.ppo.backends.response_logprobs")
def check_tempered_logprobs(fn: Callable, seed: int = 2) -> CheckReport:
    r"""Check `fn(logits, labels, temperature) -> (B, T)`: log-probs under the sampling distribution.

    .. math:: \log\pi_\tau(y_t) = \log\operatorname{softmax}(z_t / \tau)_{y_t}

    The reference is computed in float64 from the same logits. Chapter 02's exercise.
    """
    fn = _learner(fn, check_tempered_logprobs)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)

    def case(label, z, y, tau, atol=1e-5):
        def run():
            expected = logprobs_from_logits(z.double() / tau, y)
            return _compare(label, fn(z.clone(), y.clone(), tau), expected, atol, 1e-5)
        return label, run

    return _run("check_tempered_logprobs", seed=seed, cases=[
        case("temperature 1", logits, labels, 1.0),
        case("temperature 0.7 (sharper)", logits, labels, 0.7),
        case("temperature 2 (flatter)", logits, labels, 2.0),
        case("large logits at temperature 0.5", logits * 300.0, labels, 0.5, atol=1e-2),
        case("one-token batch", logits[:1, :1], labels[:1, :1], 0.9),
        case("bf16 logits at temperature 0.8", logits.bfloat16(), labels, 0.8, atol=5e-2),
    ])


@_withholds("marlhf_edu.math.kl.kl_penalty", "marlhf_edu.math.kl._k3")
def check_kl_penalty(fn: Callable, kind: str = "k3", seed: int = 3) -> CheckReport:
    """Check a learner's per-token KL estimator `fn(logprobs, ref_logprobs)` of one `kind`.

    Chapter 03's exercise uses k3. Near d = 0 the tolerance is absolute 1e-8,
    which a naive fp32 `exp(d) - 1 - d` misses.
    """
    fn = _learner(fn, check_kl_penalty)
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 6, generator=gen) * 5
    ref = logp + torch.randn(4, 6, generator=gen)

    def case(label, a, b, atol=1e-6):
        def run():
            expected = kl_penalty(a, b, kind)
            got = fn(a, b)
            problem = _compare(label, got, expected, atol, 1e-4)
            if problem is None and kind == "k3" and bool((got < 0).any()):
                problem = f"{label}: k3 must never be negative, got {got.min().item():.3g}"
            return problem
        return label, run

    tiny = logp + torch.linspace(-1e-3, 1e-3, 24).view(4, 6)
    return _run(f"check_kl_penalty[{kind}]", seed=seed, cases=[
        case("random log-probs", logp, ref),
        case("policy equals reference", logp, logp.clone()),
        case("tiny differences (|d| <= 1e-3)", logp, tiny, atol=1e-8),
        case("large differences", logp, logp + 8.0),
    ])


def _gae_case(fn, label, values, rewards, mask, gamma, lam, expected_fn, extra=()):
    def run():
        adv, ret = expected_fn()
        got = fn(values.clone(), rewards.clone(), mask.clone(), *extra, gamma, lam)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return f"{label}: expected a tuple (advantages, returns)"
        return _compare(f"{label} (advantages)", got[0], adv, 1e-5, 1e-5) or \
            _compare(f"{label} (returns)", got[1], ret, 1e-5, 1e-5)
    return label, run


@_withholds("marlhf_edu.math.gae.gae_advantages", "marlhf_edu.math.gae.gae_advantages_reference")
def check_gae_advantages(fn: Callable, seed: int = 4) -> CheckReport:
    """Check `fn(values, rewards, mask, gamma, lam) -> (advantages, returns)` against `gae_advantages`."""
    fn = _learner(fn, check_gae_advantages)
    gen = torch.Generator().manual_seed(seed)
    v, r = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    right = _padded_mask(gen, 3, 8)

    def case(label, values, rewards, mask, gamma=1.0, lam=0.95):
        return _gae_case(fn, label, values, rewards, mask, gamma, lam,
                         lambda: gae_advantages(values, rewards, mask, gamma, lam))

    return _run("check_gae_advantages", seed=seed, cases=[
        case("no padding", v, r, torch.ones(3, 8)),
        case("right padding", v, r, right.float()),
        case("padding holds garbage", torch.where(right, v, 1e3), torch.where(right, r, -1e3), right.float()),
        case("lambda = 0 (TD residual)", v, r, right.float(), 0.9, 0.0),
        case("gamma = lambda = 1 (reward-to-go)", v, r, right.float(), 1.0, 1.0),
        case("gamma = 0.9, lambda = 0.8", v, r, right.float(), 0.9, 0.8),
    ])


def gae_with_bootstrap_reference(values, rewards, mask, bootstrap, gamma=1.0, lam=0.95):
    r"""GAE where a truncated row continues past its last real token with value `bootstrap` (B,).

    .. math:: \delta_{t_\text{last}} = r_{t_\text{last}} + \gamma\,b - V_{t_\text{last}}

    which is plain GAE with γ·b added to the last real reward. `bootstrap` is 0
    for rows that ended (EOS). The checker's reference for chapter 05's exercise.
    """
    m = mask.bool()
    extra = torch.zeros_like(rewards)
    extra[torch.arange(rewards.shape[0]), last_valid_index(m)] = gamma * bootstrap.to(rewards.dtype)
    return gae_advantages(values, torch.where(m, rewards, 0.0) + extra, mask, gamma, lam)


# the checker's own reference too: calling it from the answer would pass every case without the idea
@_withholds("marlhf_edu.math.gae.gae_advantages", "marlhf_edu.math.gae.gae_advantages_reference",
            "marlhf_edu.teaching.exercises.gae_with_bootstrap_reference")
def check_gae_bootstrap(fn: Callable, seed: int = 4) -> CheckReport:
    """Check `fn(values, rewards, mask, bootstrap, gamma, lam) -> (advantages, returns)`. Chapter 05's exercise.

    `bootstrap` (B,) is the value of the state after the last real token for
    responses cut off by the length limit, 0 for responses that ended with EOS.
    """
    fn = _learner(fn, check_gae_bootstrap)
    gen = torch.Generator().manual_seed(seed)
    v, r = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    right = _padded_mask(gen, 4, 8)
    boot = torch.randn(4, generator=gen)
    truncated = torch.tensor([True, False, True, False])

    def case(label, values, rewards, mask, b, gamma=1.0, lam=0.95):
        return _gae_case(fn, label, values, rewards, mask, gamma, lam,
                         lambda: gae_with_bootstrap_reference(values, rewards, mask, b, gamma, lam), extra=(b.clone(),))

    one = torch.zeros(4, 8).index_fill_(1, torch.tensor([0]), 1.0)
    return _run("check_gae_bootstrap", seed=seed, cases=[
        case("every row ended (bootstrap 0): plain GAE", v, r, right.float(), torch.zeros(4)),
        case("every row truncated, no padding", v, r, torch.ones(4, 8), boot),
        case("some rows truncated, right padding", v, r, right.float(), torch.where(truncated, boot, 0.0)),
        case("padding holds garbage", torch.where(right, v, 1e3), torch.where(right, r, -1e3), right.float(), boot),
        case("gamma = 0.9, lambda = 0 (TD residual)", v, r, right.float(), boot, 0.9, 0.0),
        case("gamma = 0.9, lambda = 0.8", v, r, right.float(), boot, 0.9, 0.8),
        case("one real token per row", v, r, one, boot, 0.95, 0.9),
    ])


def _loss_and_grad_case(fn, label, make_inputs, reference, wrt: int, atol_grad: float = 1e-6):
    """Compare a learner's loss and its gradient with respect to input `wrt` with the reference's."""
    def run():
        ref_inputs = make_inputs()
        ref_inputs[wrt].requires_grad_(True)
        expected = _first_tensor(reference(*ref_inputs))
        expected.backward()
        inputs = make_inputs()
        inputs[wrt].requires_grad_(True)
        got = _first_tensor(fn(*inputs))
        problem = _compare(f"{label} (loss)", got, expected, 1e-5, 1e-5)
        if problem:
            return problem
        got.backward()
        if inputs[wrt].grad is None:
            return f"{label}: the loss does not depend on its input {wrt} (no gradient)"
        return _compare(f"{label} (gradient)", inputs[wrt].grad, ref_inputs[wrt].grad, atol_grad, 1e-5)
    return label, run


@_withholds("marlhf_edu.math.policy_gradient.expected_estimate")
def check_expected_estimate(fn: Callable, seed: int = 0) -> CheckReport:
    r"""Check `fn(probs, arm_rewards, group_size, baseline) -> (A,)`: the exact mean of REINFORCE's estimate of
    ∇_θ J on a softmax bandit with fixed arm rewards, K = `group_size` samples per estimate, each sample's
    baseline given by `baseline` (None, or a function from the K rewards (K,) to K baselines).

    Chapter 04's exercise; compared with `marlhf_edu.math.policy_gradient.expected_estimate` (float64, exact sum
    over the A^K draws). The cases mix baselines that keep the estimate unbiased (none, a constant, the others'
    mean or median, another sample's reward) with ones that do not (the batch mean, the sample's own reward),
    so computing ∇J directly, or ignoring the baseline, fails. A non-zero `seed` draws other random cases.
    """
    fn = _learner(fn, check_expected_estimate)
    gen = torch.Generator().manual_seed(seed + 4)

    def others_mean(r):
        return (r.sum() - r) / (len(r) - 1)

    def others_median(r):
        return torch.stack([torch.cat([r[:i], r[i + 1:]]).median() for i in range(len(r))])

    def batch_mean(r):
        return r.mean().expand(len(r)).clone()

    def case(label, arms, K, baseline, shift=0.0):
        probs = torch.softmax(torch.randn(arms, generator=gen, dtype=torch.float64), -1)
        rewards = torch.rand(arms, generator=gen, dtype=torch.float64) + shift

        def run():
            expected = expected_estimate(probs, rewards, K, baseline)
            got = fn(probs.clone(), rewards.clone(), K, baseline)
            return _compare(label, torch.as_tensor(got), expected, 1e-6, 1e-5)
        return label, run

    cases = [
        case("no baseline, 3 arms, 2 samples", 3, 2, None),
        case("one sample per estimate (K = 1), no baseline", 4, 1, None),
        case("a constant baseline (0.5), 3 arms, 3 samples", 3, 3, lambda r: torch.full_like(r, 0.5)),
        case("leave-one-out baseline, 4 arms, 3 samples", 4, 3, others_mean),
        case("the batch mean (contains the sample's own reward), 3 arms, 4 samples", 3, 4, batch_mean),
        case("the batch mean with rewards shifted by 10", 3, 2, batch_mean, shift=10.0),
        case("the sample's own reward as its baseline", 3, 3, lambda r: r.clone()),
        case("the next sample's reward as baseline (another sample: unbiased)", 3, 3, lambda r: r.roll(-1)),
        case("the others' median, 6 arms, 4 samples", 6, 4, others_median),
    ]
    if seed:
        for i in range(3):
            arms, K = int(torch.randint(2, 6, (1,), generator=gen)), int(torch.randint(2, 5, (1,), generator=gen))
            rule = (others_mean, batch_mean, others_median)[i]
            cases.append(case(f"random: {arms} arms, {K} samples, {rule.__name__.replace('_', ' ')}", arms, K, rule,
                              shift=float(torch.randn(1, generator=gen)) * 5))
    return _run("check_expected_estimate", seed=seed, cases=cases)


@_withholds("marlhf_edu.math.ppo_objective.policy_loss", "marlhf_edu.math.ppo_objective.ppo_loss")
def check_policy_loss(fn: Callable, seed: int = 5) -> CheckReport:
    """Check `fn(logprobs, old_logprobs, advantages, mask, cliprange) -> loss` (or `(loss, stats)`).

    Compares the loss value and its gradient with respect to `logprobs`, so a
    min/max mix-up that happens to give the right value still fails.
    Chapter 06's first exercise.
    """
    fn = _learner(fn, check_policy_loss)
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen) * 3
    adv = torch.randn(4, 6, generator=gen)
    mask = _padded_mask(gen, 4, 6).float()

    def case(label, shift):
        return _loss_and_grad_case(fn, label, lambda: [(old + shift).clone(), old.clone(), adv.clone(), mask.clone(), 0.2],
                                   policy_loss, wrt=0)

    return _run("check_policy_loss", seed=seed, cases=[
        case("ratio exactly 1", torch.zeros(4, 6)),
        case("small policy change", 0.05 * torch.randn(4, 6, generator=gen)),
        case("large policy change (clip active)", 0.6 * torch.randn(4, 6, generator=gen)),
        case("garbage in padding", torch.where(mask.bool(), 0.1, 50.0)),
    ])


@_withholds("marlhf_edu.math.ppo_objective.value_loss", "marlhf_edu.math.ppo_objective.ppo_loss")
def check_value_loss(fn: Callable, seed: int = 6) -> CheckReport:
    r"""Check `fn(values, old_values, returns, mask, cliprange_value) -> loss` (or `(loss, stats)`).

    .. math:: L_V = \tfrac12\operatorname{mean}_m \max\big((V - R)^2, (\operatorname{clip}(V, V^{old} \pm \epsilon_v) - R)^2\big)

    Value and gradient with respect to `values` are compared, on moves inside
    and outside the clip range, towards and away from the returns. Chapter 06's second exercise.
    """
    fn = _learner(fn, check_value_loss)
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=gen)
    ret = old + torch.randn(4, 6, generator=gen)
    mask = _padded_mask(gen, 4, 6).float()

    def case(label, new, eps=0.2):
        return _loss_and_grad_case(fn, label, lambda: [new.clone(), old.clone(), ret.clone(), mask.clone(), eps],
                                   value_loss, wrt=0)

    towards = old + 0.5 * (ret - old)
    return _run("check_value_loss", seed=seed, cases=[
        case("values equal old values", old.clone()),
        case("small moves (inside the clip range)", old + 0.05 * torch.randn(4, 6, generator=gen)),
        case("large moves towards the returns (clip active)", towards),
        case("large moves away from the returns", old - 0.8 * (ret - old)),
        case("garbage in padding", torch.where(mask.bool(), towards, 1e3)),
        case("cliprange 0.5", towards, 0.5),
    ])


@_withholds("marlhf_edu.data.formats.pku_saferlhf_to_preference")
def check_pku_preference(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(row) -> (chosen, rejected, margin)` on PKU-SafeRLHF rows. Chapter 07's exercise.

    Covers the four safety cases (only 0 safe, only 1 safe, both safe, both
    unsafe) with `better_response_id` and `safer_response_id` pointing both ways,
    against `pku_saferlhf_to_preference` (responses compared as raw text).
    `seed` changes the response texts.
    """
    fn = _learner(fn, check_pku_preference)
    words = ["zero", "one"] if seed == 0 else [f"reply {seed}-{i}" for i in (0, 1)]

    def case(safe0, safe1, better, safer):
        row = {"prompt": "q", "response_0": f"answer {words[0]}", "response_1": f"answer {words[1]}",
               "is_response_0_safe": safe0, "is_response_1_safe": safe1,
               "better_response_id": better, "safer_response_id": safer}
        label = f"safe=({safe0}, {safe1}), better={better}, safer={safer}"

        def run():
            ref = pku_saferlhf_to_preference(row)
            names = {format_completion(row[k]): row[k] for k in ("response_0", "response_1")}
            want = (names[ref["chosen"]], names[ref["rejected"]], ref["margin"])
            got = fn(dict(row))
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                return f"{label}: expected a tuple (chosen, rejected, margin)"
            if (got[0], got[1]) != want[:2]:
                return f"{label}: chose {got[0]!r} over {got[1]!r}, expected {want[0]!r} over {want[1]!r}"
            if float(got[2]) != want[2]:
                return f"{label}: margin {got[2]}, expected {want[2]}"
            return None
        return label, run

    return _run("check_pku_preference", seed=seed,
                cases=[case(s0, s1, b, s) for s0, s1 in ((True, False), (False, True), (True, True), (False, False))
                       for b, s in ((0, 1), (1, 0))])


@_withholds("marlhf_edu.math.scoring.position_ids_from_mask")
def check_position_ids(fn: Callable, seed: int = 7) -> CheckReport:
    """Check `fn(attention_mask) -> position_ids` (B, T): real tokens numbered 0, 1, … whatever the padding.

    Only real tokens are compared (what a model puts at padded positions is
    irrelevant). Chapter 08's exercise.
    """
    fn = _learner(fn, check_position_ids)
    gen = torch.Generator().manual_seed(seed)

    def case(label, mask):
        def run():
            expected = position_ids_from_mask(mask)
            got = fn(mask.clone())
            if not isinstance(got, torch.Tensor) or got.shape != mask.shape:
                return f"{label}: expected a tensor of shape {tuple(mask.shape)}"
            real = mask.bool()
            return _compare(label + " (real tokens)", got[real].double(), expected[real].double(), 0, 0)
        return label, run

    return _run("check_position_ids", seed=seed, cases=[
        case("no padding", torch.ones(3, 6, dtype=torch.long)),
        case("right padding", _padded_mask(gen, 4, 7).long()),
        case("left padding", _padded_mask(gen, 4, 7, left=True).long()),
        case("single real token", torch.tensor([[0, 0, 0, 1], [1, 0, 0, 0]])),
    ])


@_withholds("marlhf_edu.ppo.trainer.response_mask_from_ids")
def check_response_mask(fn: Callable, seed: int = 8) -> CheckReport:
    """Check `fn(response_ids, eos_token_id) -> mask` (B, R): tokens up to and including the first EOS.

    Chapter 09's exercise; compared with `marlhf_edu.ppo.response_mask_from_ids`.
    """
    fn = _learner(fn, check_response_mask)
    eos, pad = 2, 3

    def case(label, ids):
        def run():
            expected = response_mask_from_ids(ids, eos)
            got = fn(ids.clone(), eos)
            if not isinstance(got, torch.Tensor) or got.shape != ids.shape:
                return f"{label}: expected a tensor of shape {tuple(ids.shape)}"
            return _compare(label, got.double(), expected.double(), 0, 0)
        return label, run

    gen = torch.Generator().manual_seed(seed)
    random_ids = torch.randint(0, 12, (6, 9), generator=gen)
    return _run("check_response_mask", seed=seed, cases=[
        case("EOS then padding", torch.tensor([[5, 6, eos, pad, pad], [5, 6, 7, eos, pad]])),
        case("no EOS (hit the length limit)", torch.tensor([[5, 6, 7, 8, 9]])),
        case("EOS as the first token", torch.tensor([[eos, pad, pad, pad]])),
        case("a second EOS after the first", torch.tensor([[5, eos, 7, eos, 8]])),
        case("pad sampled before EOS", torch.tensor([[5, pad, 6, eos, pad]])),
        case("random ids", random_ids),
    ])


@_withholds("marlhf_edu.memory.plan.linear_weight_bytes")
def check_nf4_bytes(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(d_in, d_out, double_quant) -> int`: the bytes bitsandbytes holds for one NF4 linear weight.

    Chapter 10's exercise; compared with `marlhf_edu.memory.plan.linear_weight_bytes`
    (blocks of 64, the 16-entry fp32 NF4 code table; with double quantization the
    absmax as bytes, an fp32 offset, fp32 scales per 256 absmax values and a
    256-entry fp32 code table), which itself matches measured storages exactly.
    A non-zero `seed` adds three random shapes.
    """
    fn = _learner(fn, check_nf4_bytes)

    def case(label, d_in, d_out, double_quant):
        def run():
            expected = linear_weight_bytes(d_in, d_out, MemorySettings(load_in_4bit=True, double_quant=double_quant))
            got = fn(d_in, d_out, double_quant)
            if not isinstance(got, int) or got != expected:
                return f"{label}: got {got!r}, expected {expected} bytes"
            return None
        return label, run

    cases = [
        case("tiny q_proj 192×192, plain", 192, 192, False),
        case("tiny q_proj 192×192, double quant", 192, 192, True),
        case("Llama-2-7B up_proj 4096×11008, plain", 4096, 11008, False),
        case("Llama-2-7B up_proj 4096×11008, double quant", 4096, 11008, True),
        case("a partial last block (10×10), double quant", 10, 10, True),
        case("an odd number of weights (7×9): one byte holds the last nibble", 7, 9, False),
        case("more than 256 blocks but not a multiple (4096×5), double quant", 4096, 5, True),
    ]
    if seed:
        gen = torch.Generator().manual_seed(seed)
        for i in range(3):
            d_in, d_out = (int(d) for d in torch.randint(1, 5000, (2,), generator=gen))
            cases.append(case(f"random shape {d_in}×{d_out}, {'double quant' if i % 2 else 'plain'}", d_in, d_out, bool(i % 2)))
    return _run("check_nf4_bytes", seed=seed, cases=cases)


@_withholds("marlhf_edu.math.evaluation.cluster_bootstrap_interval", "marlhf_edu.math.evaluation.paired_bootstrap_difference",
            "marlhf_edu.math.evaluation._percentile_bootstrap", "marlhf_edu.math.evaluation.mean_interval",
            "marlhf_edu.math.evaluation.difference_interval", "marlhf_edu.math.evaluation.paired_t_interval")
def check_rate_interval(fn: Callable, seed: int = 0) -> CheckReport:
    r"""Check `fn(groups) -> (low, high)`: a 95 % interval for a policy's rate from its answers grouped by
    prompt (`groups[i]`: the 0/1 outcomes of prompt i's answers), valid when a prompt's answers are correlated.

    Chapter 11's exercise. Any method is accepted that keeps the promise for the rate p of the population the
    prompts are drawn from: each case simulates 300 evaluations of P fresh prompts with m answers each, prompt
    i's own rate drawn from a beta distribution with mean p and intraclass correlation ρ (ρ = 0: every prompt at
    p), and requires that the interval contain p in at least 88 % of them (correct 95 % methods, the t-interval
    over the prompts' observed rates, a bootstrap over prompts or Wilson with the design effect, cover 92 % or
    more in every case; 300 evaluations give ±1.3 points of noise) and that it be on average at most 1.5 times
    as wide as the t-interval over the prompts' observed rates (an interval cannot buy its coverage by being
    useless). Counting every answer as independent (`wilson_interval` on all answers) covers about 54-84 %
    where the design effect 1 + (m − 1)ρ is 2 or more. Every interval routine of the package that reaches the
    answer (bootstrap, t, difference) is withheld. A non-zero `seed` simulates other evaluations.
    """
    import math as _math
    import random

    fn = _learner(fn, check_rate_interval)
    rng = random.Random(seed + 11)  # pure Python: the same evaluations on any CPU

    def evaluations(P, m, p, rho, n=300):
        out = []
        for _ in range(n):
            # beta(p c, (1 − p) c) with c = 1/ρ − 1 has mean p and gives a prompt's answers an ICC of ρ
            rates = [rng.betavariate(p * (1 / rho - 1), (1 - p) * (1 / rho - 1)) if rho > 0 else p for _ in range(P)]
            out.append([[int(rng.random() < q) for _ in range(m)] for q in rates])
        return out

    def case(label, P, m, p, rho):
        def run():
            data = evaluations(P, m, p, rho)
            reference = sum(hi - lo for _, lo, hi in (mean_interval([sum(g) / m for g in d]) for d in data)) / len(data)
            covered, width = 0, 0.0
            for d in data:
                got = fn([list(g) for g in d])
                if not (isinstance(got, (tuple, list)) and len(got) == 2):
                    return f"{label}: expected (low, high), got {got!r}"
                lo, hi = (float(x) for x in got)
                if _math.isnan(lo) or _math.isnan(hi) or lo > hi:
                    return f"{label}: ({lo}, {hi}) is not an interval"
                covered += lo <= p <= hi
                width += (hi - lo) / len(data)
            coverage = covered / len(data)
            if coverage < 0.88:
                return (f"{label}: the interval contained the true rate {p} in {coverage:.0%} of {len(data)} "
                        "simulated evaluations, not about 95 %")
            if width > 1.5 * reference:
                return (f"{label}: covers {coverage:.0%}, but is on average {width:.3f} wide, more than 1.5 times "
                        f"the t-interval over the prompts' rates ({reference:.3f})")
            return None
        return label, run

    cases = [
        case("independent answers (ρ = 0): 30 prompts × 4 answers at rate 0.5", 30, 4, 0.5, 0.0),
        case("correlated answers (ρ = 0.6): 30 prompts × 4 at rate 0.5", 30, 4, 0.5, 0.6),
        case("strongly correlated (ρ = 0.8): 40 prompts × 8 at rate 0.3", 40, 8, 0.3, 0.8),
        case("a rare outcome (rate 0.1, ρ = 0.4): 60 prompts × 4", 60, 4, 0.1, 0.4),
        case("two answers per prompt (ρ = 0.3): 30 prompts at rate 0.7", 30, 2, 0.7, 0.3),
    ]
    if seed:
        P, m = rng.randint(30, 60), rng.randint(2, 8)
        p, rho = round(rng.uniform(0.25, 0.75), 2), round(rng.uniform(0.2, 0.8), 2)
        cases.append(case(f"random: {P} prompts × {m} at rate {p}, ρ = {rho}", P, m, p, rho))
    return _run("check_rate_interval", seed=seed, cases=cases, passing="keep the 95 % promise at a useful width")


@_withholds("marlhf_edu.math.grpo.group_relative_advantages", "marlhf_edu.math.policy_gradient.leave_one_out_baseline")
def check_group_relative_advantages(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(rewards, group_size) -> (B,)`: GRPO's advantages, each reward standardised within its group.

    Chapter 12's exercise; compared with `marlhf_edu.math.grpo.group_relative_advantages` (scale='group',
    eps=1e-4): groups are `group_size` consecutive rewards (trl's layout), the standard deviation has Bessel's
    correction, and a group whose rewards are all equal gives zeros, not NaN. A non-zero `seed` draws other
    random cases.
    """
    fn = _learner(fn, check_group_relative_advantages)
    gen = torch.Generator().manual_seed(seed + 12)

    def case(label, rewards, group_size):
        def run():
            expected = group_relative_advantages(rewards, group_size)
            return _compare(label, fn(rewards.clone(), group_size), expected, 1e-5, 1e-4)
        return label, run

    return _run("check_group_relative_advantages", seed=seed, cases=[
        case("one group of 4, by hand", torch.tensor([1.0, 0.0, 0.0, 0.0]), 4),
        case("8 answers in 2 groups of 4: groups are consecutive answers", torch.tensor([1.0, 2, 3, 4, 10, 20, 30, 40]), 4),
        case("groups of 2", torch.randn(6, generator=gen), 2),
        case("a group whose answers all scored the same (no signal, not NaN)", torch.tensor([3.0, 3, 3, 3, 0, 1, 0, 1]), 4),
        case("64 answers, groups of 8 (the book's GRPO batch)", 3 * torch.randn(64, generator=gen) + 1, 8),
        case("0/1 judge rewards, groups of 8", (torch.rand(32, generator=gen) < 0.7).float(), 8),
    ])


@_withholds("marlhf_edu.math.dpo.ipo_preferred_margin", "marlhf_edu.math.dpo.ipo_loss", "marlhf_edu.math.dpo.margin_trajectory")
def check_ipo_margin(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(p, beta) -> margin`: where IPO's loss settles the log-ratio margin h(y, y') of a pair that the
    data state as (y, y') a share p of the time and reversed the rest.

    Chapter 12's exercise; compared with `marlhf_edu.math.dpo.ipo_preferred_margin`, and with what training finds:
    free logits (`margin_trajectory`) trained by IPO's loss on a batch that holds the pair in both orders in
    the proportions p and 1 − p. `ipo_loss` and `margin_trajectory` are withheld too, so the answer cannot be
    simulated with the package's loss or trainer. A non-zero `seed` draws other random cases.
    """
    fn = _learner(fn, check_ipo_margin)

    def case(label, p, beta):
        def run():
            expected = ipo_preferred_margin(torch.as_tensor(p, dtype=torch.float64), beta)
            return _compare(label, torch.as_tensor(fn(p, beta), dtype=torch.float64), expected, 1e-6, 1e-6)
        return label, run

    def trained(label, forward: int, backward: int, beta: float):
        def mixed(pc, pr, rc, rr, b):  # the pair `forward` times as (y, y'), `backward` times as (y', y)
            rows = [(pc, pr, rc, rr)] * forward + [(pr, pc, rr, rc)] * backward
            return ipo_loss(*(torch.cat(column) for column in zip(*rows)), b)

        def run():
            settled = margin_trajectory(mixed, beta, steps=300)[-1]
            got = float(fn(forward / (forward + backward), beta))
            if abs(got - settled) > 1e-3:
                return f"{label}: got {got:.4g}, training settles at {settled:.4g}"
            return None
        return label, run

    cases = [
        case("a certain preference (p = 1), beta = 0.1", 1.0, 0.1),
        case("no preference (p = 0.5)", 0.5, 0.1),
        case("preferred 3 times in 4, beta = 0.1", 0.75, 0.1),
        case("preferred 1 time in 5: the margin points the other way", 0.2, 0.1),
        case("beta = 0.5, p = 0.9", 0.9, 0.5),
        case("a tensor of probabilities", torch.tensor([0.0, 0.3, 0.5, 0.8, 1.0], dtype=torch.float64), 0.2),
        trained("what training finds: 3 times one way, once the other, beta = 0.2", 3, 1, 0.2),
    ]
    if seed:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(3):
            p, beta = round(float(torch.rand(1, generator=gen)), 3), round(0.05 + float(torch.rand(1, generator=gen)), 3)
            cases.append(case(f"random: p = {p}, beta = {beta}", p, beta))
        forward, backward = (int(x) for x in torch.randint(1, 5, (2,), generator=gen))
        cases.append(trained(f"what training finds: {forward} times one way, {backward} the other, beta = 0.3",
                             forward, backward, 0.3))
    return _run("check_ipo_margin", seed=seed, cases=cases)


@_withholds("marlhf_edu.loading.gguf_blocks.dequantize_q4_1", "gguf.quants.Q4_1.dequantize_blocks")
def check_dequantize_q4_1(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(raw) -> np.ndarray`: float32 weights of GGUF Q4_1 data (uint8, shape (..., n_blocks · 20)).

    Chapter 13's exercise; compared exactly with `marlhf_edu.loading.gguf_blocks.dequantize_q4_1`, itself equal to the
    `gguf` package's dequantizer (d and m are fp16 at bytes 0–3; byte j of the 16 code bytes holds weight j in its
    low nibble and weight j + 16 in its high one). Blocks come from `gguf`'s own quantizer. A non-zero `seed`
    draws other random weights. `gguf`'s Q4_1 dequantizer is withheld with ours (`Q4_1.dequantize_blocks`, which
    `gguf.quants.dequantize` and `Q4_1.dequantize` call).
    """
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    fn = _learner(fn, check_dequantize_q4_1)
    rng = np.random.default_rng(seed + 13)

    def case(label, weights):
        raw = quantize(np.asarray(weights, dtype=np.float32), GGMLQuantizationType.Q4_1)

        def run():
            expected = dequantize_q4_1(raw)
            got = fn(raw.copy())
            if not isinstance(got, np.ndarray):
                return f"{label}: expected a numpy array, got {type(got).__name__}"
            if got.shape != expected.shape:
                return f"{label}: shape {got.shape}, expected {expected.shape}"
            bad = np.flatnonzero(~np.isclose(got.astype(np.float64), expected, rtol=0, atol=1e-6))
            if bad.size:
                i = int(bad[0])
                return f"{label}: weight {i} (block {i // 32}, position {i % 32}) is {got.flat[i]!r}, expected {expected.flat[i]!r}"
            return None
        return label, run

    ramp = np.linspace(-1.0, 2.0, 32)
    return _run("check_dequantize_q4_1", seed=seed, cases=[
        case("one block, a ramp from -1 to 2 (low nibbles first, then high)", ramp),
        case("one block, the ramp reversed", ramp[::-1].copy()),
        case("one block, all weights equal (d = 0)", np.full(32, 0.25)),
        case("one block, only negative weights (m < 0)", -np.abs(rng.standard_normal(32)) - 1),
        case("a row of 4 blocks", rng.standard_normal(128)),
        case("a 3 × 64 matrix (each row its own blocks)", rng.standard_normal((3, 64))),
        case("a 576 × 96 matrix, SmolLM2's row width scale", 0.05 * rng.standard_normal((576, 96))),
    ])


@_withholds("marlhf_edu.math.masked.masked_whiten", "marlhf_edu.math.masked.masked_var")
def check_global_whiten(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(values, masks) -> list[Tensor]`: advantage whitening over a batch split across ranks.

    Chapter 14's exercise. `values[r]` and `masks[r]` are rank r's (b_r, R) advantages and response mask; the
    answer is one (b_r, R) tensor per rank, equal to `marlhf_edu.math.masked.masked_whiten` of the whole batch (the
    ranks' rows concatenated) cut back into the ranks' rows: the mean over every selected token of every rank,
    the unbiased variance with the global count, zeros where the mask is 0. A non-zero `seed` draws other cases.
    """
    fn = _learner(fn, check_global_whiten)
    gen = torch.Generator().manual_seed(seed + 14)

    def case(label, values, masks):
        def run():
            got = fn([v.clone() for v in values], [m.clone() for m in masks])
            if not isinstance(got, (list, tuple)) or len(got) != len(values):
                return f"{label}: expected a list of {len(values)} tensors (one per rank), got {type(got).__name__}"
            expected = masked_whiten(torch.cat(values), torch.cat(masks)).split([len(v) for v in values])
            for rank, (g, e) in enumerate(zip(got, expected)):
                problem = _compare(f"{label}, rank {rank}", g, e, 1e-5, 1e-5)
                if problem:
                    return problem
            return None
        return label, run

    easy, hard = torch.tensor([[2.0, 3.0, 4.0]]), torch.tensor([[-4.0, -3.0, -2.0]])
    full = torch.ones(1, 3, dtype=torch.bool)
    return _run("check_global_whiten", seed=seed, cases=[
        case("one rank: plain whitening", [torch.tensor([[1.0, 2.0, 3.0, 6.0]])], [torch.ones(1, 4, dtype=torch.bool)]),
        case("2 ranks, one easy prompt and one hard: the ranks' means differ", [easy, hard], [full, full]),
        case("2 ranks with 3 rows and 1 row: weigh each rank by its tokens",
             [torch.randn(3, 5, generator=gen) + 1, torch.randn(1, 5, generator=gen) - 2],
             [torch.ones(3, 5, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool)]),
        case("2 ranks, equal rows, different response lengths (count tokens, not rows)",
             [torch.randn(4, 6, generator=gen) * 2, torch.randn(4, 6, generator=gen) + 3],
             [_padded_mask(gen, 4, 6), torch.tensor([[1, 0, 0, 0, 0, 0]] * 4, dtype=torch.bool)]),
        case("4 ranks of 4 responses of up to 8 tokens, padding holds garbage",
             [torch.randn(4, 8, generator=gen) * (r + 1) + r for r in range(4)],
             [_padded_mask(gen, 4, 8) for _ in range(4)]),
    ])


@_withholds("marlhf_edu.memory.plan.kv_cache_bytes")
def check_kv_cache_bytes(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(shape, batch, tokens, bytes_per_value) -> int`: the bytes of a KV cache.

    Chapter 15's exercise; compared exactly with `marlhf_edu.memory.plan.kv_cache_bytes` on Llama-2-7B, a model
    with grouped-query attention (8 key/value heads to 32 query heads, as Llama-3-8B), SmolLM2-135M's shape (3 to
    9) and random shapes. A non-zero `seed` draws other random shapes.
    """
    import random

    fn = _learner(fn, check_kv_cache_bytes)
    rng = random.Random(seed + 15)
    gqa = ModelShape("gqa-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                     num_heads=32, num_kv_heads=8)
    smol = ModelShape("smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, tie_word_embeddings=True)

    def case(label, shape, batch, tokens, nbytes):
        def run():
            got, expected = fn(shape, batch, tokens, nbytes), kv_cache_bytes(shape, batch, tokens, nbytes)
            if not isinstance(got, (int, float)) or got != expected:
                return f"{label}: got {got!r}, expected {expected:,} bytes"
            return None
        return label, run

    heads = rng.choice([4, 8, 16])
    odd = ModelShape("random", vocab_size=1000, hidden_size=heads * 64, intermediate_size=512,
                     num_layers=rng.randint(2, 12), num_heads=heads, num_kv_heads=heads // rng.choice([1, 2, 4]),
                     head_dim=rng.choice([0, 32, 96]))
    return _run("check_kv_cache_bytes", seed=seed, cases=[
        case("Llama-2-7B, one sequence of one token, bf16", LLAMA_2_7B, 1, 1, 2),
        case("Llama-2-7B, the 7B recipe's sampling batch: 16 x (64 + 256) tokens, bf16", LLAMA_2_7B, 16, 320, 2),
        case("grouped-query attention: 8 key/value heads for 32 query heads", gqa, 8, 1024, 2),
        case("SmolLM2-135M (3 key/value heads for 9), fp32", smol, 16, 112, 4),
        case("a random shape (its head width may differ from hidden / heads)", odd, rng.randint(1, 9), rng.randint(1, 99), 2),
    ])
