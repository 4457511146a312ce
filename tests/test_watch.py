"""`check_run`: each rule fires on the sign it names, and a quiet run has no findings."""

import pytest

from marlhf_edu.ppo.watch import Finding, check_run


def run(n=20, **curves):
    """n step records; each curve is a function of the step (1..n), the rest held steady."""
    base = {"score/mean": lambda t: 0.5, "kl/k1": lambda t: 1.0, "response/length": lambda t: 40.0,
            "response/no_eos_rate": lambda t: 0.1, "policy/entropy": lambda t: 1.5,
            "value/explained_variance": lambda t: 0.3, "ppo/skipped_minibatches": lambda t: 0}
    base.update(curves)
    return [{"step": t, **{k: f(t) for k, f in base.items()}} for t in range(1, n + 1)]


def rules(records, **kw):
    return [f.rule for f in check_run(records, **kw)]


def test_a_steady_run_has_no_findings():
    assert check_run(run()) == []


@pytest.mark.parametrize("curve, rule", [
    ({"kl/k1": lambda t: 0.5 * t}, "kl_runaway"),  # last 5 steps average 45 nats
    ({"response/length": lambda t: 40.0 if t < 10 else 8.0}, "length_collapse"),
    ({"response/no_eos_rate": lambda t: 0.1 if t < 10 else 0.9}, "length_runaway"),
    ({"policy/entropy": lambda t: 1.5 if t < 10 else 0.3}, "entropy_collapse"),
    ({"ppo/skipped_minibatches": lambda t: 1 if t == 7 else 0}, "skipped_minibatches"),
    ({"value/explained_variance": lambda t: -0.5}, "critic_not_learning"),
])
def test_each_rule_fires_on_its_sign(curve, rule):
    assert rules(run(**curve)) == [rule]


def test_reward_hacking_needs_the_judge_to_fall_while_the_score_rises():
    rising, falling = (lambda t: 0.1 * t), (lambda t: 1.0 - 0.02 * t)
    assert rules(run(**{"score/mean": rising, "gold/mean": falling})) == ["reward_hacking"]
    assert rules(run(**{"score/mean": rising, "gold/mean": lambda t: 0.8})) == []  # both fine: learning
    assert rules(run(**{"score/mean": lambda t: 0.5, "gold/mean": falling})) == []  # the score did not rise


def test_thresholds_are_the_arguments_and_findings_say_where():
    records = run(**{"kl/k1": lambda t: 7.0})
    assert rules(records) == ["kl_runaway"] and rules(records, kl_limit=8.0) == []
    # a run held at its adaptive controller's target (the 7B config's is 6) is where it was asked to be
    held = run(**{"kl/k1": lambda t: 6.5, "kl/target": lambda t: 6.0})
    assert rules(held) == [] and rules(run(**{"kl/k1": lambda t: 9.5, "kl/target": lambda t: 6.0})) == ["kl_runaway"]
    assert rules(held, kl_limit=6.0) == ["kl_runaway"]  # a limit given is the limit
    (finding,) = check_run(run(**{"ppo/skipped_minibatches": lambda t: 2 if t == 4 else 0}))
    assert finding == Finding("skipped_minibatches", 4, "2 minibatch(es) skipped by the ratio threshold")
    assert str(finding).startswith("step 4: skipped_minibatches:")


def test_missing_keys_skip_their_rules_and_bad_input_is_refused():
    assert check_run([{"step": 1, "score/mean": 0.0}]) == []
    with pytest.raises(ValueError, match="no step records"):
        check_run([])
    with pytest.raises(ValueError, match="window must be >= 1"):
        check_run(run(), window=0)


def test_held_out_falls_needs_the_training_score_up_and_the_held_out_score_down():
    rising = {"score/mean": lambda t: 0.1 * t}
    falling = [{"updates": 0, "reward_model_score": 3.8}, {"updates": 20, "reward_model_score": 3.4}]
    holding = [{"updates": 0, "reward_model_score": 3.8}, {"updates": 20, "reward_model_score": 3.9}]
    assert rules(run(**rising), held_out=falling) == ["held_out_falls"]
    assert rules(run(**rising), held_out=holding) == []
    assert rules(run(), held_out=falling) == []  # the training score did not rise
    assert rules(run(**rising)) == []  # no held-out scores: the rule is skipped


def test_eos_driven_score_from_logged_split_means_or_estimated_from_the_steps():
    spread = {"score/std": lambda t: 1.0}
    split = {"score/mean_eos": lambda t: 3.0, "score/mean_no_eos": lambda t: 1.0}
    assert rules(run(**spread, **split)) == ["eos_driven_score"]  # a gap of 2 against a spread of 1
    assert rules(run(**spread, **split), eos_gap=2.5) == []
    # not logged: the mean score follows the no-EOS rate as a + (b − a)·q would, with b − a = −2.5
    q = lambda t: 0.9 - 0.04 * t
    estimated = run(**spread, **{"response/no_eos_rate": q, "score/mean": lambda t: 3.0 - 2.5 * q(t)})
    (finding,) = check_run(estimated, held_out=None)
    assert finding.rule == "eos_driven_score" and "by 2.50" in finding.message and "estimated" in finding.message
    # the same rise with no link to EOS (constant no-EOS rate) is no finding
    assert rules(run(**spread, **{"score/mean": lambda t: 3.0 - 2.5 * q(t)})) == []


@pytest.mark.parametrize("name, held_out_fell", [("smollm2_ma_ppo", True), ("smollm2_ma_ppo_evasion_kl01_seed1", False),
                                                 ("smollm2_ma_ppo_seed2", True), ("smollm2_ma_ppo_seed3", True),
                                                 ("smollm2_ma_ppo_seed4", False)])
def test_the_stored_smollm2_runs_that_learned_to_stop_are_flagged(name, held_out_fell):
    """Issue 33: the shipped config's five seeds, scored at the last token, climbed as their answers ended sooner
    (all five); the reward model's held-out score fell beyond two paired standard errors in three of them."""
    import pathlib

    from marlhf_edu.ppo.watch import check_folder

    run_dir = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "smollm2_last_token" / name
    rules = {f.rule for f in check_folder(run_dir)}
    assert "eos_driven_score" in rules and ("held_out_falls" in rules) == held_out_fell


def test_held_out_falls_pairs_the_prompts_when_it_can():
    rising = {"score/mean": lambda t: 1.0 + (1.5 if t > 15 else 0.0), "score/std": lambda t: 1.6}
    spread_out = [1.0, 5.0, 3.0, 7.0, 2.0, 6.0]  # prompts far apart: an unpaired comparison drowns in this
    small = [{"updates": 0, "reward_model_score": 4.0, "scores": spread_out},
             {"updates": 40, "reward_model_score": 3.9, "scores": [x - 0.1 for x in spread_out]}]
    assert rules(run(**rising), held_out=small) == ["held_out_falls"]  # every prompt fell by 0.1: paired SE 0
    noisy = [{"updates": 0, "reward_model_score": 4.0, "scores": spread_out},
             {"updates": 40, "reward_model_score": 3.9, "scores": [x + d for x, d in zip(spread_out, [-2, 2, -2, 2, -2, 1.4])]}]
    assert rules(run(**rising), held_out=noisy) == []  # the same mean fall, inside two paired standard errors


def test_held_out_falls_ignores_a_rise_inside_the_noise():
    falling = [{"updates": 0, "reward_model_score": 4.55}, {"updates": 40, "reward_model_score": 4.43}]
    noisy = {"score/mean": lambda t: 3.3 + (0.12 if t > 15 else 0.0), "score/std": lambda t: 1.6}
    assert rules(run(**noisy), held_out=falling) == []  # +0.12 against a spread of 1.6
    clear = {"score/mean": lambda t: 1.3 + (1.4 if t > 15 else 0.0), "score/std": lambda t: 1.6}
    assert rules(run(**clear), held_out=falling) == ["held_out_falls"]


def test_a_metrics_line_without_a_step_names_the_file_and_line(tmp_path):
    """Reliability audit: `check_folder` and `read_held_out` read `r["step"]` unchecked, so a metrics line without a
    step was a KeyError; they read through `read_jsonl(..., key="step")`, whose error names the file and the line."""
    import json

    from marlhf_edu.errors import DataFileError
    from marlhf_edu.ppo.watch import check_folder, read_held_out

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "score/mean": 0.5}) + "\n"
                                            + json.dumps({"score/mean": 0.6}) + "\n" + json.dumps({"step": 3}) + "\n")
    with pytest.raises(DataFileError, match=r"metrics\.jsonl, line 2: .*'step'"):
        check_folder(tmp_path)
    (tmp_path / "eval.json").write_text(json.dumps({"before": {"reward_model_score": 0.1}}))
    with pytest.raises(DataFileError, match=r"metrics\.jsonl, line 2: .*'step'"):
        read_held_out(tmp_path)
