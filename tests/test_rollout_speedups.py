"""The cheaper options of the PPO engine compute what the book's reference paths compute.

- `critic: shared_head` (four models, value head on the actor) equals multi-adapter PPO with `value_mode: shared`;
- `merged_rollout` samples from a dense copy whose distribution equals the training path's, refreshed after
  every update;
- the step record times each phase.
"""

import pytest
import torch
from conftest import build_trainer

from marlhf_edu.errors import ConfigError
from marlhf_edu.math.logprobs import logprobs_from_logits
from marlhf_edu.math.scoring import position_ids_from_mask
from marlhf_edu.memory.plan import MemorySettings, ModelShape, merged_rollout_bytes
from marlhf_edu.ppo import FourModelBackend, PPOConfig
from marlhf_edu.ppo.backends import sequence_logprobs
from marlhf_edu.ppo.distributed import left_pad_to
from marlhf_edu.ppo.merged_rollout import MergedPolicy
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
from marlhf_edu.ppo.trainer import PHASES, TIMING_KEYS, response_mask_from_ids

SMALL = dict(batch_size=8, mini_batch_size=4, micro_batch_size=4, forward_batch_size=8, max_new_tokens=12,
             actor_lora_r=8, actor_lora_alpha=16, device="cpu", eval_repeats=0, learning_rate=1e-3)
#: |log p_merged − log p_adapter| on the tiny model's sampled tokens, fp32: rounding of two orders of summation
#: (x·W0ᵀ + s·x·Aᵀ·Bᵀ against x·(W0 + s·B·A)ᵀ), measured below 2e-6 on the tiny model; NF4 adds nothing (the
#: same dequantized W0 in both)
LOGPROB_TOLERANCE = 1e-4


def build(tmp_path, backend_cls, prompts, **overrides):
    return build_trainer(tmp_path, backend_cls, prompts, SMALL, **overrides)


# ---- critic: shared_head ---------------------------------------------------------------------------------

def test_shared_head_four_model_equals_multi_adapter_shared(tmp_path, prompts):
    """Value head on the actor's last hidden state: four-model PPO with a LoRA actor and `critic: shared_head` is
    MA-PPO with `value_mode: shared` on an fp32 base. Two steps of two minibatches: records and weights agree."""
    four = build(tmp_path, FourModelBackend, prompts, critic="shared_head")
    ma = build(tmp_path, MultiAdapterBackend, prompts, value_mode="shared")
    assert isinstance(four.backend.critic, torch.nn.Linear) and "critic" in four.backend.models()
    assert set(four.backend.parameter_groups()) == {"policy", "value"}
    ma_params = dict(ma.backend.model.named_parameters())
    with torch.no_grad():  # the same LoRA A (B starts at 0 in both)
        for name, p in four.backend.actor.named_parameters():
            if ".lora_" in name:
                ma_params[name.replace(".default.", ".policy.")].copy_(p)
    for step in range(2):
        records = {}
        for key, trainer in (("four", four), ("ma", ma)):
            torch.manual_seed(10 + step)
            records[key] = trainer.step()
        assert len(four.minibatch_stats) == 2 and records["four"]["ppo/skipped_minibatches"] == 0
        for key, value in records["four"].items():
            if key not in TIMING_KEYS:
                assert records["ma"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    moved = 0
    for name, p in four.backend.actor.named_parameters():
        if ".lora_B" in name:
            torch.testing.assert_close(ma_params[name.replace(".default.", ".policy.")], p, rtol=1e-3, atol=1e-6)
            moved += int(p.abs().sum() > 0)
    assert moved > 0
    torch.testing.assert_close(ma.backend.value_head.weight, four.backend.critic.weight, rtol=1e-3, atol=1e-6)


def test_shared_head_value_loss_trains_the_actor(tmp_path, prompts):
    """What makes the head 'shared': the value loss alone sends gradient into the actor's weights."""
    trainer = build(tmp_path, FourModelBackend, prompts, critic="shared_head", actor_lora_r=0)
    r = trainer.rollout(trainer.batch_prompts(0))
    assert torch.equal(r.values, torch.zeros_like(r.values))  # zero-initialised head
    with torch.no_grad():
        trainer.backend.critic.weight.normal_(0, 0.1)
    _, values, _ = trainer.backend.policy_forward(r.input_ids, r.attention_mask, r.n_response, 1.0)
    (values * r.response_mask).pow(2).sum().backward()
    grads = [p.grad for p in trainer.backend.actor.parameters() if p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0
    # and the four-model backend holds no critic backbone at all
    assert sum(p.numel() for p in trainer.backend.critic.parameters()) == trainer.backend.actor.config.hidden_size + 1


def test_critic_option_errors(tmp_path, prompts):
    with pytest.raises(ConfigError, match="critic must be"):
        PPOConfig(critic="shared").validate()
    with pytest.raises(ConfigError, match="critic_init: reward_model needs critic: separate"):
        PPOConfig(critic="shared_head", critic_init="reward_model").validate()
    with pytest.raises(ConfigError, match="value_mode"):
        build(tmp_path, MultiAdapterBackend, prompts, critic="shared_head")


# ---- merged_reward -----------------------------------------------------------------------------------------

def test_merged_reward_scores_as_the_adapter_does(tmp_path, prompts):
    """`merged_reward` folds the reward LoRA into the reward model's own copy of its base: no LoRA layer is left,
    and every score equals the unmerged model's to float rounding (left-padded batch of real rollouts)."""
    plain = build(tmp_path / "plain", FourModelBackend, prompts, critic="shared_head")
    merged = build(tmp_path / "merged", FourModelBackend, prompts, critic="shared_head", merged_reward=True)
    assert any("lora_A" in n for n, _ in plain.backend.reward.named_parameters())
    assert not any("lora" in n for n, _ in merged.backend.reward.named_parameters())
    tok = plain.backend.tokenizer
    batch = tok([p + " yes it is" * k for k, p in enumerate(prompts[:6])], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = plain.backend.scores(batch["input_ids"], batch["attention_mask"])
        b = merged.backend.scores(batch["input_ids"], batch["attention_mask"])
    assert a.shape == (6,) and a.std() > 0.01  # different texts, different scores
    # fp32 rounding of x·W + s·x·A·B against x·(W + s·B·A): measured up to 1.2e-5 on scores near 2 (Intel Xeon)
    torch.testing.assert_close(b, a, rtol=0, atol=5e-5)
    with pytest.raises(ConfigError, match="it needs merged_rollout: true"):
        build(tmp_path / "ma", MultiAdapterBackend, prompts, merged_reward=True)


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_multi_adapter_merged_reward_scores_from_the_copy_and_samples_the_policy(tmp_path, prompts, load_in_4bit):
    """Multi-adapter `merged_reward`: the reward adapter is merged into the merged_rollout copy to score (the scores
    equal the adapter path's to float rounding), and merged out again before the next sample (the copy samples
    the policy: the logged gap stays at rounding); the base is never touched."""
    common = dict(load_in_4bit=load_in_4bit, merged_rollout=True)
    plain = build(tmp_path / "plain", MultiAdapterBackend, prompts, **common)
    merged = build(tmp_path / "merged", MultiAdapterBackend, prompts, merged_reward=True, **common)
    base_before = {n: p.detach().clone() for n, p in merged.backend.model.named_parameters() if "lora_" not in n}
    tok = plain.backend.tokenizer
    batch = tok([p + " yes it is" * k for k, p in enumerate(prompts[:6])], return_tensors="pt", padding=True,
                padding_side="left")
    with torch.no_grad():
        a = plain.backend.scores(batch["input_ids"], batch["attention_mask"])
        b = merged.backend.scores(batch["input_ids"], batch["attention_mask"])
    assert a.std() > 0.01 and merged.backend._merged.holds == "reward"
    torch.testing.assert_close(b, a, rtol=0, atol=5e-5)
    _perturb_policy(*merged.backend.lora_policy())  # a policy unlike the base and the reward adapter
    merged.backend.policy_changed()
    r = merged.rollout(merged.batch_prompts(0))
    assert merged.backend._merged.holds == "reward"  # scored after sampling
    assert 0 <= float(r.logprob_gap) < LOGPROB_TOLERANCE  # yet the tokens were drawn from the policy's merge
    assert merged.backend.sampling_model() is merged.backend._merged.model and merged.backend._merged.holds == "policy"
    for n, p in merged.backend.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p.detach(), base_before[n]), n


def test_planner_counts_the_merged_reward_model():
    from marlhf_edu.memory.plan import lora_params, plan_four_model

    shape, s = ModelShape.resolve("zoo"), MemorySettings(critic="shared_head", reward_lora_r=8)
    plain, merged = plan_four_model(shape, s), plan_four_model(shape, MemorySettings(**{**vars(s), "merged_reward": True}))
    saved = plain.per_model["reward"] - merged.per_model["reward"]
    # the LoRA (fp32) of every layer and peft's second copy of the score head (fp32 weights) are gone
    assert saved == shape.num_layers * lora_params(shape, 8, s.reward_targets) * 4 + shape.hidden_size * 4
    assert plain.parts["adapters"] - merged.parts["adapters"] == saved
    with pytest.raises(ConfigError, match="a 4-bit base cannot hold it"):
        plan_four_model(shape, MemorySettings(critic="shared_head", load_in_4bit=True, merged_reward=True))


# ---- merged_rollout ----------------------------------------------------------------------------------------

def _perturb_policy(peft_model, adapter, seed=3):
    """Non-zero LoRA B (it starts at 0, which would make the merge trivially exact)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name and f".{adapter}." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _max_logprob_gap(trainer, model):
    r = trainer.rollout(trainer.batch_prompts(0))
    with torch.no_grad():
        train_path, _, _ = trainer.backend.policy_forward(r.input_ids, r.attention_mask, r.n_response, 1.0)
        copy, _ = sequence_logprobs(model, r.input_ids, r.attention_mask, r.n_response, 1.0)
    return float(((train_path - copy) * r.response_mask).abs().max())


@pytest.mark.parametrize("backend_cls, overrides", [
    (MultiAdapterBackend, dict(load_in_4bit=True)),  # NF4 base: the copy is dequantized
    (MultiAdapterBackend, dict(load_in_4bit=False)),
    (FourModelBackend, dict()),
])
def test_merged_copy_has_the_training_paths_distribution(tmp_path, prompts, backend_cls, overrides):
    trainer = build(tmp_path, backend_cls, prompts, **overrides)
    peft_model, adapter = trainer.backend.lora_policy()
    _perturb_policy(peft_model, adapter)
    merged = MergedPolicy(peft_model, adapter)
    assert all(not p.requires_grad for p in merged.model.parameters())
    assert all(p.dtype == torch.float32 for p in merged.model.parameters())
    assert _max_logprob_gap(trainer, merged.model) < LOGPROB_TOLERANCE
    # the check can fail: the base alone (adapter not merged) is far off
    with peft_model.disable_adapter():
        plain = MergedPolicy(peft_model, "no-such-adapter")
    assert _max_logprob_gap(trainer, plain.model) > 100 * LOGPROB_TOLERANCE
    # the copy's size is what the planner charges: every weight in fp32, plus RoPE's buffers
    shape = ModelShape.from_config(merged.model.config.to_dict())
    assert merged.nbytes() == merged_rollout_bytes(shape, MemorySettings(merged_rollout=True))


def test_merged_rollout_is_refreshed_after_every_update(tmp_path, prompts):
    trainer = build(tmp_path, MultiAdapterBackend, prompts, load_in_4bit=True, merged_rollout=True)
    merged = trainer.backend._merged
    assert merged is not None and not merged.stale
    record = trainer.step()
    # the first minibatch still sees ratio 1: log-probs come from the training path, sampled by the copy
    assert trainer.minibatch_stats[0]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert merged.stale and record["ppo/skipped_minibatches"] == 0  # the update moved the policy
    model = trainer.backend.sampling_model()
    assert model is merged.model and not merged.stale
    assert _max_logprob_gap(trainer, model) < LOGPROB_TOLERANCE
    # a loaded checkpoint marks it stale too
    trainer.backend.load_trainable_state_dict(trainer.backend.trainable_state_dict())
    assert merged.stale


def test_merged_rollout_needs_a_lora_policy(tmp_path, prompts):
    with pytest.raises(ConfigError, match="merged_rollout needs a LoRA policy"):
        build(tmp_path, FourModelBackend, prompts, actor_lora_r=0, merged_rollout=True)


# ---- phase timing --------------------------------------------------------------------------------------------

def test_step_record_times_every_phase(tmp_path, prompts):
    trainer = build(tmp_path, FourModelBackend, prompts)
    record = trainer.step()
    phases = [record[f"time/{p}_s"] for p in PHASES]
    assert all(t > 0 for t in phases)
    assert sum(phases) <= record["time/step_s"] * 1.001
    assert record["time/rollout_s"] >= sum(phases[:-1]) * 0.999
    assert set(TIMING_KEYS) <= set(record)


def test_merged_copy_of_a_tied_model_stays_tied():
    """SmolLM2 ties its LM head to the embeddings. The copy is built without random init (which also skips the
    tying): it must be tied again, or it would hold a second vocabulary matrix the planner does not count."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, tie_word_embeddings=True)
    base = LlamaForCausalLM(config).eval()
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _perturb_policy(policy, "default")
    merged = MergedPolicy(policy, "default")
    model = merged.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    shape = ModelShape.from_config(config.to_dict(), name="tied")
    assert merged.nbytes() == merged_rollout_bytes(shape, MemorySettings(merged_rollout=True))
    assert merged.nbytes() - 4 * shape.n_params < 4 * 64  # the vocabulary matrix counted once: only buffers beyond
    ids = torch.randint(0, 300, (3, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-4, rtol=0)


# ---- what a GPU changes: batch shapes and a separate sampler (issue 34) ------------------------------------------

def test_old_logprobs_are_computed_in_the_updates_rows_per_forward(tmp_path, prompts):
    """bf16 kernels round differently for different batch shapes (H100, 7B: 16 rows vs 1 differ by 0.033 per token
    on average, benchmarks/gpu_check.json), so the rollout computes the old log-probs in micro_batch_size rows, as
    the update does: the first minibatch's ratio is then exactly 1 on a GPU too."""
    trainer = build(tmp_path, MultiAdapterBackend, prompts, micro_batch_size=2)
    rows, real = [], trainer.backend.policy_forward

    def recording(input_ids, *a, **k):
        rows.append(input_ids.shape[0])
        return real(input_ids, *a, **k)

    trainer.backend.policy_forward = recording
    trainer.rollout(trainer.batch_prompts(0))
    assert rows == [2] * 4  # 8 rollouts, forward_batch_size 8, micro_batch_size 2


@pytest.mark.parametrize("top_k", [0, 5])
def test_the_sampler_records_the_log_probs_it_drew_each_token_with(tmp_path, prompts, top_k):
    """`generate(..., with_logprobs=True)` returns log softmax(z/T) of each drawn token from the decode itself: the
    same tokens as without it, and the copy's full forward gives the same numbers (fp32 on CPU). Top-k truncation
    is not in them (π_train has none)."""
    trainer = build(tmp_path, MultiAdapterBackend, prompts, load_in_4bit=False, merged_rollout=True)
    be = trainer.backend
    _perturb_policy(*be.lora_policy())
    be.policy_changed()
    enc = be.tokenizer(prompts[:6], return_tensors="pt", padding=True, padding_side="left")
    sampling = dict(max_new_tokens=12, temperature=0.7, top_k=top_k)
    torch.manual_seed(0)
    ids, drawn = be.generate(enc.input_ids, enc.attention_mask, with_logprobs=True, **sampling)
    torch.manual_seed(0)
    assert torch.equal(be.generate(enc.input_ids, enc.attention_mask, **sampling), ids)
    P = enc.input_ids.shape[1]
    response_mask = response_mask_from_ids(ids[:, P:], be.tokenizer.eos_token_id)
    mask = torch.cat([enc.attention_mask.bool(), response_mask], dim=1).long()
    with torch.no_grad():
        full, _ = sequence_logprobs(be.sampling_model(), ids, mask, ids.shape[1] - P, 0.7)
    assert drawn.shape == full.shape and drawn.dtype == torch.float32
    assert float(((drawn - full).abs() * response_mask).max()) < LOGPROB_TOLERANCE
    assert float((full * response_mask).min()) < -0.5  # not trivially 0: the tokens had real alternatives


def test_a_separate_sampler_logs_its_gap_to_the_training_path(tmp_path, prompts):
    """`rollout/logprob_gap`: mean |log π_sampler − log π_train| over response tokens, when sampling from the merged
    copy; absent when the policy samples itself."""
    plain = build(tmp_path / "plain", MultiAdapterBackend, prompts, load_in_4bit=True)
    assert "rollout/logprob_gap" not in plain.step()
    trainer = build(tmp_path / "merged", MultiAdapterBackend, prompts, load_in_4bit=True, merged_rollout=True)
    peft_model, adapter = trainer.backend.lora_policy()
    _perturb_policy(peft_model, adapter)
    trainer.backend.policy_changed()
    r = trainer.rollout(trainer.batch_prompts(0))
    m = r.response_mask
    with torch.no_grad():
        sampler, _ = sequence_logprobs(trainer.backend.sampling_model(), r.input_ids, r.attention_mask, r.n_response, 1.0)
    expected = float(((sampler - r.logprobs).abs() * m).sum() / m.sum())
    # π_sampler is what the decode drew with; one full forward of the copy gives it up to fp32 rounding
    assert float(r.logprob_gap) == pytest.approx(expected, abs=1e-5)
    assert 0 <= float(r.logprob_gap) < LOGPROB_TOLERANCE  # fp32 on CPU: the copy equals the training path
    # it measures the copy it sampled from: a stale copy (the perturbation not merged in) shows a large gap
    trainer.backend._merged.stale = False
    _perturb_policy(peft_model, adapter, seed=4)
    assert trainer.rollout_stats(trainer.rollout(trainer.batch_prompts(1)))["rollout/logprob_gap"] > 10 * LOGPROB_TOLERANCE


def test_truncated_importance_sampling_weights_each_token_by_the_capped_ratio(tmp_path, prompts):
    """`tis_cap`: each answer token's policy loss is weighted by min(π_train/π_sampler, tis_cap), computed from the
    copy the tokens were drawn from; 1 for a fresh fp32 copy; the update uses the weights (a weight of 2 doubles the
    policy loss, which is the clipped surrogate with advantages 2·A)."""
    import dataclasses

    trainer = build(tmp_path, MultiAdapterBackend, prompts, load_in_4bit=True, merged_rollout=True, tis_cap=2.0)
    peft_model, adapter = trainer.backend.lora_policy()
    _perturb_policy(peft_model, adapter)
    trainer.backend.policy_changed()
    r = trainer.rollout(trainer.batch_prompts(0))
    m = r.response_mask
    assert float(((r.tis_weights - 1).abs() * m).max()) < LOGPROB_TOLERANCE  # the copy is the policy
    assert float((r.tis_weights * ~m).abs().max()) == 0.0
    stats = trainer.rollout_stats(r)
    assert stats["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=LOGPROB_TOLERANCE)
    # a stale copy: tokens drawn from another distribution, weighted by the capped ratio
    trainer.backend._merged.stale = False
    _perturb_policy(peft_model, adapter, seed=4)
    r = trainer.rollout(trainer.batch_prompts(1))
    m = r.response_mask
    with torch.no_grad():
        sampler, _ = sequence_logprobs(trainer.backend.sampling_model(), r.input_ids, r.attention_mask, r.n_response, 1.0)
    expected = torch.where(m, (r.logprobs - sampler).exp().clamp(max=2.0), 0.0)
    assert torch.allclose(r.tis_weights, expected, rtol=1e-4, atol=1e-5)
    assert float(((r.tis_weights - 1).abs() * m).max()) > 100 * LOGPROB_TOLERANCE and float(r.tis_weights.max()) <= 2.0
    # the update reads them
    rows = torch.arange(4)
    losses = {}
    for label, w in (("one", torch.where(m, 1.0, 0.0)), ("two", torch.where(m, 2.0, 0.0))):
        torch.manual_seed(0)
        _, s = trainer.micro_batch_loss(dataclasses.replace(r, tis_weights=w), rows)
        losses[label] = float(s["loss/policy"])
    torch.manual_seed(0)
    _, s = trainer.micro_batch_loss(dataclasses.replace(r, tis_weights=None), rows)
    assert losses["one"] == pytest.approx(float(s["loss/policy"]), rel=1e-6)
    assert losses["two"] == pytest.approx(2 * losses["one"], rel=1e-5) and losses["one"] != 0.0


def test_truncated_importance_sampling_needs_a_cap_of_at_least_one():
    with pytest.raises(ConfigError, match="the cap must be >= 1"):
        PPOConfig(tis_cap=0.5, merged_rollout=True).validate()
    PPOConfig(tis_cap=2.0, merged_rollout=True).validate()
    PPOConfig(tis_cap=2.0).validate()  # the policy sampling itself: its decode against its forward


def test_a_policy_sampling_itself_records_its_sampler_under_tis(tmp_path, prompts):
    """With `tis_cap` and no merged copy, π_sampler is the policy's own decode: recorded, its gap to the training
    forward logged (fp32: rounding only) and the weights 1 up to it; without `tis_cap` nothing is recorded."""
    trainer = build(tmp_path, MultiAdapterBackend, prompts, load_in_4bit=True, tis_cap=2.0)
    peft_model, adapter = trainer.backend.lora_policy()
    _perturb_policy(peft_model, adapter)
    r = trainer.rollout(trainer.batch_prompts(0))
    m = r.response_mask
    assert r.logprob_gap is not None and 0 <= float(r.logprob_gap) < LOGPROB_TOLERANCE
    assert float(((r.tis_weights - 1).abs() * m).max()) < LOGPROB_TOLERANCE
    stats = trainer.rollout_stats(r)
    assert "rollout/logprob_gap" in stats and "rollout/tis_weight_mean" in stats


# ---- old_logprobs: sampler ----------------------------------------------------------------------------------

def _perturb_value_head(backend, seed=5):
    """A non-zero value head (it starts at 0, which would make every value trivially equal)."""
    g = torch.Generator().manual_seed(seed)
    head = backend.sampler_value_head()  # the multi-adapter value head, or the four-model shared head
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g))
        head.bias.fill_(0.3)


def test_the_recorders_entropy_is_the_distributions_with_masked_tokens_adding_nothing():
    """`SampledLogprobs(entropy=True)` keeps H(softmax(z/T)) of each step; a token a processor masked to −inf adds 0
    (0·log 0), not NaN."""
    from marlhf_edu.math.logprobs import entropy_from_logits
    from marlhf_edu.ppo.merged_rollout import SampledLogprobs

    z = torch.randn(4, 3, 50, generator=torch.Generator().manual_seed(0)) * 3
    z[0, 1, :20] = -float("inf")
    recorder = SampledLogprobs(0.7, entropy=True)
    ids = torch.zeros(4, 1, dtype=torch.long)
    for t in range(3):
        recorder(ids, z[:, t])
        ids = torch.cat([ids, torch.ones(4, 1, dtype=torch.long)], dim=1)
    recorder.finish(ids)
    expected = entropy_from_logits(z.masked_fill(z == -float("inf"), -1e30) / 0.7)
    assert recorder.entropy.shape == (4, 3) and torch.isfinite(recorder.entropy).all()
    assert torch.allclose(recorder.entropy, expected, atol=1e-5)
    assert float(recorder.entropy[0, 1]) < float(recorder.entropy[0, 0])  # fewer tokens left: less entropy


def _perturb_actor(actor, seed=6):
    """A fully trained actor moved off the SFT weights (so that the value head and the reference see another model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


MA = dict(load_in_4bit=True)
FOUR = dict(critic="shared_head")


@pytest.mark.parametrize("backend_cls, overrides", [
    (MultiAdapterBackend, dict(MA, merged_rollout=True)),
    (MultiAdapterBackend, dict(MA, merged_rollout=False)),  # the policy decoding itself
    (MultiAdapterBackend, dict(MA, merged_rollout=True, forward_batch_size=4)),  # two chunks, answers of two widths
    (MultiAdapterBackend, dict(MA, merged_rollout=True, rollout_cache="static")),  # prompts padded further, cut again
    (MultiAdapterBackend, dict(MA, merged_rollout=True, merged_reward=True)),  # the copy holds the reward adapter
    (FourModelBackend, dict(FOUR, merged_rollout=True)),  # a LoRA actor's merged copy, the head on the actor
    (FourModelBackend, dict(FOUR)),  # a LoRA actor decoding itself
    (FourModelBackend, dict(FOUR, actor_lora_r=0)),  # a fully trained actor decoding itself
])
def test_the_sampler_records_what_the_policy_forward_would_give(tmp_path, prompts, backend_cls, overrides):
    """`old_logprobs: sampler`: the rollout's log-probs, values and entropy are recorded while decoding, and equal
    the training path's no-grad forward over the sampled rows up to fp32 rounding (merged copy or the policy
    decoding itself); zero after each answer, and the policy phase never runs."""
    trainer = build(tmp_path, backend_cls, prompts, old_logprobs="sampler", **overrides)
    be = trainer.backend
    if overrides.get("merged_reward"):  # score once first: the copy then holds the reward adapter when sampling
        trainer.rollout(trainer.batch_prompts(1))
    if overrides.get("actor_lora_r") == 0:
        _perturb_actor(be.actor)
    else:
        _perturb_policy(*be.lora_policy())
    _perturb_value_head(be)
    be.policy_changed()
    trainer.timer.seconds.clear()
    r = trainer.rollout(trainer.batch_prompts(0))
    assert "policy" not in trainer.timer.seconds
    m = r.response_mask
    assert (~m).any()  # some answer ended early: the zeros after it are checked below
    with torch.no_grad():
        lp, v, ent = trainer._policy_forward(r.input_ids, r.attention_mask, r.n_response, with_entropy=True)
    for name, recorded, forward in (("logprobs", r.logprobs, lp), ("values", r.values, v), ("entropy", r.entropy, ent)):
        assert recorded.shape == forward.shape, name
        assert float(((recorded - forward).abs() * m).max()) < LOGPROB_TOLERANCE, name
        assert float((recorded * ~m).abs().max()) == 0.0, name
    # not trivially equal: real alternatives, values that vary from token to token
    assert float((r.logprobs * m).min()) < -0.5 and float((r.entropy * m).max()) > 0.5
    assert float(r.values[m].std()) > 0.1


@pytest.mark.parametrize("backend_cls, overrides", [
    (MultiAdapterBackend, dict(MA, merged_rollout=True)),
    (FourModelBackend, dict(FOUR, actor_lora_r=0, merged_reward=True)),  # the shape compare_trl times
])
def test_old_logprobs_from_the_sampler_train_as_the_recomputed_ones(tmp_path, prompts, backend_cls, overrides):
    """Two runs of one seed, the old log-probs recorded by the sampler or recomputed: the same sampled tokens
    and, to fp32 rounding, the same statistics, losses and first-minibatch ratio; the sampler's run logs the gap its
    first minibatch (at the rollout's weights) measured, one forward a step fewer."""
    runs = {}
    for mode in ("recompute", "sampler"):
        trainer = build(tmp_path / mode, backend_cls, prompts, old_logprobs=mode, **overrides)
        runs[mode] = (trainer, [trainer.step() for _ in range(2)])
    (recompute, a), (sampler, b) = runs["recompute"], runs["sampler"]
    assert torch.equal(recompute.last_rollout.input_ids, sampler.last_rollout.input_ids)
    for key in ("kl/k1", "score/mean", "policy/entropy", "value/mean", "loss/policy", "loss/value",
                "policy/ratio_max"):
        for step in range(2):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (key, step)
    assert all(0 <= record["rollout/logprob_gap"] < LOGPROB_TOLERANCE for record in b)
    assert "time/policy_s" in b[0] and b[0]["time/policy_s"] == 0.0 < a[0]["time/policy_s"]


def test_the_first_minibatch_measures_the_samplers_gap(tmp_path, prompts):
    """The gap `old_logprobs: sampler` logs is mean |log π_train − log π_sampler| over the first minibatch's answer
    tokens; a stale copy (the policy changed, the copy not rebuilt) shows it."""
    trainer = build(tmp_path, MultiAdapterBackend, prompts, load_in_4bit=True, merged_rollout=True,
                    old_logprobs="sampler")
    peft_model, adapter = trainer.backend.lora_policy()
    trainer.backend._merged.stale = False
    _perturb_policy(peft_model, adapter, seed=4)  # the copy keeps the zero LoRA: it samples the SFT model
    r = trainer.rollout(trainer.batch_prompts(0))
    shuffle_state = trainer.shuffle.get_state()  # the update's first minibatch: its rows, drawn as it will draw them
    first = torch.randperm(len(r.input_ids), generator=trainer.shuffle)[:trainer.config.mini_batch_size]
    trainer.shuffle.set_state(shuffle_state)
    with torch.no_grad():
        lp, _, _ = trainer._policy_forward(r.input_ids[first], r.attention_mask[first], r.n_response, with_entropy=False)
    m = r.response_mask[first]
    expected = float(((lp - r.logprobs[first]).abs() * m).sum() / m.sum())
    out = trainer.update(r)
    assert out["rollout/logprob_gap"] == pytest.approx(expected, rel=1e-4)
    assert out["rollout/logprob_gap"] > 10 * LOGPROB_TOLERANCE


@pytest.mark.parametrize("overrides, match", [
    (dict(value_mode="adapter"), "needs value_mode: shared"),
    (dict(nf4_compute_dtype="bfloat16", load_in_4bit=True), "fp32 products on the CPU"),
    (dict(tis_cap=2.0), "tis_cap: 0"),
    (dict(device="cuda"), "fp32 products on the CPU"),
])
def test_old_logprobs_from_the_sampler_refuses_what_it_cannot_stand_in_for(overrides, match):
    config = PPOConfig(old_logprobs="sampler", **{**SMALL, **overrides})
    with pytest.raises(ConfigError, match=match):
        config.validate()
        MultiAdapterBackend.check_config(config)
    config = PPOConfig(old_logprobs="sampler", **SMALL).validate()  # the same settings without the override pass
    MultiAdapterBackend.check_config(config)


def test_old_logprobs_names_its_modes_and_the_critic_it_needs():
    with pytest.raises(ConfigError, match="needs critic: shared_head"):
        FourModelBackend.check_config(PPOConfig(old_logprobs="sampler", critic="separate", **SMALL))
    FourModelBackend.check_config(PPOConfig(old_logprobs="sampler", critic="shared_head", **SMALL))
    with pytest.raises(ConfigError, match="old_logprobs must be one of"):
        PPOConfig(old_logprobs="policy").validate()


def test_sampling_refuses_hidden_states_it_cannot_match_to_tokens(tmp_path, prompts):
    """`sample(with_outputs=True)` pairs the decoder's k-th call with the k-th new token; a decoder called another
    number of times (a transformers change) is an error, never a silent shift of every value."""
    from marlhf_edu.ppo.backends import sample

    trainer = build(tmp_path, MultiAdapterBackend, prompts, load_in_4bit=False, merged_rollout=True)
    be = trainer.backend
    model = be.sampling_model()
    enc = be.tokenizer(prompts[:2], return_tensors="pt", padding=True, padding_side="left")
    sample(model, be.tokenizer, enc.input_ids, enc.attention_mask, max_new_tokens=4, temperature=1.0, with_outputs=True)
    real_forward = model.forward

    def forward_twice(*args, **kwargs):  # an extra decoder call per step, as a changed generate might make
        model.get_decoder()(input_ids=kwargs["input_ids"][:, -1:], use_cache=False)
        return real_forward(*args, **kwargs)

    model.forward = forward_twice
    try:
        with pytest.raises(RuntimeError, match="decoder calls for"):
            sample(model, be.tokenizer, enc.input_ids, enc.attention_mask, max_new_tokens=4, temperature=1.0,
                   with_outputs=True)
    finally:
        del model.forward


# ---- rollout_cache: static -----------------------------------------------------------------------------------

def test_static_cache_samples_the_dynamic_caches_tokens(tmp_path, prompts):
    """The merged copy with a static KV cache (`rollout_cache: static`, compiled on CUDA) gives the tokens the
    dynamic cache gives on a CPU: greedy and sampled from one seed, on left-padded prompts of several widths (the
    static cache is longer than the prompt: its unused slots must be masked out)."""
    trainer = build(tmp_path, MultiAdapterBackend, prompts, load_in_4bit=True)
    peft_model, adapter = trainer.backend.lora_policy()
    _perturb_policy(peft_model, adapter)
    dynamic, static = MergedPolicy(peft_model, adapter), MergedPolicy(peft_model, adapter, cache="static")
    assert static.model.generation_config.cache_implementation == "static"
    tok = trainer.tokenizer
    batch = tok(trainer.batch_prompts(0), return_tensors="pt", padding=True, padding_side="left")
    for extra in (0, 7):  # the batch's own width, then more left padding (as the trainer pads for a static cache)
        ids, mask = left_pad_to(batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1] + extra,
                                tok.pad_token_id)
        enc = dict(input_ids=ids, attention_mask=mask)
        for kwargs in (dict(do_sample=False), dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)):
            out = []
            for merged in (dynamic, static):
                torch.manual_seed(5)
                out.append(merged.model.generate(**enc, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                                                 eos_token_id=tok.eos_token_id, **kwargs))
            assert torch.equal(out[0], out[1]), (extra, kwargs)
    # the check can fail: another adapter's copy samples other tokens
    _perturb_policy(peft_model, adapter, seed=9)
    static.refresh()
    torch.manual_seed(5)
    moved = static.model.generate(**enc, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, do_sample=False)
    assert not torch.equal(moved, out[0])


def test_static_rollout_cache_trains_as_the_dynamic_one(tmp_path, prompts):
    """Two steps of MA-PPO with `rollout_cache: static` give the records of `rollout_cache: dynamic` (on a CPU nothing
    is compiled; the static path pads prompts to max_prompt_length and strips the padding again), and it needs
    merged_rollout."""
    records = {}
    for cache in ("dynamic", "static"):
        trainer = build(tmp_path / cache, MultiAdapterBackend, prompts, load_in_4bit=True, merged_rollout=True,
                        rollout_cache=cache, rollout_seeding="per_chunk")
        assert trainer.backend._merged.cache == cache
        records[cache] = [trainer.step() for _ in range(2)]
    for a, b in zip(records["dynamic"], records["static"]):
        for key in ("score/mean", "kl/k1", "response/length", "loss/total", "rollout/logprob_gap"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    with pytest.raises(ConfigError, match="rollout_cache: static .* needs merged_rollout"):
        PPOConfig(rollout_cache="static").validate()
    with pytest.raises(ConfigError, match="rollout_cache must be one of"):
        PPOConfig(rollout_cache="paged", merged_rollout=True).validate()


# ---- the LM head sees contiguous rows ---------------------------------------------------------------------

@pytest.mark.parametrize("backend_cls, overrides", [
    (MultiAdapterBackend, {}),
    (FourModelBackend, {}),
    (FourModelBackend, {"critic": "shared_head", "actor_lora_r": 0}),
])
def test_the_lm_head_runs_on_contiguous_response_positions(tmp_path, prompts, backend_cls, overrides):
    """Every forward that needs log-probs hands the LM head the R positions before the response tokens as one
    contiguous (B, R, H) tensor: a strided slice runs as B products against an expanded weight (`bmm`), 1.8x the
    time on a CPU. The logits equal the whole model's logits at those positions, divided by the temperature."""
    trainer = build(tmp_path, backend_cls, prompts, **overrides)
    be, cfg = trainer.backend, trainer.config
    torch.manual_seed(1)
    r = trainer.rollout(trainer.batch_prompts(0))
    ids, mask, R = r.input_ids, r.attention_mask, r.n_response
    seen = []
    heads = {id(m.get_output_embeddings()): m.get_output_embeddings() for m in be.models().values()
             if hasattr(m, "get_output_embeddings") and m.get_output_embeddings() is not None}
    hooks = [h.register_forward_pre_hook(lambda mod, args: seen.append(args[0])) for h in heads.values()]
    try:
        logprobs, _, _ = be.policy_forward(ids, mask, R, cfg.temperature)
        ref = be.reference_logprobs(ids, mask, R, cfg.temperature)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) >= 2 and all(x.is_contiguous() and tuple(x.shape[:2]) == (ids.shape[0], R) for x in seen)
    # the same log-probs from the model's own logits at every position (the policy adapter is the one active)
    with torch.no_grad():
        full = be.policy_model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                               use_cache=False).logits
    want = logprobs_from_logits(full[:, -R - 1:-1] / cfg.temperature, ids[:, -R:])
    m = r.response_mask
    assert (logprobs[m].float() - want[m]).abs().max() < LOGPROB_TOLERANCE
    assert (ref[m] - r.ref_logprobs[m]).abs().max() < LOGPROB_TOLERANCE


def test_nf4_dequantize_once_trains_bit_for_bit_as_bitsandbytes(tmp_path, prompts):
    """`nf4_dequantize_once`: two MA-PPO steps on an NF4 base give the records and adapter weights of bitsandbytes'
    own layers exactly (rollout, reference, reward, update all read the kept weights)."""
    import bitsandbytes as bnb

    plain = build(tmp_path / "plain", MultiAdapterBackend, prompts, load_in_4bit=True)
    expected = [plain.step() for _ in range(2)]  # each trainer seeded when built; one random stream per run
    once = build(tmp_path / "once", MultiAdapterBackend, prompts, load_in_4bit=True, nf4_dequantize_once=True)
    got = [once.step() for _ in range(2)]
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert [drop(r) for r in expected] == [drop(r) for r in got]
    layers = [m for m in once.backend.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all("_dequantized" in m.__dict__ for m in layers)
    assert not any("_dequantized" in m.__dict__ for m in plain.backend.model.modules())
    weights = dict(once.backend.model.named_parameters())
    assert all(torch.equal(p, weights[n]) for n, p in plain.backend.model.named_parameters() if p.requires_grad)


def test_the_bf16_smollm2_config_is_the_shipped_one_but_for_its_precision_settings(tmp_path):
    """configs/smollm2/ma_ppo_bf16.yaml differs from ma_ppo.yaml only where its header says; it validates on a CPU
    with bf16 matrix kernels and is refused, naming the fp32 config, on one without."""
    import yaml

    from marlhf_edu.loading.cpu_products import native_low_precision_products
    from marlhf_edu.training.args import parse_stage_args

    shipped, fast = (yaml.safe_load(open(f"configs/smollm2/{name}.yaml")) for name in ("ma_ppo", "ma_ppo_bf16"))
    changed = {k: (shipped.get(k), fast.get(k)) for k in shipped.keys() | fast.keys() if shipped.get(k) != fast.get(k)}
    assert changed == {"output_dir": ("runs/smollm2/ma_ppo", "runs/smollm2/ma_ppo_bf16"),
                       "nf4_compute_dtype": (None, "bfloat16"), "merged_rollout": (True, False),
                       "tis_cap": (None, 2.0), "onednn_matmuls": (True, False),
                       "old_logprobs": ("sampler", "recompute")}
    assert shipped["nf4_dequantize_once"] is True and fast["nf4_dequantize_once"] is True
    for name in ("ma_ppo", "ma_ppo_bf16"):
        (config,) = parse_stage_args((PPOConfig,), ["--config", f"configs/smollm2/{name}.yaml",
                                                    "--output_dir", str(tmp_path / name)])
        if name == "ma_ppo_bf16" and not native_low_precision_products(torch.bfloat16):
            with pytest.raises(ConfigError, match="no bf16 matrix kernels.*ma_ppo.yaml"):
                config.validate()
        else:
            config.validate()
