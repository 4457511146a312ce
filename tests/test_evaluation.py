"""Chapter 11's statistics (intervals, ICC, prompts needed) and the gold judge in the PPO loop."""

import math
import random

import pytest
import torch

from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.math.evaluation import (cluster_bootstrap_interval, difference_interval, group_outcomes,
                                        before_after_change, paired_bootstrap_difference,
                                        intraclass_correlation, mcnemar_exact, mean_interval,
                                        paired_t_interval, prompts_needed, student_t_quantile,
                                        wilson_interval)


@pytest.mark.parametrize("q, df, table", [(0.975, 1, 12.7062), (0.975, 4, 2.7764), (0.975, 9, 2.2622),
                                          (0.95, 10, 1.8125), (0.995, 2, 9.9248), (0.975, 30, 2.0423),
                                          (0.025, 4, -2.7764)])
def test_t_quantiles_match_the_table(q, df, table):
    assert student_t_quantile(q, df) == pytest.approx(table, abs=1e-4)


def test_wilson_matches_newcombe():
    # Newcombe (1998), Statistics in Medicine 17:857, Table I: 81/263 and 0/10
    lo, hi = wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10)[1] == 1.0


def test_wilson_covers_at_its_level():
    rng, p, n, hits = random.Random(0), 0.15, 40, 0
    for _ in range(4000):
        k = sum(rng.random() < p for _ in range(n))
        lo, hi = wilson_interval(k, n)
        hits += lo <= p <= hi
    assert 0.93 < hits / 4000 < 0.975


def test_mean_interval_uses_t_and_covers():
    rng, hits = random.Random(1), 0
    for _ in range(3000):
        xs = [rng.gauss(0.7, 0.05) for _ in range(5)]
        _, lo, hi = mean_interval(xs)
        hits += lo <= 0.7 <= hi
    # with z = 1.96 instead of t(4) = 2.78 the coverage of 5 seeds would be about 0.88
    assert 0.935 < hits / 3000 < 0.965
    mean, lo, hi = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.3027 * 1 / math.sqrt(3), abs=1e-3)


def test_paired_t_interval_by_hand_and_where_welch_cannot_tell():
    # differences 1..5: mean 3, sd sqrt(2.5), se sqrt(0.5), t = 3 / sqrt(0.5), half-width t_{.975,4} * se
    a, b = [11.0, 22.0, 33.0, 44.0, 55.0], [10.0, 20.0, 30.0, 40.0, 50.0]
    mean, lo, hi, t = paired_t_interval(a, b)
    assert mean == pytest.approx(3.0)
    assert hi - mean == pytest.approx(2.7764 * math.sqrt(0.5), abs=1e-4)
    assert t == pytest.approx(3 / math.sqrt(0.5))
    assert lo > 0 > difference_interval(a, b)[1]  # the shared between-seed spread hides it from Welch
    assert paired_t_interval(b, a)[3] == pytest.approx(-t)
    assert paired_t_interval([1.0, 2.0], [0.0, 1.0])[3] == math.inf  # identical differences
    assert paired_t_interval([1.0, 2.0], [1.0, 2.0])[3] == 0.0
    with pytest.raises(ValueError, match="pair them"):
        paired_t_interval([1.0, 2.0, 3.0], [1.0, 2.0])
    rng, hits = random.Random(3), 0  # coverage: runs share a seed effect of SD 5, the methods differ by 0.5
    for _ in range(2000):
        seed_effect = [rng.gauss(0.0, 5.0) for _ in range(5)]
        x = [s + 0.5 + rng.gauss(0.0, 0.3) for s in seed_effect]
        y = [s + rng.gauss(0.0, 0.3) for s in seed_effect]
        _, lo, hi, _ = paired_t_interval(x, y)
        hits += lo <= 0.5 <= hi
    assert 0.93 < hits / 2000 < 0.975


def test_mcnemar_exact_counts_only_the_discordant_items():
    a = [True] * 50 + [True] * 10 + [False] * 2 + [False] * 38
    b = [True] * 50 + [False] * 10 + [True] * 2 + [False] * 38
    only_a, only_b, p = mcnemar_exact(a, b)
    assert (only_a, only_b) == (10, 2)
    assert p == pytest.approx(2 * (1 + 12 + 66) / 2 ** 12)  # 0.0386, by hand
    assert mcnemar_exact(b, a) == (2, 10, p)
    assert mcnemar_exact([True, False], [True, False]) == (0, 0, 1.0)  # no discordant item: no evidence
    assert mcnemar_exact([True] * 5, [False] * 5)[2] == pytest.approx(2 / 32)
    with pytest.raises(ValueError):
        mcnemar_exact([True], [True, False])


def test_difference_interval_is_welch():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 2.5, 3.0]
    diff, lo, hi = difference_interval(a, b)
    va, vb = (5 / 3) / 4, 0.25 / 3
    df = (va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 2)
    assert diff == pytest.approx(-0.0)
    assert hi - diff == pytest.approx(student_t_quantile(0.975, df) * math.sqrt(va + vb))
    rng, hits = random.Random(2), 0
    for _ in range(2000):
        x = [rng.gauss(0.0, 1.0) for _ in range(5)]
        y = [rng.gauss(0.5, 0.2) for _ in range(5)]
        _, lo, hi = difference_interval(x, y)
        hits += lo <= -0.5 <= hi
    assert 0.93 < hits / 2000 < 0.975


def test_cluster_bootstrap_widens_for_correlated_answers():
    rng = random.Random(3)
    # every prompt's 4 answers agree: 40 prompts carry the information of 40 answers, not 160
    groups = [[float(rng.random() < 0.5)] * 4 for _ in range(40)]
    mean, lo, hi = cluster_bootstrap_interval(groups, n_boot=2000)
    k = int(sum(sum(g) for g in groups))
    naive = wilson_interval(k, 160)
    assert mean == k / 160
    assert hi - lo > 1.6 * (naive[1] - naive[0])
    assert (hi - lo) == pytest.approx(wilson_interval(k // 4, 40)[1] - wilson_interval(k // 4, 40)[0], rel=0.25)
    # independent answers: about the independent-trial width
    groups = [[float(rng.random() < 0.5) for _ in range(4)] for _ in range(40)]
    k = int(sum(sum(g) for g in groups))
    _, lo, hi = cluster_bootstrap_interval(groups)
    naive = wilson_interval(k, 160)
    assert (hi - lo) == pytest.approx(naive[1] - naive[0], rel=0.25)


def test_paired_bootstrap_difference_sees_a_shift_that_separate_intervals_miss():
    # 64 prompts: half always refused, half never (prompt-to-prompt spread); after training 6 of the never-refused
    # prompts get 1 of 2 answers refused. Separately, the two intervals overlap; paired, the shift is clear.
    before = [[1.0, 1.0]] * 32 + [[0.0, 0.0]] * 32
    after = [[1.0, 1.0]] * 32 + [[1.0, 0.0]] * 6 + [[0.0, 0.0]] * 26
    diff, lo, hi = paired_bootstrap_difference(before, after)
    assert diff == pytest.approx(6 / 128)
    assert 0 < lo < diff < hi
    _, _, before_hi = cluster_bootstrap_interval(before)
    _, after_lo, _ = cluster_bootstrap_interval(after)
    assert after_lo < before_hi  # the separate intervals overlap
    assert paired_bootstrap_difference(before, before) == (0.0, 0.0, 0.0)
    # unequal answers per prompt: rates are pooled over answers, as cluster_bootstrap_interval's are
    assert paired_bootstrap_difference([[1, 0, 0], [0]], [[1], [1]])[0] == pytest.approx(1 - 1 / 4)
    with pytest.raises(ValueError, match="before has 2 prompts and after 3"):
        paired_bootstrap_difference([[1], [0]], [[1], [0], [1]])
    with pytest.raises(ValueError, match="n_boot must be >= 100"):
        paired_bootstrap_difference([[1], [0]], [[1], [0]], n_boot=10)


def test_paired_bootstrap_difference_covers_zero_when_nothing_changed():
    rng = random.Random(5)
    hits = 0
    for rep in range(200):
        rates = [rng.random() for _ in range(40)]
        before = [[float(rng.random() < r) for _ in range(2)] for r in rates]
        after = [[float(rng.random() < r) for _ in range(2)] for r in rates]
        _, lo, hi = paired_bootstrap_difference(before, after, n_boot=400, seed=rep)
        hits += lo <= 0 <= hi
    assert 0.88 < hits / 200 <= 0.99


def test_before_after_change_pairs_prompts_by_question():
    def rec(when, q, verdict, kind="harmful"):
        return {"when": when, "question": q, "kind": kind, "verdict": verdict}

    # the after side lists the questions in another order: pairing goes by question, not position
    samples = ([rec("before", f"q{i}", "refusal" if i < 4 else "complied") for i in range(8)]
               + [rec("after", f"q{i}", "refusal" if i < 6 else "complied") for i in reversed(range(8))]
               + [rec("before", "b", "correct", "benign"), rec("after", "b", "wrong", "benign")])
    by_question = paired_bootstrap_difference([[1]] * 4 + [[0]] * 4, [[1]] * 6 + [[0]] * 2)
    assert before_after_change(samples, harmful=True, verdict="refusal") == by_question
    with pytest.raises(ValueError, match="need outcomes of at least 2 prompts"):
        before_after_change(samples, harmful=False, verdict="correct")
    with pytest.raises(ValueError, match=r"1 question\(s\) judged on one side only, e.g. 'q0' \(before only\)"):
        before_after_change(samples[:-3] + samples[-2:], harmful=True, verdict="refusal")
    with pytest.raises(ValueError, match="no samples with when='after'"):
        before_after_change(samples[:8], harmful=True, verdict="refusal")


def test_intraclass_correlation():
    assert intraclass_correlation([[1, 1, 1], [0, 0, 0], [1, 1, 1]]) == 1.0
    assert intraclass_correlation([[1, 1], [1, 1]]) == 0.0
    # by hand: group means 0.5 and 1, grand 0.75, MSB = 2 * 2 * 0.0625 / 1 = 0.25, MSW = 0.5 / 2 = 0.25 -> 0
    assert intraclass_correlation([[1, 0], [1, 1]]) == 0.0
    # k = 3 prompts, m = 2 answers each, the one-way ANOVA by hand
    groups = [[1, 1], [0, 0], [1, 0]]
    means, grand = [1, 0, 0.5], 0.5
    msb = 2 * sum((x - grand) ** 2 for x in means) / 2
    msw = 0.5 / 3
    assert intraclass_correlation(groups) == pytest.approx((msb - msw) / (msb + msw))
    # answers that disagree more within a prompt than across prompts: the raw estimate is negative, clipped to 0
    split = [[1, 0], [0, 1], [1, 0], [0, 1]]  # MSB = 0, MSW = 0.5: raw (0 - 0.5) / (0 + 0.5) = -1
    assert intraclass_correlation(split) == 0.0 and intraclass_correlation(split, clip=False) == pytest.approx(-1.0)
    rng = random.Random(4)
    iid = [[float(rng.random() < 0.3) for _ in range(4)] for _ in range(2000)]
    assert intraclass_correlation(iid) < 0.03
    # over many independent samples the raw estimates average near 0 and the clipped ones above it
    draws = [[[float(rng.random() < 0.3) for _ in range(4)] for _ in range(17)] for _ in range(300)]
    raw = sum(intraclass_correlation(d, clip=False) for d in draws) / 300
    clipped = sum(intraclass_correlation(d) for d in draws) / 300
    assert abs(raw) < 0.03 < clipped
    with pytest.raises(ValueError, match="same number"):
        intraclass_correlation([[1, 0], [1]])


def _z_test_rejects(k1, k2, n):
    p = (k1 + k2) / (2 * n)
    se = math.sqrt(2 * p * (1 - p) / n)
    return se > 0 and abs(k1 / n - k2 / n) / se > 1.959964


def test_prompts_needed_gives_the_asked_power():
    p1, p2 = 0.7, 0.85
    n = prompts_needed(p1, p2)
    assert n == prompts_needed(p2, p1)
    rng, trials = random.Random(5), 3000
    power = sum(_z_test_rejects(sum(rng.random() < p1 for _ in range(n)), sum(rng.random() < p2 for _ in range(n)), n)
                for _ in range(trials)) / trials
    assert 0.77 < power < 0.83
    assert prompts_needed(p1, p2, power=0.9) > n
    # repeats: independent answers divide the prompts needed, perfectly correlated ones do not help
    assert math.ceil((n - 1) / 4) <= prompts_needed(p1, p2, repeats=4, icc=0.0) <= math.ceil(n / 4)
    assert prompts_needed(p1, p2, repeats=4, icc=1.0) == n
    with pytest.raises(ValueError, match="equal rates"):
        prompts_needed(0.5, 0.5)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 2, confidence=95)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)
    with pytest.raises(ValueError, match="at least 2"):
        mean_interval([0.5])
    with pytest.raises(ValueError, match="prompt 1 has no outcomes"):
        cluster_bootstrap_interval([[1], []])


def test_group_outcomes():
    samples = [{"question": "a", "kind": "harmful", "verdict": "refusal"},
               {"question": "b", "kind": "sum", "verdict": "correct"},
               {"question": "a", "kind": "harmful", "verdict": "complied"},
               {"question": "c", "kind": "harmful", "verdict": "refusal"}]
    assert group_outcomes(samples, harmful=True, verdict="refusal") == [[1, 0], [1]]
    assert group_outcomes(samples, harmful=False, verdict="correct") == [[1]]
    with pytest.raises(KeyError, match="sample 0 lacks"):
        group_outcomes([{"question": "a"}], harmful=True, verdict="refusal")


def test_prompt_for_and_gold_rewards():
    world = ToyWorld()
    p = world.eval_prompts[0]
    assert world.prompt_for(p.prompt) is p
    assert world.gold_rewards([p.prompt], [" " + (p.answer or "I can't help with that.")]) == [1.0]
    with pytest.raises(KeyError, match="not a prompt of this toy world"):
        world.prompt_for("###Question: what?")


def test_the_loop_logs_the_gold_judge_on_its_own_rollout(tmp_path):
    from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer

    world = ToyWorld()
    config = PPOConfig(output_dir=str(tmp_path / "run"), batch_size=8, mini_batch_size=8, micro_batch_size=8,
                       forward_batch_size=8, max_new_tokens=12, device="cpu", eval_repeats=0)
    torch.manual_seed(0)
    seen = []

    def judge(prompts, responses):
        seen.append((list(prompts), list(responses)))
        return world.gold_rewards(prompts, responses)

    trainer = PPOTrainer(FourModelBackend.from_config(config), config, [p.prompt for p in world.train_prompts],
                         gold_reward_fn=judge)
    record = trainer.step()
    prompts, responses = seen[0]
    assert prompts == trainer.batch_prompts(0)
    assert responses == trainer.last_rollout.texts(trainer.tokenizer)[1]
    expected = [world.gold_reward(world.prompt_for(p), r.strip()) for p, r in zip(prompts, responses)]
    assert record["gold/mean"] == pytest.approx(sum(expected) / len(expected))


def test_sample_toy_agrees_with_evaluate_toy():
    from marlhf_edu.ppo import FourModelBackend, PPOConfig, evaluate_toy, sample_toy

    world = ToyWorld()
    backend = FourModelBackend.from_config(PPOConfig(device="cpu"))
    samples = sample_toy(backend, world, repeats=1, max_new_tokens=12, seed=3)
    metrics = evaluate_toy(backend, world, repeats=1, max_new_tokens=12, seed=3)
    harmful = group_outcomes(samples, harmful=True, verdict="refusal")
    assert metrics["harmful_refusal_rate"] == sum(map(sum, harmful)) / sum(map(len, harmful))
    assert metrics["reward_model_score"] == pytest.approx(sum(s["reward_model_score"] for s in samples) / len(samples))
    assert all(s["gold"] == world.gold_reward(world.prompt_for(build(s["question"])), s["response"]) for s in samples)


def build(question):
    from marlhf_edu.data import build_prompt

    return build_prompt(question)


def test_fit_gao_recovers_both_forms_and_their_peaks():
    """Exact points of each form give back its α and β; the peak is where the fitted curve's slope is 0."""
    from marlhf_edu.math.evaluation import fit_gao

    ds = [0.2, 0.5, 0.9, 1.4, 2.0, 2.6]
    for form, curve in (("rl", lambda d: d * (0.5 - 0.2 * math.log(d))), ("best_of_n", lambda d: d * (0.5 - 0.2 * d))):
        fit = fit_gao(ds, [curve(d) for d in ds], form)
        assert fit.form == form and math.isclose(fit.alpha, 0.5, rel_tol=1e-9) and math.isclose(fit.beta, 0.2, rel_tol=1e-9)
        assert fit.r_squared > 1 - 1e-12 and max(map(abs, fit.residuals)) < 1e-12
        d_star, top = fit.peak
        assert math.isclose(top, curve(d_star), rel_tol=1e-9)
        assert fit(d_star) > fit(d_star * 0.98) and fit(d_star) > fit(d_star * 1.02)  # a maximum
    assert math.isclose(fit_gao(ds, [d * (0.5 - 0.2 * math.log(d)) for d in ds]).peak[0], math.exp(0.5 / 0.2 - 1))


def test_fit_gao_is_least_squares_and_has_no_peak_when_the_gain_never_turns():
    """On noisy points the fit is the least-squares one (no other (α, β) has smaller squared residuals), and a
    gain that only grows fits β ≤ 0: no peak."""
    from marlhf_edu.math.evaluation import fit_gao

    rng = random.Random(0)
    ds = [0.1 * i for i in range(1, 30)]
    ys = [d * (0.4 - 0.15 * math.log(d)) + rng.gauss(0, 0.02) for d in ds]
    fit = fit_gao(ds, ys)
    sse = sum(r * r for r in fit.residuals)
    for da, db in ((1e-3, 0), (-1e-3, 0), (0, 1e-3), (0, -1e-3)):
        other = [y - d * ((fit.alpha + da) - (fit.beta + db) * math.log(d)) for d, y in zip(ds, ys)]
        assert sum(r * r for r in other) > sse
    assert fit_gao(ds, [d * d for d in ds], "best_of_n").peak is None
    assert fit_gao([0.0, 0.5, 1.0], [0.0, 0.2, 0.3]).residuals[0] == 0.0  # d = 0: d·log d taken as its limit 0


@pytest.mark.parametrize("args, match", [(([0.5, 1.0], [0.1]), "one gain per distance"),
                                         (([0.5, -1.0], [0.1, 0.2]), "point 1"),
                                         (([0.5, float("nan")], [0.1, 0.2]), "point 1"),
                                         (([1.0, 1.0], [0.1, 0.2]), "do not fix two parameters"),
                                         (([1.0], [0.1]), "do not fix two parameters")])
def test_fit_gao_refuses_what_cannot_be_fitted(args, match):
    from marlhf_edu.math.evaluation import fit_gao

    with pytest.raises(ValueError, match=match):
        fit_gao(*args)
    with pytest.raises(ValueError, match="form must be one of"):
        fit_gao([0.5, 1.0], [0.1, 0.2], form="bon")
