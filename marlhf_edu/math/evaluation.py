"""Evaluation done properly: intervals on rates, seeds and prompts, and how many prompts a comparison needs.

A refusal rate measured on 17 prompts, each asked 4 times, from one training
run, carries three kinds of noise: which answers were sampled, which prompts
happened to be held out, and which seed trained the policy. Each function here
puts a number on one of them. Plain Python (no SciPy): the t quantiles come
from the incomplete beta function, and the tests check them against published tables.

Taught in chapter 11 (`chapters/11_overoptimisation_and_evaluation.md`).
"""

from __future__ import annotations

import math
import random
from statistics import NormalDist
from typing import Sequence


def _check_confidence(fn: str, confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"{fn}: `confidence` must lie in (0, 1), got {confidence!r}")


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    r"""Wilson score interval for a proportion from `successes` out of `n` independent trials.

    .. math:: \frac{\hat p + \frac{z^2}{2n} \pm z\sqrt{\frac{\hat p(1-\hat p)}{n} + \frac{z^2}{4n^2}}}{1 + z^2/n}

    Unlike p̂ ± z·√(p̂(1−p̂)/n) it never leaves [0, 1] and does not collapse to
    a zero-width interval at 0 or n successes. It assumes independent trials:
    four samples of one prompt are not four independent trials (see
    `cluster_bootstrap_interval`).

    Taught in chapter 11.
    """
    fn = "wilson_interval"
    _check_confidence(fn, confidence)
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"{fn}: need n >= 1 and 0 <= successes <= n, got successes={successes}, n={n}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at 0 or n successes the bound is exactly 0 or 1; computed, it is off by rounding
    return (0.0 if successes == 0 else centre - half), (1.0 if successes == n else centre + half)


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point; use the symmetry
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),          # even step
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # odd step
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * h / a


def student_t_cdf(x: float, df: float) -> float:
    r"""P(T ≤ x) for Student's t with `df` degrees of freedom: 1 − ½·I_{ν/(ν+x²)}(ν/2, ½) for x ≥ 0.

    Taught in chapter 11.
    """
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + x * x))
    return 1.0 - tail if x >= 0 else tail


def student_t_quantile(q: float, df: float) -> float:
    r"""The q-quantile of Student's t with `df` degrees of freedom (df may be fractional, as Welch's is).

    Inverts `student_t_cdf` (the regularized incomplete beta function) by
    bisection, to about 1e-12.

    Taught in chapter 11.
    """
    fn = "student_t_quantile"
    if not 0 < q < 1:
        raise ValueError(f"{fn}: `q` must lie in (0, 1), got {q!r}")
    if not df > 0:
        raise ValueError(f"{fn}: `df` must be > 0, got {df!r}")
    if q < 0.5:
        return -student_t_quantile(1 - q, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < q:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    r"""(mean, low, high): the t-interval x̄ ± t_{(1+c)/2, n−1} · s / √n for independent runs (seeds).

    With 5 seeds t is 2.78, not 1.96: the interval is 40 % wider than a normal
    one, because s itself is estimated from five numbers.

    Taught in chapter 11.
    """
    fn = "mean_interval"
    _check_confidence(fn, confidence)
    xs = [float(v) for v in values]
    if len(xs) < 2:
        raise ValueError(f"{fn}: need at least 2 values (seeds) for an interval, got {len(xs)}")
    n, mean = len(xs), sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = student_t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def difference_interval(a: Sequence[float], b: Sequence[float],
                        confidence: float = 0.95) -> tuple[float, float, float]:
    r"""(mean(a) − mean(b), low, high): Welch's interval for two sets of independent runs.

    .. math:: \bar a - \bar b \pm t_{(1+c)/2,\,\nu}\sqrt{s_a^2/n_a + s_b^2/n_b},\quad
              \nu = \frac{(s_a^2/n_a + s_b^2/n_b)^2}{\frac{(s_a^2/n_a)^2}{n_a-1} + \frac{(s_b^2/n_b)^2}{n_b-1}}

    An interval that contains 0 means these runs cannot tell the two methods apart.

    Taught in chapter 11.
    """
    fn = "difference_interval"
    _check_confidence(fn, confidence)
    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"{fn}: need at least 2 runs on each side, got {len(a)} and {len(b)}")
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    if va + vb == 0:
        return ma - mb, ma - mb, ma - mb
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = student_t_quantile(0.5 + confidence / 2, df) * math.sqrt(va + vb)
    return ma - mb, ma - mb - half, ma - mb + half


def paired_t_interval(a: Sequence[float], b: Sequence[float],
                      confidence: float = 0.95) -> tuple[float, float, float, float]:
    r"""(mean(a − b), low, high, t): the t-interval of paired differences, runs paired by seed.

    .. math:: d_s = a_s - b_s,\qquad \bar d \pm t_{(1+c)/2,\,n-1}\,\frac{s_d}{\sqrt n},
              \qquad t = \frac{\bar d}{s_d/\sqrt n}

    Use it when run s of method a and run s of method b share what makes runs differ (seed, data order,
    sampling seed): the variation they share cancels in d_s, and the interval can exclude 0 where Welch's
    `difference_interval`, which treats the two sets as independent, cannot. t is ±inf when every
    difference is the same non-zero number, 0 when they are all 0.

    Taught in chapter 11; chapter 12 pairs its methods' runs with it.
    """
    fn = "paired_t_interval"
    _check_confidence(fn, confidence)
    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) != len(b):
        raise ValueError(f"{fn}: {len(a)} runs of a and {len(b)} of b; pair them run by run (seed by seed)")
    mean, lo, hi = mean_interval([x - y for x, y in zip(a, b)], confidence)
    half = hi - mean
    if half == 0:
        return mean, lo, hi, 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean, lo, hi, mean / (half / student_t_quantile(0.5 + confidence / 2, len(a) - 1))


def mcnemar_exact(a_right: Sequence[bool], b_right: Sequence[bool]) -> tuple[int, int, float]:
    r"""(a only, b only, two-sided p): McNemar's exact test of two classifiers on the *same* items.

    Items both get right or both get wrong say nothing about which is better; of the n = n_a + n_b
    discordant items, under "equally good" each is a's with probability 1/2, so

    .. math:: p = \min\Big(1,\ 2\sum_{k=0}^{\min(n_a, n_b)} \binom{n}{k} 2^{-n}\Big).

    Two accuracies with overlapping intervals can still differ clearly when their errors fall on the same items.

    Taught in chapter 12.
    """
    fn = "mcnemar_exact"
    a, b = [bool(x) for x in a_right], [bool(x) for x in b_right]
    if len(a) != len(b) or not a:
        raise ValueError(f"{fn}: need the same non-zero number of items on both sides, got {len(a)} and {len(b)}")
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n = only_a + only_b
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2 ** n
    return only_a, only_b, min(1.0, 2 * tail)


def _check_groups(fn: str, groups: Sequence[Sequence[float]]) -> list[list[float]]:
    rows = [[float(x) for x in g] for g in groups]
    if len(rows) < 2:
        raise ValueError(f"{fn}: need outcomes of at least 2 prompts, got {len(rows)}")
    for i, g in enumerate(rows):
        if not g:
            raise ValueError(f"{fn}: prompt {i} has no outcomes")
    return rows


def cluster_bootstrap_interval(groups: Sequence[Sequence[float]], confidence: float = 0.95,
                               n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    r"""(mean, low, high) of the mean outcome, resampling *prompts* with replacement (percentile bootstrap).

    `groups`: one list of outcomes per prompt (for example its 4 sampled answers,
    1 = refused). Each bootstrap replicate draws P prompts with replacement and
    keeps all the answers of each, so answers to one prompt travel together: the
    interval reflects how much the rate depends on which prompts were asked,
    which independent-trial intervals (`wilson_interval` on all answers) ignore.

    Taught in chapter 11.
    """
    fn = "cluster_bootstrap_interval"
    _check_confidence(fn, confidence)
    rows = _check_groups(fn, groups)
    sums, counts = [sum(g) for g in rows], [len(g) for g in rows]
    lo, hi = _percentile_bootstrap(fn, len(rows), lambda picks: sum(sums[i] for i in picks)
                                   / sum(counts[i] for i in picks), confidence, n_boot, seed)
    return sum(sums) / sum(counts), lo, hi


def paired_bootstrap_difference(before: Sequence[Sequence[float]], after: Sequence[Sequence[float]],
                                confidence: float = 0.95, n_boot: int = 2000,
                                seed: int = 0) -> tuple[float, float, float]:
    r"""(rate after − rate before, low, high) when the *same* prompts were asked before and after training.

    `before[i]` and `after[i]` are the outcomes of prompt i (as `group_outcomes` returns them for each side,
    in the same prompt order). Each replicate draws P prompt indices with replacement and recomputes both
    rates on the same draw,

    .. math:: \hat d^{*} = \frac{\sum_{i\in S^*} a_i}{\sum_{i\in S^*} n^a_i} - \frac{\sum_{i\in S^*} b_i}{\sum_{i\in S^*} n^b_i},

    so which prompts happened to be asked cancels out of the difference: a prompt that many answers refuse
    before and after moves both rates together. Two separate `cluster_bootstrap_interval`\ s ignore that
    pairing and overlap even when the paired interval excludes 0.

    Taught in chapter 12; chapter 13 uses it on the real model.
    """
    fn = "paired_bootstrap_difference"
    _check_confidence(fn, confidence)
    b_rows, a_rows = _check_groups(fn, before), _check_groups(fn, after)
    if len(b_rows) != len(a_rows):
        raise ValueError(f"{fn}: before has {len(b_rows)} prompts and after {len(a_rows)}; pair them prompt by prompt")
    bs, bn = [sum(g) for g in b_rows], [len(g) for g in b_rows]
    as_, an = [sum(g) for g in a_rows], [len(g) for g in a_rows]
    lo, hi = _percentile_bootstrap(fn, len(b_rows), lambda picks: sum(as_[i] for i in picks) / sum(an[i] for i in picks)
                                   - sum(bs[i] for i in picks) / sum(bn[i] for i in picks), confidence, n_boot, seed)
    return sum(as_) / sum(an) - sum(bs) / sum(bn), lo, hi


def _percentile_bootstrap(fn: str, n_prompts: int, statistic, confidence: float, n_boot: int,
                          seed: int) -> tuple[float, float]:
    """(low, high): percentiles of `statistic(picks)` over `n_boot` draws of `n_prompts` prompt indices with
    replacement. The two intervals above differ only in the statistic; the resampling is this one."""
    if n_boot < 100:
        raise ValueError(f"{fn}: n_boot must be >= 100 for a percentile interval, got {n_boot}")
    rng = random.Random(seed)
    stats = sorted(statistic([rng.randrange(n_prompts) for _ in range(n_prompts)]) for _ in range(n_boot))
    tail = (1 - confidence) / 2
    return stats[int(math.floor(tail * (n_boot - 1)))], stats[int(math.ceil((1 - tail) * (n_boot - 1)))]


def intraclass_correlation(groups: Sequence[Sequence[float]], clip: bool = True) -> float:
    r"""ICC(1) of outcomes grouped by prompt, all groups of the same size m (one-way ANOVA estimator).

    .. math:: \rho = \frac{MS_B - MS_W}{MS_B + (m-1)\,MS_W}

    ρ = 0: a prompt's answers are as different as answers to different prompts,
    so repeats count as fresh samples. ρ = 1: a prompt always gets the same
    verdict, so asking it again adds nothing. Clipped to [0, 1] (`clip=False`
    returns the raw estimate, which can fall below 0 by chance: average raw
    values, since a mean of clipped ones is biased up); 0 when every outcome is
    equal (nothing to explain).

    Taught in chapter 11.
    """
    fn = "intraclass_correlation"
    rows = _check_groups(fn, groups)
    m = len(rows[0])
    if m < 2 or any(len(g) != m for g in rows):
        raise ValueError(f"{fn}: every prompt needs the same number (>= 2) of outcomes, "
                         f"got sizes {sorted({len(g) for g in rows})}")
    k = len(rows)
    means = [sum(g) / m for g in rows]
    grand = sum(means) / k
    ms_between = m * sum((x - grand) ** 2 for x in means) / (k - 1)
    ms_within = sum((x - mu) ** 2 for g, mu in zip(rows, means) for x in g) / (k * (m - 1))
    if ms_between + (m - 1) * ms_within == 0:
        return 0.0
    raw = (ms_between - ms_within) / (ms_between + (m - 1) * ms_within)
    return min(1.0, max(0.0, raw)) if clip else raw


def prompts_needed(p1: float, p2: float, alpha: float = 0.05, power: float = 0.8,
                   repeats: int = 1, icc: float = 0.0) -> int:
    r"""Prompts per run for a two-sided test at level `alpha` to detect rates p1 ≠ p2 with probability `power`.

    Independent answers per run (two-proportion z-test):

    .. math:: n = \frac{\big(z_{1-\alpha/2}\sqrt{2\bar p(1-\bar p)} + z_{\mathrm{power}}\sqrt{p_1(1-p_1) + p_2(1-p_2)}\big)^2}{(p_1-p_2)^2}

    Asking each prompt `repeats` = m times gives m answers, but correlated ones:
    with intraclass correlation ρ, m answers are worth m / (1 + (m−1)ρ)
    independent ones (the design effect), so the prompts needed are
    ⌈n (1 + (m−1)ρ) / m⌉. At ρ = 1 repeats do not help at all.

    Taught in chapter 11.
    """
    fn = "prompts_needed"
    for name, p in (("p1", p1), ("p2", p2)):
        if not 0 < p < 1:
            raise ValueError(f"{fn}: `{name}` must lie strictly in (0, 1), got {p!r}")
    if p1 == p2:
        raise ValueError(f"{fn}: p1 == p2 = {p1}: no number of prompts tells equal rates apart")
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"{fn}: `alpha` and `power` must lie in (0, 1), got {alpha!r}, {power!r}")
    if repeats < 1 or not 0 <= icc <= 1:
        raise ValueError(f"{fn}: need repeats >= 1 and 0 <= icc <= 1, got {repeats!r}, {icc!r}")
    z_a, z_b = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    p_bar = (p1 + p2) / 2
    n = (z_a * math.sqrt(2 * p_bar * (1 - p_bar)) + z_b * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2))) ** 2 / (p1 - p2) ** 2
    return math.ceil(n * (1 + (repeats - 1) * icc) / repeats)


def group_outcomes(samples: Sequence[dict], harmful: bool, verdict: str) -> list[list[int]]:
    """Per-prompt 0/1 outcomes from `sample_toy`'s records: for each prompt of the kind (`harmful` or not),
    in order of first appearance, whether each of its answers got `verdict` ('refusal', 'correct', ...).

    Taught in chapter 11.
    """
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        missing = {"question", "kind", "verdict"} - set(s)
        if missing:
            raise KeyError(f"group_outcomes: sample {i} lacks {sorted(missing)}")
        if (s["kind"] == "harmful") == harmful:
            groups.setdefault(s["question"], []).append(int(s["verdict"] == verdict))
    if not groups:
        raise ValueError(f"group_outcomes: no {'harmful' if harmful else 'benign'} samples")
    return list(groups.values())


def before_after_change(samples: Sequence[dict], harmful: bool, verdict: str, confidence: float = 0.95,
                        n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """`paired_bootstrap_difference` of the judged answers of one run (`sample_toy`'s records, each with a
    'when' of 'before' or 'after'): how much the rate of `verdict` among the prompts of the kind moved, with
    the prompts paired by their question. Every prompt must be judged on both sides.

    Taught in chapter 13.
    """
    fn = "before_after_change"
    sides = {}
    for when in ("before", "after"):
        chosen = [s for s in samples if s.get("when") == when]
        if not chosen:
            raise ValueError(f"{fn}: no samples with when={when!r}")
        questions = list(dict.fromkeys(s["question"] for s in chosen if (s["kind"] == "harmful") == harmful))
        sides[when] = dict(zip(questions, group_outcomes(chosen, harmful=harmful, verdict=verdict)))
    only = set(sides["before"]).symmetric_difference(sides["after"])
    if only:
        q = sorted(only)[0]
        side = "before" if q in sides["before"] else "after"
        raise ValueError(f"{fn}: {len(only)} question(s) judged on one side only, e.g. {q[:60]!r} ({side} only)")
    order = list(sides["before"])
    return paired_bootstrap_difference([sides["before"][q] for q in order], [sides["after"][q] for q in order],
                                       confidence=confidence, n_boot=n_boot, seed=seed)





def best_of_n_kl(n: int) -> float:
    r"""The KL divergence from the policy to its best-of-n, in nats, as Stiennon et al. (2020, appendix G.3) give it:

    .. math:: \mathrm{KL}(\pi_{\text{bo}n} \,\|\, \pi) \le \log n - \frac{n - 1}{n}

    equal for a policy that never samples the same answer twice; for one that repeats answers it is an upper
    bound (Beirami et al. 2024). 0 at n = 1; it grows like log n: 1.8 nats at n = 16, and the 4.5 nats of
    chapter 13's PPO run would take n of about 250."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"best_of_n_kl: n must be an int >= 1, got {n!r}")
    return math.log(n) - (n - 1) / n


def best_of_n_picks(proxy: Sequence[Sequence[float]], n: int) -> list[int]:
    """Best-of-n by `proxy` (`Q` prompts × at least n scores): the index of each prompt's highest-scored answer
    among its first n, the first on a tie."""
    return [max(range(n), key=lambda j, p=p: (p[j], -j)) for p in proxy]


def best_of_n_table(proxy: Sequence[Sequence[float]], gold: Sequence[Sequence[float]],
                    ns: Sequence[int] = (1, 2, 4, 8, 16)) -> list[dict]:
    """What best-of-n selection by a proxy (a reward model) buys in gold (a judge the proxy learned from), per n.

    `proxy`, `gold`: `Q` prompts × `N` answers each, the same answers in the same order. For each n in `ns`
    (at most N), best-of-n takes each prompt's first n answers and keeps the one the proxy scores highest
    (`best_of_n_picks`: the first on a tie; the worst likewise the first of the lowest). Returns one dict per
    n: `n`, `kl_nats` (`best_of_n_kl`), the mean over prompts of the gold of the proxy's pick (`gold_pick`), of
    a random pick (`gold_random`, the mean of the n), of the gold's own pick (`gold_best`, the ceiling) and of
    the proxy's worst (`gold_worst`); `gain` (`gold_pick - gold_random`) with `gain_std_error` (over prompts); `proxy_pick`
    and `proxy_random`, the proxy's own scores of the same picks. A proxy that learned the gold has `gold_pick`
    rising with n towards `gold_best`; one that did not stays at `gold_random`.

    Taught in chapter 13.
    """
    fn = "best_of_n_table"
    q = len(proxy)
    if q == 0 or q != len(gold):
        raise ValueError(f"{fn}: proxy has {q} prompts and gold {len(gold)}; need the same number, at least 1")
    width = len(proxy[0])
    if any(len(p) != width for p in proxy) or any(len(g) != width for g in gold):
        raise ValueError(f"{fn}: every prompt needs the same number of answers in proxy and gold ({width})")
    bad = [n for n in ns if not (isinstance(n, int) and 1 <= n <= width)]
    if bad:
        raise ValueError(f"{fn}: each n must lie in [1, {width}] (the answers per prompt), got {bad}")
    rows = []
    for n in ns:
        picks = best_of_n_picks(proxy, n)
        worst = [min(range(n), key=lambda j, p=p: (p[j], j)) for p in proxy]
        gains = [g[i] - sum(g[:n]) / n for g, i in zip(gold, picks)]
        mean_gain = sum(gains) / q
        se = math.sqrt(sum((x - mean_gain) ** 2 for x in gains) / (q - 1) / q) if q > 1 else float("nan")
        rows.append({"n": n, "kl_nats": best_of_n_kl(n),
                     "gold_pick": sum(g[i] for g, i in zip(gold, picks)) / q,
                     "gold_random": sum(sum(g[:n]) / n for g in gold) / q,
                     "gold_best": sum(max(g[:n]) for g in gold) / q,
                     "gold_worst": sum(g[i] for g, i in zip(gold, worst)) / q,
                     "gain": mean_gain, "gain_std_error": se,
                     "proxy_pick": sum(p[i] for p, i in zip(proxy, picks)) / q,
                     "proxy_random": sum(sum(p[:n]) / n for p in proxy) / q})
    return rows


#: Gao, Schulman and Hilton's (2023) two forms of the gold gain against d = √KL: d·(α − β·log d) for RL and
#: d·(α − β·d) for best-of-n. Each is linear in (α, β): the second feature, d·log d or d², is subtracted.
GAO_FORMS = ("rl", "best_of_n")


class GaoFit:
    """A fitted Gao et al. curve: `form` ('rl' or 'best_of_n'), `alpha`, `beta`, the `residuals` (gain − fit, in
    the order given) and `r_squared`. Call it on d = √KL for the fitted gain; `peak` is (d*, gain at d*): for
    RL d* = exp(α/β − 1) and the gain β·d*; for best-of-n d* = α/(2β) and the gain α²/(4β). None when β ≤ 0
    (no peak: the fitted gain never turns down)."""

    def __init__(self, form: str, alpha: float, beta: float, residuals: list[float], r_squared: float):
        self.form, self.alpha, self.beta = form, alpha, beta
        self.residuals, self.r_squared = residuals, r_squared

    def __call__(self, d: float) -> float:
        return self.alpha * d - self.beta * _gao_feature(self.form, d)  # the fit's own features, 0 at d = 0

    @property
    def peak(self) -> tuple[float, float] | None:
        if self.beta <= 0:
            return None
        d = math.exp(self.alpha / self.beta - 1) if self.form == "rl" else self.alpha / (2 * self.beta)
        return d, self(d)

    def __repr__(self) -> str:
        return f"GaoFit({self.form!r}, alpha={self.alpha:.4g}, beta={self.beta:.4g}, r_squared={self.r_squared:.3f})"


def _gao_feature(form: str, d: float) -> float:
    """The term β multiplies (negated): d·log d (0 at d = 0, its limit) for RL, d² for best-of-n."""
    if form == "rl":
        return d * math.log(d) if d > 0 else 0.0
    return d * d


def fit_gao(d: Sequence[float], gain: Sequence[float], form: str = "rl") -> GaoFit:
    r"""Least-squares fit of Gao, Schulman and Hilton's (2023) form to gold gains `gain` at distances `d` = √KL
    (nats), one point each (any number of runs and evaluations pooled):

    .. math:: R_{\text{RL}}(d) = d\,(\alpha - \beta \log d), \qquad R_{\text{bo}n}(d) = d\,(\alpha - \beta d)

    Both are linear in (α, β), so the fit solves the 2 × 2 normal equations exactly. No intercept: at d = 0
    the policy is the one the gains are measured from. Needs at least two points with d > 0 that are not all
    the same d; raises ValueError on lengths that differ, a negative or non-finite d or gain, or an unknown
    `form`. The points of one run are one trajectory sampled several times, not independent draws, so the fit
    carries no interval.

    Taught in chapter 11; chapter 13 fits both forms on the real model.
    """
    fn = "fit_gao"
    if form not in GAO_FORMS:
        raise ValueError(f"{fn}: form must be one of {GAO_FORMS}, got {form!r}")
    ds, ys = [float(x) for x in d], [float(y) for y in gain]
    if len(ds) != len(ys):
        raise ValueError(f"{fn}: {len(ds)} distances and {len(ys)} gains; give one gain per distance")
    bad = [i for i, (x, y) in enumerate(zip(ds, ys)) if not (math.isfinite(x) and math.isfinite(y)) or x < 0]
    if bad:
        raise ValueError(f"{fn}: point {bad[0]} is (d={ds[bad[0]]}, gain={ys[bad[0]]}); d must be finite and "
                         ">= 0 (it is √KL), the gain finite")
    a = ds  # the feature α multiplies
    b = [-_gao_feature(form, x) for x in ds]  # the feature β multiplies
    saa, sbb, sab = sum(x * x for x in a), sum(x * x for x in b), sum(x * y for x, y in zip(a, b))
    say, sby = sum(x * y for x, y in zip(a, ys)), sum(x * y for x, y in zip(b, ys))
    det = saa * sbb - sab * sab
    if len(ds) < 2 or det <= 1e-12 * max(saa * sbb, 1e-300):
        raise ValueError(f"{fn}: the points do not fix two parameters (need at least two distinct d > 0, "
                         f"got {sorted(set(ds))[:5]})")
    alpha, beta = (say * sbb - sby * sab) / det, (saa * sby - sab * say) / det
    residuals = [y - (alpha * x + beta * z) for x, z, y in zip(a, b, ys)]
    mean = sum(ys) / len(ys)
    total = sum((y - mean) ** 2 for y in ys)
    r_squared = 1 - sum(r * r for r in residuals) / total if total > 0 else float("nan")
    return GaoFit(form, alpha, beta, residuals, r_squared)
