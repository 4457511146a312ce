"""The reward head fitted on frozen features (LP-FT): it recovers a known preference direction, acts on raw
features, picks its regularisation on the training pairs only, and lands in the model's `score` head."""

import pytest
import torch

from marlhf_edu.math.reward_probe import L2_GRID, fit_bradley_terry_head, probe_score_head


def synthetic_pairs(n, seed=0):
    """Features of width 8 with very different scales; the chosen side has the higher true reward w*·h."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1.0, 1.0])
    w_true = torch.tensor([1.0, -2.0, 0.5, 0.0, 0.0, 0.0, 1.0, -1.0]) / scale
    a, b = torch.randn(n, 8, generator=g) * scale, torch.randn(n, 8, generator=g) * scale
    a_wins = (a @ w_true > b @ w_true)[:, None]
    return torch.where(a_wins, a, b), torch.where(a_wins, b, a), w_true


def test_fit_recovers_the_direction_on_raw_features():
    chosen, rejected, w_true = synthetic_pairs(400)
    fit = fit_bradley_terry_head(chosen, rejected)
    assert set(fit.cv_accuracy) == set(L2_GRID) and fit.cv_accuracy[fit.l2] == max(fit.cv_accuracy.values())
    assert fit.train_accuracy > 0.95
    fresh_c, fresh_r, _ = synthetic_pairs(400, seed=1)
    assert ((fresh_c - fresh_r) @ fit.weight > 0).float().mean() > 0.95  # the weight is for raw features
    # the direction, compared where both are standardised (raw directions differ by the 1e5 range of scales)
    scale = torch.cat([chosen, rejected]).std(0)
    cosine = torch.nn.functional.cosine_similarity(fit.weight * scale, w_true * scale, dim=0)
    assert cosine > 0.95


def test_fit_checks_its_input():
    chosen, rejected, _ = synthetic_pairs(40)
    with pytest.raises(ValueError, match=r"\(N, H\)"):
        fit_bradley_terry_head(chosen, rejected[:, :4])
    with pytest.raises(ValueError, match="too few"):
        fit_bradley_terry_head(chosen[:6], rejected[:6])


@pytest.mark.slow
def test_probe_score_head_fills_the_head_and_beats_a_random_one():
    from transformers import AutoModelForSequenceClassification

    from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.sources import load_tokenizer, align_pad
    from marlhf_edu.training.reward import evaluate_reward_model

    tokenizer = load_tokenizer(SFT_DIR)
    torch.manual_seed(0)
    model = align_pad(AutoModelForSequenceClassification.from_pretrained(SFT_DIR, num_labels=1), tokenizer).eval()
    world = ToyWorld(ToyWorldConfig(seed=0))
    train, held_out = world.preference_dataset().select(range(128)).to_list(), world.eval_pairs(128)
    random_head = evaluate_reward_model(model, tokenizer, held_out)["accuracy"]
    fit = probe_score_head(model, tokenizer, train)
    assert torch.equal(model.score.weight[0], fit.weight)
    assert not model.training
    probed = evaluate_reward_model(model, tokenizer, held_out)["accuracy"]
    assert probed > 0.7 and probed > random_head + 0.2, (random_head, probed)


def test_stage_rejects_an_unknown_head_init(tmp_path):
    from trl import ModelConfig, RewardConfig

    from marlhf_edu.errors import ConfigError
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.training.args import parse_stage_args
    from marlhf_edu.training.reward import RMScriptArguments, run_rm

    args = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig),
                            ["--config", "configs/tiny_rm.yaml", "--output_dir", str(tmp_path),
                             "--model_name_or_path", str(SFT_DIR), "--score_head_init", "zeros"])
    with pytest.raises(ConfigError, match="score_head_init must be 'random' or 'probe'"):
        run_rm(*args)


@pytest.mark.slow
def test_stage_trains_from_the_probed_head(tmp_path):
    """`score_head_init: probe` in the stage: the head peft saves starts at the probe's fit (learning rate 0 keeps
    it there), and a random init does not."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification
    from trl import ModelConfig, RewardConfig

    from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.sources import load_tokenizer, align_pad
    from marlhf_edu.training.args import parse_stage_args
    from marlhf_edu.training.reward import RMScriptArguments, run_rm

    def saved_head(init, out):
        args = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig), [
            "--config", "configs/tiny_rm.yaml", "--output_dir", str(out), "--model_name_or_path", str(SFT_DIR),
            "--max_rows", "64", "--max_steps", "1", "--learning_rate", "0", "--warmup_steps", "0",
            "--score_head_init", init])
        run_rm(*args)
        weights = load_file(out / "adapter_model.safetensors")
        return next(v for k, v in weights.items() if "score" in k)

    probed = saved_head("probe", tmp_path / "probe")
    random_ = saved_head("random", tmp_path / "random")
    # refit on the same 64 pairs, independently of the stage
    tokenizer = load_tokenizer(SFT_DIR)
    model = align_pad(AutoModelForSequenceClassification.from_pretrained(SFT_DIR, num_labels=1), tokenizer)
    pairs = ToyWorld(ToyWorldConfig(seed=0)).preference_dataset().select(range(64)).to_list()
    expected = probe_score_head(model, tokenizer, pairs).weight
    torch.testing.assert_close(probed[0], expected, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(random_[0], expected, atol=1e-3)
