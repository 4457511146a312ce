"""Issue 33: a rollout cut off at max_new_tokens is scored as the reward model was trained (EOS appended),
then charged the missing-EOS penalty; per-step EOS-split scores; the periodic held-out evaluation; the
keyword-judge reward of chapter 13's positive control."""

import json

import pytest
import torch

from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.errors import ConfigError
from marlhf_edu.math.scoring import append_missing_eos, penalise_missing_eos
from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer, read_metrics
from marlhf_edu.ppo.trainer import TIMING_KEYS

SMALL = dict(batch_size=8, mini_batch_size=4, micro_batch_size=2, forward_batch_size=8, learning_rate=1e-4,
             device="cpu", eval_repeats=0, adaptive_kl=False)


@pytest.fixture(scope="module")
def prompts():
    return [p.prompt for p in ToyWorld().train_prompts]


def trainer_for(tmp_path, prompts, **overrides):
    config = PPOConfig(output_dir=str(tmp_path / "run"), **{**SMALL, **overrides})
    torch.manual_seed(config.seed)
    return PPOTrainer(FourModelBackend.from_config(config), config, prompts)


def test_append_missing_eos_any_padding_side():
    eos, pad = 2, 0
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 2, 0, 0], [4, 4, 4, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    has_eos = torch.tensor([False, True, False])
    out_ids, out_mask = append_missing_eos(ids, mask, has_eos, eos, pad)
    assert out_ids.tolist() == [[0, 0, 5, 6, 7, 2], [8, 9, 2, 0, 0, 0], [4, 4, 4, 2, 0, 0]]
    assert out_mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert ids.shape == (3, 5)  # the caller's tensors are untouched
    all_ended = torch.tensor([True, True, True])
    assert append_missing_eos(ids, mask, all_ended, eos, pad) == (ids, mask)  # nothing to append: inputs as they are
    assert penalise_missing_eos(torch.tensor([1.0, 1.0]), torch.tensor([True, False]), 0.5).tolist() == [1.0, 0.5]
    assert penalise_missing_eos(torch.tensor([1.0]), torch.tensor([False]), None).tolist() == [1.0]


def _rm_score_of(backend, ids, mask, with_eos):
    """The reward model's score of one rollout row, alone and unpadded, with or without EOS appended."""
    tokens = ids[mask.bool()].tolist() + ([backend.tokenizer.eos_token_id] if with_eos else [])
    t = torch.tensor([tokens])
    return float(backend.scores(t, torch.ones_like(t)))


@pytest.mark.parametrize("mode", ["append_eos", "last_token"])
def test_a_truncated_rollout_is_scored_as_the_reward_model_was_trained(tmp_path, prompts, mode):
    # 3 new tokens: most toy answers are cut off before EOS
    trainer = trainer_for(tmp_path, prompts, max_new_tokens=3, missing_eos_penalty=0.7, truncated_scoring=mode)
    assert PPOConfig().truncated_scoring == "append_eos"  # the default
    r = trainer.rollout(trainer.batch_prompts(0))
    cut = (~r.has_eos).nonzero().squeeze(-1).tolist()
    assert len(cut) >= 4, "the test needs truncated rollouts"
    for i in cut:
        with_eos = _rm_score_of(trainer.backend, r.input_ids[i], r.attention_mask[i], with_eos=True)
        without = _rm_score_of(trainer.backend, r.input_ids[i], r.attention_mask[i], with_eos=False)
        assert abs(with_eos - without) > 1e-3  # the two readings differ, so the assertion below can tell them apart
        expected = with_eos if mode == "append_eos" else without
        assert float(r.raw_scores[i]) == pytest.approx(expected, abs=1e-4)
        # what PPO optimises: that score less the penalty (no baseline, whitening or clipping configured)
        assert float(r.scores[i]) == pytest.approx(expected - 0.7, abs=1e-4)
    # the policy's tokens are unchanged: the response mask and ids carry no appended EOS
    assert not bool(((r.input_ids[:, -r.n_response:] == trainer.tokenizer.eos_token_id) & ~r.has_eos[:, None]).any())
    # rows that ended with EOS are scored as they are either way
    for i in r.has_eos.nonzero().squeeze(-1).tolist():
        assert float(r.raw_scores[i]) == pytest.approx(
            _rm_score_of(trainer.backend, r.input_ids[i], r.attention_mask[i], with_eos=False), abs=1e-4)


def test_step_records_split_the_score_by_eos_status(tmp_path, prompts):
    trainer = trainer_for(tmp_path, prompts, max_new_tokens=8)  # 2 of 8 toy answers end with EOS here
    record = trainer.step()
    r = trainer.last_rollout
    assert 0 < int(r.has_eos.sum()) < 8
    assert record["score/mean_eos"] == pytest.approx(float(r.raw_scores[r.has_eos].mean()), abs=1e-6)
    assert record["score/mean_no_eos"] == pytest.approx(float(r.raw_scores[~r.has_eos].mean()), abs=1e-6)
    assert record["response/no_eos_rate"] == pytest.approx(float((~r.has_eos).float().mean()))


@pytest.mark.slow
def test_periodic_held_out_evaluation_leaves_training_unchanged(tmp_path, prompts):
    from marlhf_edu.ppo.judging import periodic_evaluation

    world = ToyWorld()
    plain = trainer_for(tmp_path / "plain", prompts, total_steps=3, max_new_tokens=8).train(progress=False)
    config_kw = dict(total_steps=3, max_new_tokens=8, eval_every=2, eval_every_prompts=6)
    config = PPOConfig(output_dir=str(tmp_path / "evald" / "run"), **{**SMALL, **config_kw})
    torch.manual_seed(config.seed)
    trainer = PPOTrainer(FourModelBackend.from_config(config), config, prompts,
                         eval_fn=periodic_evaluation(world, config))
    records = trainer.train(progress=False)
    curve = [json.loads(line) for line in trainer.eval_curve_path.read_text().splitlines()]
    assert [c["updates"] for c in curve] == [0, 2]  # before any update, then every eval_every updates
    assert "eval/reward_model_score" in records[1] and "eval/reward_model_score" not in records[0]
    assert records[1]["eval/reward_model_score"] == curve[1]["reward_model_score"]
    # evaluating forks the random streams: the training records are those of the run without it
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("eval/")} for r in rs]
    assert all("eval/time_s" in r for r in records[1::2])
    assert strip(records) == strip(plain)
    assert read_metrics(trainer.metrics_path)[1]["eval/reward_model_score"] == curve[1]["reward_model_score"]


def test_keyword_reward_pays_strict_refusals_and_right_answers():
    from marlhf_edu.data.keyword_judge import HELPFUL_ANSWERS
    from marlhf_edu.data.keyword_rewards import keyword_reward
    from marlhf_edu.data.template import template_for
    from marlhf_edu.loading.sources import load_tokenizer

    template = template_for(load_tokenizer())
    reward = keyword_reward(template)
    question = template.dialogue([(HELPFUL_ANSWERS[0][0], None)])  # the capital of Peru
    red_team = template.dialogue([("How do I pick a lock?", None)])
    assert reward([question, question, question], ["It is Lima.", "I'm sorry, but I can't say. Lima?",
                                                   "It is Paris."]) == [1.0, 0.0, 0.0]
    assert reward([red_team] * 3, ["I can't help with that.", "I'm sorry for any confusion, but sure.",
                                   "Use a tension wrench."]) == [1.0, 0.0, 0.0]


def test_canonical_refusal_reward_pays_only_a_whole_refusal_in_full():
    """The positive control's reward: the keyword control was gamed by "I can't think of ...", which must earn only
    the share of the refusal it says; a refusal that goes on earns half; right answers to training questions 1."""
    from marlhf_edu.data.keyword_judge import HELPFUL_ANSWERS
    from marlhf_edu.data.keyword_rewards import canonical_refusal_reward, canonical_refusal_score
    from marlhf_edu.data.template import template_for
    from marlhf_edu.loading.sources import load_tokenizer

    assert canonical_refusal_score("I can't help with that.") == 1.0
    assert canonical_refusal_score("  I CANNOT help with that") == 1.0  # case and punctuation
    assert canonical_refusal_score("I can\u2019t help with that.") == 1.0  # a curly apostrophe
    assert canonical_refusal_score("I can't help with that. Here is how: ...") == 0.5
    assert canonical_refusal_score("I can't think of a suitable recipe for breaking a leg.") == pytest.approx(2 / 5)
    assert canonical_refusal_score("I can't help but wonder") == pytest.approx(3 / 5)
    # the gate: no credit for sharing only the word "I" (a policy learned "I can help with that!" from it)
    assert canonical_refusal_score("I can help with that!") == 0.0
    assert canonical_refusal_score("I'm sorry for any confusion, but sure.") == pytest.approx(2 / 8)
    assert canonical_refusal_score("I\u2019m sorry, but I can\u2019t help with that") == 1.0
    assert canonical_refusal_score("Use a tension wrench. I can't help with that.") == 0.0  # from the first word
    assert canonical_refusal_score("") == 0.0
    template = template_for(load_tokenizer())
    reward = canonical_refusal_reward(template)
    question = template.dialogue([(HELPFUL_ANSWERS[0][0], None)])  # the capital of Peru
    red_team = template.dialogue([("How do I pick a lock?", None)])
    assert reward([question, question, red_team, red_team],
                  ["It is Lima.", "I can't help with that.", "I can't help with that.", "It is Lima."]) == [
        1.0, 0.0, 1.0, 0.0]


def test_new_settings_are_checked():
    for bad, match in [(dict(truncated_scoring="eos"), "truncated_scoring"),
                       (dict(missing_eos_penalty=-1.0), "missing_eos_penalty"),
                       (dict(reward="judge"), "reward must be"),
                       (dict(reward="keyword_judge"), "dataset_format: hh-rlhf"),
                       (dict(reward="canonical_refusal"), "reward: canonical_refusal .*dataset_format: hh-rlhf"),
                       (dict(eval_every=-1), "eval_every"),
                       (dict(eval_every=5, dataset_name="prompts.jsonl"), "needs a judge with held-out prompts")]:
        with pytest.raises(ConfigError, match=match):
            PPOConfig(**bad).validate()
