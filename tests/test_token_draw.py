"""`token_draw: inverse_cdf`: one fp64 uniform per row against the fp64 CDF draws from softmax(z / T) as
transformers' multinomial does, never a token of probability 0, and trains through the same engine."""

import logging

import pytest
import torch
from conftest import build_trainer

from marlhf_edu.errors import ConfigError
from marlhf_edu.ppo import PPOConfig
from marlhf_edu.ppo import token_draw
from marlhf_edu.ppo.backends import sample
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
from marlhf_edu.ppo.token_draw import inverse_cdf_draw

SMALL = dict(batch_size=8, mini_batch_size=4, micro_batch_size=4, forward_batch_size=8, max_new_tokens=12,
             actor_lora_r=8, actor_lora_alpha=16, device="cpu", eval_repeats=0, learning_rate=1e-3)


def _within(counts: torch.Tensor, p: torch.Tensor, n: int, sigmas: float = 5.0) -> bool:
    """Every count within `sigmas` binomial standard deviations of n·p."""
    expected = n * p
    return bool(((counts - expected).abs() <= sigmas * (n * p * (1 - p)).sqrt() + 1e-9).all())


def test_the_inverse_cdf_draw_samples_each_token_with_its_probability():
    # unnormalised, zeros first, inside and last: none of them may ever be drawn
    weights = torch.tensor([0.0, 0.3, 0.0, 1.05, 0.15, 0.0, 1.5, 0.0])
    p = weights / weights.sum()
    n = 200_000
    torch.manual_seed(0)
    drawn = inverse_cdf_draw(weights.expand(n, -1))
    assert drawn.shape == (n,) and drawn.dtype == torch.int64
    counts = torch.bincount(drawn, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0
    assert _within(counts, p.double(), n)
    # the check can fail: the same counts against a shifted distribution are far off
    assert not _within(counts, p.roll(1).double(), n)


def test_each_row_is_drawn_from_its_own_distribution():
    """Rows with disjoint supports and other totals: every row keeps to its own tokens and frequencies (a draw
    that read another row's total or cumulative sums would not)."""
    rows = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0], [0.0, 0.2, 0.6, 0.0]])
    n = 50_000
    torch.manual_seed(2)
    drawn = inverse_cdf_draw(rows.repeat(n, 1)).view(n, len(rows))
    for i, weights in enumerate(rows):
        counts = torch.bincount(drawn[:, i], minlength=len(weights)).double()
        assert counts[weights == 0].sum() == 0, i
        assert _within(counts, (weights / weights.sum()).double(), n), i


def test_the_thresholds_extremes_land_on_tokens_of_positive_probability(monkeypatch):
    """u = 0 puts the threshold on the total (the last token of positive probability, not past the vocabulary,
    not a trailing zero); the largest u below 1 puts it just above 0 (the first positive one, not a leading zero)."""
    weights = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0]])
    for u, expected in ((0.0, 5), (1 - 2.0 ** -53, 2)):
        monkeypatch.setattr(token_draw.torch, "rand", lambda size, u=u, **kw: torch.full(size, u, **kw))
        assert inverse_cdf_draw(weights).tolist() == [expected], u


def test_the_inverse_cdf_draw_refuses_rows_it_cannot_draw_from():
    with pytest.raises(ValueError, match="row 1 .* sums to 0"):
        inverse_cdf_draw(torch.tensor([[0.5, 0.5], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="row 0 .* nan"):
        inverse_cdf_draw(torch.tensor([[float("nan"), 0.5]]))
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        inverse_cdf_draw(torch.ones(3))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, prompts):
    """The tiny MA-PPO engine with a perturbed LoRA (sampling from the merged copy) and one prompt."""
    trainer = build_trainer(tmp_path_factory.mktemp("draw"), MultiAdapterBackend, prompts, SMALL,
                            load_in_4bit=False, merged_rollout=True)
    be = trainer.backend
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in be.model.named_parameters():
            if ".lora_B." in name and ".policy." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    be.policy_changed()
    return be


@pytest.mark.parametrize("draw", ["inverse_cdf", "multinomial"])
def test_generate_draws_the_first_token_from_the_forwards_softmax(tiny, prompts, draw):
    """Through transformers' `generate` (greedy on the recorder's one-hot scores for inverse_cdf): the first new
    token of 4,000 copies of one prompt at T = 2.5 (the tiny model is nearly sure of it at 1) is distributed as
    softmax(z / T) of a forward over the prompt.
    Multinomial, transformers' own draw, passes the same check."""
    be, T, n = tiny, 2.5, 4000
    enc = be.tokenizer(prompts[:1], return_tensors="pt")
    with torch.no_grad():
        p = torch.softmax(be.sampling_model()(**enc).logits[0, -1].double() / T, dim=-1)
    torch.manual_seed(1)
    ids = sample(be.sampling_model(), be.tokenizer, enc.input_ids.expand(n, -1), enc.attention_mask.expand(n, -1),
                 max_new_tokens=1, temperature=T, draw=draw)
    counts = torch.bincount(ids[:, -1], minlength=p.numel()).double()
    assert _within(counts, p, n)
    # a spread distribution, not one likely token
    assert float(p.max()) < 0.9 and int((counts > 0).sum()) > 5
    # the check can fail: the same counts against T = 1 are far off
    q = torch.softmax(torch.log(p) * T, dim=-1)
    assert not _within(counts, q, n)


def test_the_inverse_cdf_draw_is_seeded_and_recording_does_not_change_it(tiny, prompts, caplog):
    be = tiny
    enc = be.tokenizer(prompts[:6], return_tensors="pt", padding=True, padding_side="left")
    sampling = dict(max_new_tokens=12, temperature=0.7, draw="inverse_cdf")
    caplog.set_level(logging.WARNING)
    with _no_warnings():
        torch.manual_seed(0)
        ids, logprobs = be.generate(enc.input_ids, enc.attention_mask, with_logprobs=True, **sampling)
        torch.manual_seed(0)
        plain = be.generate(enc.input_ids, enc.attention_mask, **sampling)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # greedy mode's flags raise no warning
    assert torch.equal(plain, ids)
    torch.manual_seed(0)
    other = be.generate(enc.input_ids, enc.attention_mask, **{**sampling, "draw": "multinomial"})
    assert not torch.equal(other, ids)  # another random stream
    assert logprobs.shape == (6, ids.shape[1] - enc.input_ids.shape[1])


class _no_warnings:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert not self.records, [str(w.message) for w in self.records]


def test_the_inverse_cdf_draw_refuses_truncated_sampling(tiny, prompts):
    enc = tiny.tokenizer(prompts[:2], return_tensors="pt", padding=True, padding_side="left")
    with pytest.raises(ValueError, match="top_k=5"):
        tiny.generate(enc.input_ids, enc.attention_mask, max_new_tokens=4, temperature=1.0, top_k=5,
                      draw="inverse_cdf")
    with pytest.raises(ValueError, match="draw must be one of"):
        tiny.generate(enc.input_ids, enc.attention_mask, max_new_tokens=4, temperature=1.0, draw="gumbel")
    with pytest.raises(ConfigError, match="token_draw must be one of"):
        PPOConfig(token_draw="gumbel").validate()
    with pytest.raises(ConfigError, match="inverse_cdf is for a CPU"):
        PPOConfig(token_draw="inverse_cdf", device="cuda").validate()
    # a resume may not switch the draw; a checkpoint that predates the setting drew with multinomial
    assert PPOConfig(token_draw="inverse_cdf").resume_differences({}) == [
        "token_draw: checkpoint 'multinomial', now 'inverse_cdf'"]
    assert PPOConfig(token_draw="inverse_cdf").resume_differences({"token_draw": "inverse_cdf"}) == []


@pytest.mark.parametrize("old_logprobs", ["recompute", "sampler"])
def test_rollouts_drawn_by_inverse_cdf_train_with_the_samplers_log_probs(tmp_path, prompts, old_logprobs):
    """A run with `token_draw: inverse_cdf` samples other tokens than multinomial's from the same seed, and its
    recorded log-probs are those of the drawn tokens: the first minibatch's gap to the training path is rounding."""
    runs = {}
    for draw in ("multinomial", "inverse_cdf"):
        trainer = build_trainer(tmp_path / draw, MultiAdapterBackend, prompts, SMALL, load_in_4bit=True,
                                merged_rollout=True, old_logprobs=old_logprobs, token_draw=draw)
        runs[draw] = (trainer, [trainer.step() for _ in range(2)])
    (multinomial, _), (inverse, records) = runs["multinomial"], runs["inverse_cdf"]
    assert not torch.equal(multinomial.last_rollout.input_ids, inverse.last_rollout.input_ids)
    assert all(0 <= r["rollout/logprob_gap"] < 1e-4 for r in records)
    assert all(r["ppo/skipped_minibatches"] == 0 for r in records)
