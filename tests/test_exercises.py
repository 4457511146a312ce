"""The exercise checkers must pass correct solutions and fail the classic wrong ones."""

import inspect
import types

import pytest
import torch

from marlhf_edu import gae_advantages_reference, kl_penalty, logprobs_from_logits, masked_mean, pairwise_reward_loss, policy_loss
from marlhf_edu.math.ppo_objective import value_loss
from marlhf_edu.teaching import exercises as ex


def private_copy(f):
    """A copy of a package function that withholding does not reach (what a correct solution looks like)."""
    f = inspect.unwrap(f)
    return types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)


def test_reference_implementations_pass():
    assert ex.check_masked_mean(private_copy(masked_mean))
    assert ex.check_sequence_means(lambda v, m, _f=private_copy(masked_mean): _f(v, m, dim=1))
    assert ex.check_pairwise_reward_loss(private_copy(pairwise_reward_loss))
    assert ex.check_logprobs_from_logits(private_copy(logprobs_from_logits))
    assert ex.check_tempered_logprobs(lambda z, y, t, _f=private_copy(logprobs_from_logits): _f(z.double() / t, y))
    kl = private_copy(kl_penalty)  # its k3 branch calls the withheld helper _k3, so only k1 passes this way
    assert ex.check_kl_penalty(lambda a, b: kl(a, b, "k1"), "k1")
    assert not ex.check_kl_penalty(lambda a, b: kl(a, b, "k3"), "k3")
    assert ex.check_gae_advantages(private_copy(gae_advantages_reference))
    assert ex.check_policy_loss(private_copy(policy_loss))
    assert ex.check_value_loss(private_copy(value_loss))


CHECKERS = [name for name in dir(ex) if name.startswith("check_")]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "check_rate_interval" else n
                                  for n in CHECKERS])
def test_calling_the_package_does_not_pass(name):
    """Each checker withholds the package's answer while the learner's function runs, under any import path."""
    check = getattr(ex, name)
    assert check.withholds, name
    for path in check.withholds:
        target = ex._resolve(path)

        def calls_package(*args, _t=target):
            return _t(*args)
        report = check(calls_package)
        assert not report and len(report.failures) == len(report.cases), name
        assert "is withheld while your exercise is checked" in repr(report), name
        assert inspect.unwrap(target).__code__.co_name != "stub", name  # restored after the check


def test_withheld_reaches_every_import_path_and_restores():
    import marlhf_edu
    import marlhf_edu.math.masked
    import marlhf_edu.math.ppo_objective

    with ex.withheld(masked_mean):
        for f in (marlhf_edu.masked_mean, marlhf_edu.math.masked.masked_mean, marlhf_edu.math.ppo_objective.masked_mean):
            with pytest.raises(NotImplementedError, match="masked_mean is withheld"):
                f(torch.ones(2), torch.ones(2))
    assert marlhf_edu.math.masked.masked_mean(torch.ones(2), torch.ones(2)) == 1.0
    with pytest.raises(ZeroDivisionError):
        with ex.withheld(masked_mean):
            1 / 0
    assert masked_mean(torch.ones(2), torch.ones(2)) == 1.0  # restored after an error too


def test_require_raises_with_the_report_and_prints_a_pass(capsys):
    report = ex.check_position_ids(lambda m: m.long().cumsum(-1))
    with pytest.raises(AssertionError) as err:
        report.require()
    assert "FAIL check_position_ids" in str(err.value) and "right padding" in str(err.value)
    ex.check_position_ids(lambda m: (m.long().cumsum(-1) - 1).clamp_min(0)).require()
    assert capsys.readouterr().out.startswith("PASS check_position_ids")


def test_grade_gives_credit_per_case_and_lists_every_case(capsys):
    """Issue 36: a graded cell's score is the share of its cases that pass (nbgrader reads the cell's value), and
    the report names every case, the passing ones too; an error without a message leaves no dangling colon."""
    def stub(mask):
        raise NotImplementedError()

    right = lambda m: (m.long().cumsum(-1) - 1).clamp_min(0)  # noqa: E731
    arange = lambda m: torch.arange(m.shape[1]).expand(m.shape)  # right where no row is left-padded  # noqa: E731
    partial = ex.check_position_ids(arange)
    n, ok = len(partial.cases), sum(p is None for p in partial.problems)
    assert 0 < ok < n and len(partial.problems) == n
    hand = [ex.case("ones", lambda: True), ex.case("twos", lambda: False), ex.case("boom", lambda: 1 / 0)]
    assert ex.grade([partial, *hand], points=3) == round(3 * (ok + 1) / (n + 3), 2)
    out = capsys.readouterr().out
    passed = [c for c, p in zip(partial.cases, partial.problems) if p is None]
    assert all(f"  PASS {c}" in out for c in passed) and out.count("  FAIL ") == n - ok
    assert "PASS ones\nFAIL twos: wrong result\nFAIL boom: raised ZeroDivisionError: division by zero" in out
    assert out.rstrip().endswith(f"({ok + 1} of {n + 3} cases pass)")
    assert ex.grade([partial], points=2, partial=False) == 0 and "all or nothing" in capsys.readouterr().out
    assert ex.grade([ex.check_position_ids(right)], points=2, partial=False) == 2
    assert ex.grade([ex.check_position_ids(stub)], points=2) == 0
    out = capsys.readouterr().out
    assert "raised NotImplementedError\n" in out and "NotImplementedError:" not in out
    assert str(ex.check_position_ids(stub)).endswith("every case raised NotImplementedError")
    with pytest.raises(ValueError, match="no cases"):
        ex.grade([], points=1)


def test_a_hand_written_case_withholds_what_its_exercises_checker_does():
    """Issue 36: a graded cell's hand-written `case` runs the learner's code with the package's answer withheld, as
    the checker does; without `withhold` a learner who called the answer passed it."""
    from marlhf_edu.math.masked import masked_mean as answer

    def learner(v, m):  # the chapter 00 learner who calls the package instead of writing it
        return answer(v, m)

    test = lambda: float(learner(torch.ones(3), torch.ones(3))) == 1.0  # noqa: E731
    assert ex.case("calls the answer", test)  # nothing withheld: it passes
    report = ex.case("calls the answer", test, withhold=ex.check_sequence_means)
    assert not report and "masked_mean is withheld" in report.failures[0]
    assert float(answer(torch.ones(3), torch.ones(3))) == 1.0  # restored


def test_every_graded_case_in_the_book_withholds():
    """Each hand-written `case(` in a graded cell names, as `withhold=`, a checker that the same cell runs."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "chapters"
    cells = [(p.name, cell) for p in sorted(root.rglob("*.md"))
             for cell in re.findall(r"^# graded: .*?^```", p.read_text(), re.S | re.M)]
    assert len(cells) >= 17
    seen = 0
    for name, cell in cells:
        calls = re.split(r"\bcase\(", cell)[1:]
        for call in calls:
            seen += 1
            named = re.search(r"withhold=(check_\w+)", call.split("case(")[0])
            assert named, (name, call[:80])
            assert re.search(rf"\b{named.group(1)}\(", cell.replace(f"withhold={named.group(1)}", "")), (name, named)
    assert seen >= 11


def test_gguf_own_q4_1_dequantizer_is_withheld_too():
    """Chapter 13's exercise could be passed with `gguf.quants.dequantize`: every gguf path to Q4_1 is withheld."""
    import gguf.quants
    from gguf.constants import GGMLQuantizationType

    for learner in (lambda raw: gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_1),
                    lambda raw: gguf.quants.Q4_1.dequantize(raw)):
        report = ex.check_dequantize_q4_1(learner)
        assert not report and all("withheld" in f for f in report.failures), report.failures
    raw = gguf.quants.quantize(torch.randn(2, 32).numpy(), GGMLQuantizationType.Q4_1)
    assert gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_1).shape == (2, 32)  # restored


def test_the_bootstrap_checkers_own_reference_is_withheld_too():
    """Chapter 05's exercise could be passed by calling the checker's reference from the answer."""
    report = ex.check_gae_bootstrap(lambda v, r, m, b, g, l: ex.gae_with_bootstrap_reference(v, r, m, b, g, l))
    assert not report and all("withheld" in f for f in report.failures), report.failures
    ones = torch.ones(1, 3)
    advantages, _ = ex.gae_with_bootstrap_reference(ones, ones, ones, torch.zeros(1))  # restored after the check
    assert torch.isfinite(advantages).all()


def test_a_learners_warnings_and_stderr_stay_out_of_the_graded_cell(capsys):
    """nbgrader gives a graded cell 0 when anything reaches stderr, whatever its cases say: the checkers keep the
    learner's warnings and stderr lines out of the cell's output."""
    import sys
    import warnings

    def noisy(mask):
        warnings.warn("a learner's warning")
        print("a learner's stderr line", file=sys.stderr)
        return (mask.long().cumsum(-1) - 1).clamp_min(0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning that got out would raise here
        assert ex.grade([ex.check_position_ids(noisy)], points=2) == 2
    assert capsys.readouterr().err == ""


def test_seeds_draw_other_cases():
    seen, mean = [], private_copy(masked_mean)

    def records(v, m):
        seen.append(v.clone())
        return mean(v, m, dim=1)
    assert ex.check_sequence_means(records) and ex.check_sequence_means(records, seed=11)
    half = len(seen) // 2
    assert not torch.equal(seen[0], seen[half])  # another seed, other values
    assert len(ex.check_nf4_bytes(lambda *a: 0, seed=5).cases) == len(ex.check_nf4_bytes(lambda *a: 0).cases) + 3


def test_new_exercise_checkers_fail_classic_mistakes():
    mean = private_copy(masked_mean)
    assert not ex.check_sequence_means(lambda v, m: (v * m).sum(1) / m.sum(1))  # NaN padding leaks
    assert not ex.check_sequence_means(lambda v, m: mean(v, m).expand(v.shape[0]))  # batch mean, not per row
    assert not ex.check_sequence_means(lambda v, m: torch.where(m.bool(), v, 0.0).sum(1) / v.shape[1])  # divides by T
    lp = private_copy(logprobs_from_logits)
    assert not ex.check_tempered_logprobs(lambda z, y, t: lp(z, y))  # temperature forgotten
    assert not ex.check_tempered_logprobs(lambda z, y, t: lp(z, y) / t)  # divides the log-probs, not the logits
    gae = private_copy(gae_advantages_reference)
    assert not ex.check_gae_bootstrap(lambda v, r, m, b, g, l: gae(v, r, m, g, l))  # bootstrap ignored
    assert ex.check_gae_bootstrap(lambda v, r, m, b, g, l: gae(v, _last_plus(r, m, g * b), m, g, l))
    undiscounted = ex.check_gae_bootstrap(lambda v, r, m, b, g, l: gae(v, _last_plus(r, m, b), m, g, l))  # b, not γ·b
    assert [p is None for p in undiscounted.problems] == [True] + [False] * 6  # only the case whose bootstrap is 0
    assert not ex.check_gae_bootstrap(  # bootstrap added to the returns only
        lambda v, r, m, b, g, l: (lambda a, ret: (a, _last_plus(ret, m, g * b)))(*gae(v, r, m, g, l)))
    vl = private_copy(value_loss)
    assert not ex.check_value_loss(lambda v, o, r, m, e: 0.5 * mean((v - r) ** 2, m))  # no clipping
    assert not ex.check_value_loss(  # min instead of max
        lambda v, o, r, m, e: 0.5 * mean(torch.minimum((v - r) ** 2, (o + (v - o).clamp(-e, e) - r) ** 2), m))
    assert not ex.check_value_loss(  # clipped around the returns instead of the old values
        lambda v, o, r, m, e: 0.5 * mean(torch.maximum((v - r) ** 2, (r + (v - r).clamp(-e, e) - r) ** 2), m))
    assert ex.check_value_loss(vl)


def _last_plus(rewards, mask, bootstrap):
    from marlhf_edu.math.masked import last_valid_index

    out = torch.where(mask.bool(), rewards, 0.0).clone()
    out[torch.arange(out.shape[0]), last_valid_index(mask.bool())] += bootstrap
    return out


def test_independent_solutions_pass_and_near_misses_fail():
    """The checkers compare with the package's implementations; this shows they judge against the right values.

    Each solution here is written independently of the package (loops, textbook formulas). It must pass, and
    the same solution off by 0.1 % must fail, so a checker that accepted anything close would be caught.
    """
    import math

    def loop_masked_mean(values, mask):
        flat_v, flat_m = values.flatten().tolist(), mask.flatten().tolist()
        picked = [v for v, k in zip(flat_v, flat_m) if k]
        return torch.tensor(sum(picked) / len(picked), dtype=values.dtype)

    def softplus_loss(chosen, rejected, margin=None):
        gap = chosen - rejected - (0 if margin is None else margin)
        return torch.nn.functional.softplus(-gap).mean()

    def textbook_logprobs(logits, labels):
        z = logits - logits.max(-1, keepdim=True).values
        return (z - z.exp().sum(-1, keepdim=True).log()).gather(-1, labels[..., None]).squeeze(-1)

    def textbook_k3(logprob, ref_logprob):  # r − 1 − log r, with expm1 so tiny differences do not cancel
        log_r = ref_logprob - logprob
        return torch.expm1(log_r) - log_r

    def loop_gae(values, rewards, mask, gamma, lam):
        B, T = values.shape
        adv = torch.zeros_like(values)
        for b in range(B):
            idx = [t for t in range(T) if mask[b, t]]
            running = 0.0
            for j in reversed(range(len(idx))):
                t = idx[j]
                next_v = values[b, idx[j + 1]] if j + 1 < len(idx) else 0.0
                running = rewards[b, t] + gamma * next_v - values[b, t] + gamma * lam * running
                adv[b, t] = running
        return adv, (adv + values) * mask  # nothing at masked positions

    def textbook_policy_loss(logprobs, old_logprobs, advantages, mask, cliprange):
        ratio = torch.exp(logprobs - old_logprobs)
        loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange))
        return (loss * mask).sum() / mask.sum()

    cases = [(ex.check_masked_mean, loop_masked_mean, ()), (ex.check_pairwise_reward_loss, softplus_loss, ()),
             (ex.check_logprobs_from_logits, textbook_logprobs, ()), (ex.check_kl_penalty, textbook_k3, ("k3",)),
             (ex.check_gae_advantages, loop_gae, ()), (ex.check_policy_loss, textbook_policy_loss, ())]
    for check, solution, extra in cases:
        assert check(solution, *extra), check.__name__

        def off_by_a_little(*args, _solution=solution):
            out = _solution(*args)
            return tuple(o * 1.001 + 1e-3 for o in out) if isinstance(out, tuple) else out * 1.001 + 1e-3
        assert not check(off_by_a_little, *extra), check.__name__
    assert math.isfinite(float(softplus_loss(torch.tensor([-400.0]), torch.tensor([0.0]))))


def test_classic_mistakes_fail():
    assert not ex.check_masked_mean(lambda v, m: (v * m).sum() / m.sum())
    assert not ex.check_masked_mean(lambda v, m: v.mean())
    assert not ex.check_pairwise_reward_loss(lambda c, r, m=None: -torch.log(torch.sigmoid(c - r)).mean())
    assert not ex.check_pairwise_reward_loss(lambda c, r, m=None: -torch.nn.functional.logsigmoid(c - r).mean())
    assert not ex.check_logprobs_from_logits(lambda z, y: torch.log(torch.softmax(z, -1)).gather(-1, y[..., None]).squeeze(-1))
    assert not ex.check_kl_penalty(lambda l, r: torch.exp(r - l) - 1 - (r - l), "k3")
    assert not ex.check_kl_penalty(lambda l, r: l - r, "k3")

    def gae_ignoring_mask(v, r, m, g, l, _gae=private_copy(gae_advantages_reference)):
        return _gae(v, r, torch.ones_like(m), g, l)
    assert not ex.check_gae_advantages(gae_ignoring_mask)

    def min_instead_of_max(lp, old, a, m, c, _mean=private_copy(masked_mean)):
        ratio = torch.exp(lp - old)
        return _mean(torch.minimum(-a * ratio, -a * ratio.clamp(1 - c, 1 + c)), m)
    assert not ex.check_policy_loss(min_instead_of_max)


def test_policy_loss_check_gives_little_to_a_missing_clip_or_min_for_max_and_withholds_grpo_loss():
    """The cases that decide the exercise are the ones with ratios outside the clip range: an answer with no clip
    or with min for max passes at most the two cases inside it, and `grpo_loss` (β = 0, token-mean: the same
    loss) is no way round the exercise."""
    from marlhf_edu.math.grpo import grpo_loss
    from marlhf_edu.math.masked import masked_mean

    def no_clip(lp, old, a, m, c, _mean=private_copy(masked_mean)):
        return _mean(-a * torch.exp(lp - old), m)

    def min_for_max(lp, old, a, m, c, _mean=private_copy(masked_mean)):
        ratio = torch.exp(lp - old)
        return _mean(torch.minimum(-a * ratio, -a * ratio.clamp(1 - c, 1 + c)), m)

    for wrong in (no_clip, min_for_max):
        for seed in (5, 151):
            report = ex.check_policy_loss(wrong, seed=seed)
            assert len(report.cases) - len(report.failures) <= 2, (wrong.__name__, seed, report.failures)

    def fixed_clip_range(lp, old, a, m, c, _mean=private_copy(masked_mean)):  # ignores its cliprange argument
        ratio = torch.exp(lp - old)
        return _mean(torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)), m)
    assert not ex.check_policy_loss(fixed_clip_range)

    def one_element(lp, old, a, m, c, _mean=private_copy(masked_mean)):  # right, as a (1,) tensor: trains fine
        ratio = torch.exp(lp - old)
        return _mean(torch.maximum(-a * ratio, -a * ratio.clamp(1 - c, 1 + c)), m).reshape(1)
    assert ex.check_policy_loss(one_element)

    def through_grpo_loss(lp, old, a, m, c):
        B, T = lp.shape
        return grpo_loss(lp.reshape(-1, 1), old.reshape(-1, 1), None, a.reshape(-1), m.reshape(-1, 1), epsilon=c,
                         aggregation="bnpo")
    assert not ex.check_policy_loss(through_grpo_loss)


def test_a_crashing_solution_is_reported_not_raised():
    def broken(*args):
        raise RuntimeError("not implemented")
    report = ex.check_gae_advantages(broken)
    assert not report and "raised RuntimeError: not implemented" in repr(report)
    assert len(report.failures) == len(report.cases)


def _pku_reference(row):
    safe = [row["is_response_0_safe"], row["is_response_1_safe"]]
    if safe[0] != safe[1]:
        winner, margin = (0 if safe[0] else 1), 3.0
    elif safe[0]:
        winner, margin = row["better_response_id"], 1.0
    else:
        winner, margin = row["safer_response_id"], 0.0
    return row[f"response_{winner}"], row[f"response_{1 - winner}"], margin


def test_data_chapter_checkers():
    from marlhf_edu.math.scoring import position_ids_from_mask

    assert ex.check_pku_preference(_pku_reference)
    # helpfulness first (ignores safety) and "safer decides always" are the classic mistakes
    assert not ex.check_pku_preference(lambda r: (r[f"response_{r['better_response_id']}"],
                                                  r[f"response_{1 - r['better_response_id']}"], 1.0))
    assert not ex.check_pku_preference(lambda r: (r[f"response_{r['safer_response_id']}"],
                                                  r[f"response_{1 - r['safer_response_id']}"], 3.0))
    assert ex.check_position_ids(private_copy(position_ids_from_mask))
    assert not ex.check_position_ids(lambda m: torch.arange(m.shape[1]).expand_as(m))
    assert not ex.check_position_ids(lambda m: m.long().cumsum(-1))  # off by one


def test_ppo_chapter_checker():
    from marlhf_edu.ppo import response_mask_from_ids

    assert ex.check_response_mask(private_copy(response_mask_from_ids))
    assert not ex.check_response_mask(lambda ids, eos: ids != 3)  # "not padding" misses tokens after the first EOS
    assert not ex.check_response_mask(lambda ids, eos: torch.cumsum(ids == eos, 1) == 0)  # drops the EOS itself


def test_check_nf4_bytes_passes_the_reference_and_fails_classic_mistakes():
    import math

    from marlhf_edu.memory.plan import MemorySettings, linear_weight_bytes

    lwb = private_copy(linear_weight_bytes)
    assert ex.check_nf4_bytes(lambda a, b, dq: lwb(a, b, MemorySettings(load_in_4bit=True, double_quant=dq)))
    assert ex.check_nf4_bytes(lambda a, b, dq: lwb(a, b, MemorySettings(load_in_4bit=True, double_quant=dq)), seed=3)
    assert not ex.check_nf4_bytes(lambda a, b, dq: a * b // 2)  # "4 bits per weight" forgets the constants
    # absmax rounded down instead of up: wrong whenever the last block is partial
    assert not ex.check_nf4_bytes(lambda a, b, dq: (a * b + 1) // 2 + 64 + (
        a * b // 64 + 4 + 4 * math.ceil(a * b / 64 / 256) + 1024 if dq else 4 * (a * b // 64)))
    # double quantization ignored
    assert not ex.check_nf4_bytes(lambda a, b, dq: (a * b + 1) // 2 + 64 + 4 * math.ceil(a * b / 64))


def test_check_expected_estimate_passes_the_reference_and_fails_classic_mistakes():
    import itertools

    from marlhf_edu.math.policy_gradient import expected_estimate

    reference = private_copy(expected_estimate)
    assert ex.check_expected_estimate(reference)
    assert ex.check_expected_estimate(reference, seed=5)
    assert len(ex.check_expected_estimate(reference, seed=5).cases) == len(ex.check_expected_estimate(reference).cases) + 3
    assert not ex.check_expected_estimate(expected_estimate)  # the package is withheld while the learner's code runs

    def enumerated(probs, mu, K, baseline, own_score=False, average=True, include_pi=True):
        """The test's own derivation: a loop over every draw of K arms."""
        probs, mu = probs.double(), mu.double()
        total = torch.zeros_like(probs)
        for draw in itertools.product(range(len(probs)), repeat=K):
            r = mu[list(draw)]
            b = torch.zeros(K, dtype=torch.float64) if baseline is None else baseline(r.clone())
            g = sum((r[i] - b[i]) * (torch.eye(len(probs), dtype=torch.float64)[a] - (probs if include_pi else 0))
                    for i, a in enumerate(draw))
            total += probs[list(draw)].prod() * g / (K if average else 1)
        return total

    assert ex.check_expected_estimate(enumerated)  # the test's own derivation agrees
    assert not ex.check_expected_estimate(lambda p, mu, K, b: enumerated(p, mu, K, b, average=False))  # a sum, not a mean
    # ∇ log π(a) = e_a, forgetting the softmax's normaliser: wrong once the rewards do not cancel it
    assert not ex.check_expected_estimate(lambda p, mu, K, b: enumerated(p, mu, K, b, include_pi=False))
    # ∇J itself, the baseline ignored: right only for the unbiased baselines
    report = ex.check_expected_estimate(lambda p, mu, K, b: p.double() * (mu.double() - p.double() @ mu.double()))
    assert not report and "batch mean" in report.brief() and "no baseline" not in report.brief()
    # one sample per estimate whatever K: the batch mean then removes the whole signal
    assert not ex.check_expected_estimate(lambda p, mu, K, b: enumerated(p, mu, 1, b))


@pytest.mark.slow
def test_check_rate_interval_accepts_any_valid_method_and_fails_ones_that_ignore_the_prompts():
    import math
    import random

    from marlhf_edu.math.evaluation import (cluster_bootstrap_interval, difference_interval,
                                            intraclass_correlation, mean_interval, wilson_interval)

    t_interval = private_copy(mean_interval)

    def over_prompts(groups):  # the t-interval over the prompts' own rates
        return t_interval([sum(g) / len(g) for g in groups])[1:]

    def design_effect(groups):  # Wilson on the answers, their number divided by 1 + (m − 1) ρ
        m, k, n = len(groups[0]), sum(map(sum, groups)), sum(map(len, groups))
        deff = 1 + (m - 1) * intraclass_correlation(groups)
        return wilson_interval(round(k / deff), max(1, round(n / deff)))

    def own_bootstrap(groups, n_boot=400):  # prompts resampled, written here: the package's is withheld
        rng = random.Random(0)
        stats = sorted(sum(sum(groups[rng.randrange(len(groups))]) for _ in range(len(groups)))
                       / sum(map(len, groups)) for _ in range(n_boot))
        return stats[int(0.025 * (n_boot - 1))], stats[math.ceil(0.975 * (n_boot - 1))]

    for method in (over_prompts, design_effect, own_bootstrap):
        report = ex.check_rate_interval(method)
        assert report, (method.__name__, report)
        assert "keep the 95 % promise" in repr(report)
    assert ex.check_rate_interval(over_prompts, seed=4)
    assert len(ex.check_rate_interval(over_prompts, seed=4).cases) == len(ex.check_rate_interval(over_prompts).cases) + 1

    # every answer counted as independent: too narrow exactly where answers to a prompt agree
    naive = ex.check_rate_interval(lambda g: wilson_interval(sum(map(sum, g)), sum(map(len, g))))
    assert not naive and "independent answers" not in naive.brief() and "ρ = 0.8" in naive.brief()
    assert not ex.check_rate_interval(lambda g: (0.0, 1.0))  # covers everything, says nothing
    assert not ex.check_rate_interval(lambda g: cluster_bootstrap_interval(g)[1:])  # withheld while the learner runs
    assert not ex.check_rate_interval(lambda g: mean_interval([sum(x) / len(x) for x in g])[1:])  # withheld too
    # Welch against a constant sample is the t-interval in disguise: withheld as well
    assert not ex.check_rate_interval(lambda g: difference_interval([sum(x) / len(x) for x in g], [0.0, 0.0])[1:])
    assert "not an interval" in repr(ex.check_rate_interval(lambda g: over_prompts(g)[::-1]))


def test_check_group_relative_advantages_passes_the_reference_and_fails_classic_mistakes():
    from marlhf_edu.math.grpo import group_relative_advantages

    reference = private_copy(group_relative_advantages)
    assert ex.check_group_relative_advantages(reference)
    assert ex.check_group_relative_advantages(reference, seed=5)
    assert not ex.check_group_relative_advantages(group_relative_advantages)  # withheld while the learner runs

    def grouped(r, G, layout="consecutive", bessel=True, eps=1e-4):
        x = r.view(-1, G) if layout == "consecutive" else r.view(G, -1).T
        a = (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True, unbiased=bessel) + eps)
        return (a if layout == "consecutive" else a.T).reshape(-1)

    assert ex.check_group_relative_advantages(grouped)  # the test's own derivation agrees
    assert not ex.check_group_relative_advantages(lambda r, G: grouped(r, G, layout="interleaved"))
    assert not ex.check_group_relative_advantages(lambda r, G: grouped(r, G, bessel=False))
    assert not ex.check_group_relative_advantages(lambda r, G: grouped(r, G, eps=0.0))  # NaN for equal rewards
    assert not ex.check_group_relative_advantages(lambda r, G: r - r.view(-1, G).mean(1).repeat_interleave(G))


def test_package_routes_to_the_group_and_leave_one_out_answers_are_withheld():
    from marlhf_edu.math.policy_gradient import leave_one_out_baseline

    def via_loo(r, G, loo=leave_one_out_baseline):  # (R - mean of the others) (G-1)/G = R - group mean
        centred = (r - loo(r, G)) * (G - 1) / G
        return centred / (r.view(-1, G).std(-1).repeat_interleave(G) + 1e-4)

    assert not ex.check_group_relative_advantages(via_loo)
    # the same routes pass outside the checkers' window: the refusals above are the withholding, not a wrong formula
    own_loo = private_copy(leave_one_out_baseline)
    assert ex.check_group_relative_advantages(lambda r, G: via_loo(r, G, loo=own_loo))


def test_check_ipo_margin_passes_the_reference_and_fails_classic_mistakes():
    import math

    from marlhf_edu.math.dpo import ipo_preferred_margin

    derived = lambda p, beta: (2 * p - 1) / (2 * beta)  # noqa: E731  the test's own minimisation, by hand
    assert ex.check_ipo_margin(derived) and ex.check_ipo_margin(derived, seed=7)
    assert ex.check_ipo_margin(private_copy(ipo_preferred_margin))
    assert not ex.check_ipo_margin(ipo_preferred_margin)  # withheld while the learner runs
    from marlhf_edu.math.dpo import margin_trajectory

    def searched(p, beta):  # no derivation: the package's trainer run on the weighted loss, which is withheld too
        if isinstance(p, torch.Tensor):
            return torch.tensor([searched(float(x), beta) for x in p], dtype=torch.float64)

        def loss(pc, pr, rc, rr, b):
            h = (pc - rc) - (pr - rr)
            return (p * (h - 1 / (2 * b)) ** 2 + (1 - p) * (-h - 1 / (2 * b)) ** 2).mean()
        return margin_trajectory(loss, beta, steps=400)[-1]

    assert not ex.check_ipo_margin(searched)  # passes every case when margin_trajectory is not withheld
    assert not ex.check_ipo_margin(lambda p, beta: 1 / (2 * beta) + 0 * p)  # the certain pair's target for every p
    assert not ex.check_ipo_margin(lambda p, beta: (p - 0.5) / (2 * beta))  # half the margin
    assert not ex.check_ipo_margin(lambda p, beta: p / (2 * beta))  # a target that never points the other way
    assert not ex.check_ipo_margin(lambda p, beta: torch.logit(torch.as_tensor(p, dtype=torch.float64)) / beta
                                   if not isinstance(p, float) or 0 < p < 1 else math.copysign(1e6, p - 0.5))  # DPO's


def test_check_dequantize_q4_1_passes_the_reference_and_fails_classic_mistakes():
    import numpy as np

    from marlhf_edu.loading.gguf_blocks import dequantize_q4_1

    def reference(raw, interleaved=False, swap_dm=False, nibble_scale=1):
        blocks = raw.reshape(*raw.shape[:-1], -1, 20)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        if swap_dm:
            d, m = m, d
        packed = blocks[..., 4:]
        if interleaved:  # lo, hi, lo, hi ... instead of all low nibbles then all high ones
            q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 32)
        else:
            q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
        return (d * q.astype(np.float32) / nibble_scale + m).reshape(*raw.shape[:-1], -1)

    assert ex.check_dequantize_q4_1(reference)
    assert ex.check_dequantize_q4_1(reference, seed=3)
    assert not ex.check_dequantize_q4_1(dequantize_q4_1)  # withheld while the learner runs
    assert not ex.check_dequantize_q4_1(lambda raw: reference(raw, interleaved=True))
    assert not ex.check_dequantize_q4_1(lambda raw: reference(raw, swap_dm=True))
    assert not ex.check_dequantize_q4_1(lambda raw: reference(raw, nibble_scale=15))  # scaled into [0, 1]
    assert not ex.check_dequantize_q4_1(lambda raw: reference(raw).reshape(-1))  # lost the row shape


def test_check_global_whiten_passes_the_reference_and_fails_classic_mistakes():
    from marlhf_edu.math.masked import masked_whiten

    def sums(values, mask, all_reduce, means="tokens", bessel=True, drop_mask=False):
        """One rank's answer: all-reduce the token count and sum, then the squared deviations."""
        mask = torch.ones_like(mask) if drop_mask else mask.bool()
        count, total = mask.sum().double(), torch.where(mask, values, 0.0).sum().double()
        if means == "tokens":
            n, s = all_reduce(torch.stack([count, total]))
            mean = s / n
        else:  # the mean of the ranks' means, each rank counted once
            mean = all_reduce(total / count) / all_reduce(torch.tensor(1.0, dtype=torch.float64))
            n = all_reduce(count)
        ss = all_reduce(torch.where(mask, (values - mean) ** 2, 0.0).sum())
        std = torch.sqrt(ss / (n - 1 if bessel else n) + 1e-8)
        return torch.where(mask, (values - mean) / std, 0.0)

    assert ex.check_global_whiten(sums)
    assert ex.check_global_whiten(sums, seed=7)
    assert not ex.check_global_whiten(lambda v, m, r: masked_whiten(v, m))  # withheld while the learner runs
    assert masked_whiten(torch.ones(1, 2), torch.ones(1, 2)).shape == (1, 2)  # and back once the check is over
    assert not ex.check_global_whiten(lambda v, m, r: sums(v, m, lambda t: t))  # each rank whitens its own shard
    assert not ex.check_global_whiten(lambda v, m, r: sums(v, m, r, means="ranks"))
    assert not ex.check_global_whiten(lambda v, m, r: sums(v, m, r, bessel=False))
    assert not ex.check_global_whiten(lambda v, m, r: sums(v, m, r, drop_mask=True))  # padding counted as tokens
    # a rank sees its own rows only: the other ranks' statistics can only come through all_reduce
    seen = []
    ex.check_global_whiten(lambda v, m, r: seen.append(v.shape) or sums(v, m, r))
    assert (3, 5) in seen and (1, 5) in seen and all(len(shape) == 2 for shape in seen)


def test_run_ranks_reports_mismatched_all_reduces_instead_of_hanging():
    from marlhf_edu.teaching.checks.part4_scale import run_ranks

    values, masks = [torch.zeros(1, 2), torch.ones(2, 2)], [torch.ones(1, 2), torch.ones(2, 2)]
    assert [float(t) for t in run_ranks(lambda v, m, r: r(v.sum()), values, masks)] == [4.0, 4.0]
    with pytest.raises(ValueError, match="different number of times"):  # rank 1 reduces twice
        run_ranks(lambda v, m, r: [r(v.sum()) for _ in range(len(v))], values, masks, timeout=0.5)
    with pytest.raises(ValueError, match="shapes .* on different ranks"):
        run_ranks(lambda v, m, r: r(v), values, masks)
    with pytest.raises(ZeroDivisionError):  # a rank's own error is the one reported
        run_ranks(lambda v, m, r: 1 / 0 if len(v) == 2 else r(v.sum()), values, masks)
    report = ex.check_global_whiten(lambda v, m, r: [r(v.sum()) for _ in range(len(v))] and v)
    assert not report and any("different number of times" in f for f in report.failures)  # 3 rows and 1 row


def test_check_kv_cache_bytes_passes_the_reference_and_fails_classic_mistakes():
    from marlhf_edu.memory.plan import kv_cache_bytes

    reference = private_copy(kv_cache_bytes)
    assert ex.check_kv_cache_bytes(reference)
    assert ex.check_kv_cache_bytes(reference, seed=4)
    assert not ex.check_kv_cache_bytes(kv_cache_bytes)  # withheld while the learner runs

    def cache(shape, b, t, nb, factor=2, heads="kv", width=None):
        h = {"kv": shape.kv_heads, "q": shape.num_heads}[heads]
        return factor * shape.num_layers * b * t * (width(shape) if width else h * shape.dim_head) * nb

    assert ex.check_kv_cache_bytes(cache)  # the test's own derivation agrees
    assert not ex.check_kv_cache_bytes(lambda s, b, t, nb: cache(s, b, t, nb, factor=1))  # keys only
    assert not ex.check_kv_cache_bytes(lambda s, b, t, nb: cache(s, b, t, nb, heads="q"))  # every query head
    assert not ex.check_kv_cache_bytes(lambda s, b, t, nb: cache(s, b, t, nb, width=lambda sh: sh.hidden_size))
    assert not ex.check_kv_cache_bytes(lambda s, b, t, nb: cache(s, b, t, nb) / 2**30)  # GiB, not bytes


def test_reward_loss_check_needs_a_differentiable_loss_and_withholds_dpo_loss():
    """A loss computed outside autograd matches every value and cannot train a reward model; `dpo_loss` with zero
    reference log-probs and β = 1 is the same loss, so it is withheld."""
    import math

    from marlhf_edu.math.dpo import dpo_loss

    def outside_autograd(c, r, m=None):
        gaps = (c - r - (m if m is not None else 0)).tolist()
        return torch.tensor(sum(math.log1p(math.exp(-g)) if g > -30 else -g for g in gaps) / len(gaps))

    def through_dpo_loss(c, r, m=None):
        zero = torch.zeros_like(c)
        return dpo_loss(c, r + (m if m is not None else 0), zero, zero, beta=1.0)[0]

    report = ex.check_pairwise_reward_loss(outside_autograd)
    assert not report and all("no gradient" in f for f in report.failures), report.failures
    assert not ex.check_pairwise_reward_loss(through_dpo_loss)
    detached = ex.check_pairwise_reward_loss(lambda c, r, m=None: -torch.nn.functional.logsigmoid(
        c - r.detach() - (m if m is not None else 0)).mean())  # the rejected score would never train
    assert not detached and all("input 1" in f for f in detached.failures), detached.failures
    assert ex.check_pairwise_reward_loss(lambda c, r, m=None: -torch.nn.functional.logsigmoid(
        c - r - (m if m is not None else 0)).mean())
