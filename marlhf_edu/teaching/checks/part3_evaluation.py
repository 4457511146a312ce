"""Checkers for the exercises of the book's third part, Evaluation (chapters 11–12).

- chapter 11: `check_rate_interval`, a 95 % interval for a rate from answers grouped by prompt
- chapter 12: `check_group_relative_advantages`, GRPO's advantages, standardised within each group; and
  `check_ipo_margin`, where IPO's loss settles the margin of a pair
"""

from __future__ import annotations

from typing import Callable

import torch

from marlhf_edu.math.dpo import ipo_loss, ipo_preferred_margin, margin_trajectory
from marlhf_edu.math.evaluation import mean_interval
from marlhf_edu.math.grpo import group_relative_advantages
from marlhf_edu.teaching.grading import CheckReport, _compare, _learner, _run, _withholds


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
    over the prompts' observed rates, a bootstrap over prompts or Wilson with the design effect, cover about
    90 % or more: the t-interval covered 90-97 % in the fixed cases of seeds 0, 191 and 192; 300 evaluations
    measure a coverage with a standard error of 1.3-1.7 points) and that it be on average at most 1.5 times
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
        forward, offset = (int(x) for x in torch.randint(1, 5, (2,), generator=gen))
        backward = (forward + offset % 3) % 4 + 1  # 1-4 and never equal to forward: not the p = 0.5 case again
        cases.append(trained(f"what training finds: {forward} times one way, {backward} the other, beta = 0.3",
                             forward, backward, 0.3))
    return _run("check_ipo_margin", seed=seed, cases=cases)
