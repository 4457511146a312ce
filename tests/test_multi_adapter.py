"""Multi-adapter PPO computes what four-model PPO computes, and trains only what it should."""

import pytest
import torch
from conftest import build_trainer

from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.loading.adapters import load_score_head
from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR
from marlhf_edu.loading.models import load_reward_model, load_sft_model
from marlhf_edu.math.scoring import sequence_scores
from marlhf_edu.ppo import FourModelBackend, PPOConfig
from marlhf_edu.ppo.backends import sequence_logprobs
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

SMALL = dict(batch_size=8, mini_batch_size=8, micro_batch_size=4, forward_batch_size=8, max_new_tokens=12,
             actor_lora_r=8, actor_lora_alpha=16, device="cpu", eval_repeats=0, learning_rate=1e-3)


def build(tmp_path, backend_cls, prompts, **overrides):
    return build_trainer(tmp_path, backend_cls, prompts, SMALL, **overrides)


@pytest.mark.slow
def test_first_minibatch_matches_four_model_ppo_with_a_shared_head(tmp_path, prompts):
    """`shared` trains the policy adapter with the value loss too, so it equals four-model PPO only up to the first
    optimizer step: compare the rollout statistics and the first minibatch's losses."""
    stats, first = {}, {}
    for cls in (FourModelBackend, MultiAdapterBackend):
        trainer = build(tmp_path, cls, prompts, value_mode="shared")
        torch.manual_seed(1)
        stats[cls] = trainer.rollout_stats(trainer.rollout(trainer.batch_prompts(0)))
        torch.manual_seed(1)
        trainer.step()
        first[cls] = trainer.minibatch_stats[0]
    for key in stats[FourModelBackend]:
        assert stats[MultiAdapterBackend][key] == pytest.approx(stats[FourModelBackend][key], rel=1e-5, abs=1e-6), key
    for key in first[FourModelBackend]:
        assert first[MultiAdapterBackend][key] == pytest.approx(first[FourModelBackend][key], rel=1e-5, abs=1e-6), key


def _copy_lora_a(four: FourModelBackend, ma: MultiAdapterBackend) -> None:
    """Give MA-PPO's policy and value adapters the four-model actor's and critic's LoRA A matrices (B is 0 in both)."""
    ma_params = dict(ma.model.named_parameters())
    with torch.no_grad():
        for prefix, module, adapter in (("", four.actor, "policy"), ("model.", four.critic.backbone, "value")):
            for name, p in module.named_parameters():
                if ".lora_" in name:
                    target = name.replace("base_model.model.", "base_model.model." + prefix).replace(".default.", f".{adapter}.")
                    ma_params[target].copy_(p)


@pytest.mark.slow
def test_two_steps_with_two_minibatches_match_four_model_ppo(tmp_path, prompts):
    """With a value adapter, MA-PPO is four-model PPO with LoRA actor and critic on one fp32 base: after two steps
    of two minibatches each (four optimizer steps), the records and the trained weights agree."""
    trainers = {cls: build(tmp_path, cls, prompts, value_mode="adapter", mini_batch_size=4)
                for cls in (FourModelBackend, MultiAdapterBackend)}
    four, ma = trainers[FourModelBackend], trainers[MultiAdapterBackend]
    _copy_lora_a(four.backend, ma.backend)
    for step in range(2):
        records = {}
        for cls, trainer in trainers.items():
            torch.manual_seed(10 + step)
            records[cls] = trainer.step()
        assert records[FourModelBackend]["ppo/skipped_minibatches"] == 0 and len(four.minibatch_stats) == 2
        for key, value in records[FourModelBackend].items():
            if not key.startswith("time/"):
                assert records[MultiAdapterBackend][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    ma_params = dict(ma.backend.model.named_parameters())
    moved = 0
    for prefix, module, adapter in (("", four.backend.actor, "policy"), ("model.", four.backend.critic.backbone, "value")):
        for name, p in module.named_parameters():
            if ".lora_B" in name:
                target = name.replace("base_model.model.", "base_model.model." + prefix).replace(".default.", f".{adapter}.")
                torch.testing.assert_close(ma_params[target], p, rtol=1e-3, atol=1e-6, msg=target)
                moved += int(p.abs().sum() > 0)
    assert moved > 0
    torch.testing.assert_close(ma.backend.value_head.weight, four.backend.critic.value_head.weight, rtol=1e-3, atol=1e-6)


def _texts_batch(tokenizer, side):
    world = ToyWorld()
    texts = [p["prompt"] + p["chosen"] + tokenizer.eos_token for p in world.eval_pairs(6)]
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side=side)


@pytest.mark.parametrize("side", ["left", "right"])
def test_reward_adapter_scores_equal_standalone_reward_model(tmp_path, prompts, side):
    trainer = build(tmp_path, MultiAdapterBackend, prompts)
    reward, tok = load_reward_model()
    enc = _texts_batch(tok, side)
    with torch.no_grad():
        expected = sequence_scores(reward, enc["input_ids"], enc["attention_mask"])
    got = trainer.backend.scores(enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_score_head_must_be_in_the_adapter(tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(REWARD_ADAPTER_DIR / "adapter_model.safetensors"))
    save_file({k: v for k, v in state.items() if "score" not in k}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="expected one score-head weight"):
        load_score_head(tmp_path, 192)
    head = load_score_head(REWARD_ADAPTER_DIR, 192)
    assert torch.equal(head.weight, state["base_model.model.score.weight"]) and not head.weight.requires_grad


def test_reference_is_the_bare_base_and_frozen_parts_stay_bit_identical(tmp_path, prompts):
    trainer = build(tmp_path, MultiAdapterBackend, prompts, value_mode="adapter")
    be = trainer.backend
    named = dict(be.model.named_parameters())
    frozen_before = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    trainable_before = {n: p.detach().clone() for n, p in named.items() if p.requires_grad}
    head_before = be.reward_head.weight.detach().clone()
    for _ in range(2):
        trainer.step()
    for n, before in frozen_before.items():
        assert torch.equal(named[n], before), f"{n} changed"
    assert torch.equal(be.reward_head.weight, head_before)
    changed = {n for n, before in trainable_before.items() if not torch.equal(named[n], before)}
    assert any(".policy." in n for n in changed) and any(".value." in n for n in changed)
    assert all(".policy." in n or ".value." in n for n in trainable_before)
    # the reference (adapters disabled) is the plain SFT model, even with a trained policy adapter
    sft, tok = load_sft_model()
    r = trainer.last_rollout
    with torch.no_grad():
        expected = sequence_logprobs(sft, r.input_ids, r.attention_mask, r.n_response, 1.0)[0]
    got = be.reference_logprobs(r.input_ids, r.attention_mask, r.n_response, 1.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    policy = be.policy_forward(r.input_ids, r.attention_mask, r.n_response, 1.0)[0]
    assert (policy - got).abs().max() > 1e-3  # while the policy itself has moved


def test_first_step_kl_is_zero_because_the_reference_disables_the_adapter(tmp_path, prompts):
    """A fresh LoRA (B = 0) equals the base anyway; with B perturbed, KL = 0 at step 1 only holds if the reference
    really runs with the adapter disabled and the policy with it enabled."""
    trainer = build(tmp_path, MultiAdapterBackend, prompts)
    be = trainer.backend
    with torch.no_grad():
        for name, p in be.model.named_parameters():
            if ".lora_B.policy" in name:
                p.normal_(0, 0.05)
    r = trainer.rollout(trainer.batch_prompts(0))
    sft, _ = load_sft_model()
    with torch.no_grad():
        plain = sequence_logprobs(sft, r.input_ids, r.attention_mask, r.n_response, 1.0)[0]
    m = r.response_mask  # (after each answer the packed forwards leave zeros: masked positions mean nothing)
    torch.testing.assert_close(r.ref_logprobs[m], plain[m], atol=1e-5, rtol=1e-5)  # reference = the bare base
    assert (r.logprobs - r.ref_logprobs)[r.response_mask].abs().max() > 1e-2  # the policy is not the base
    record = trainer.rollout_stats(r)
    assert abs(record["kl/k1"]) > 1e-3  # so the KL is measured between two different models


def test_reward_adapter_on_another_base_is_refused(tmp_path):
    from marlhf_edu.errors import ConfigError

    config = PPOConfig(output_dir=str(tmp_path), reward_base_path=str(tmp_path), **SMALL)
    with pytest.raises(ConfigError, match="reward_base_path=.* differs from sft_model_path"):
        MultiAdapterBackend.from_config(config)
    from marlhf_edu.loading.assets import SFT_DIR

    same = PPOConfig(output_dir=str(tmp_path), reward_base_path=str(SFT_DIR) + "/", **SMALL)
    assert MultiAdapterBackend.from_config(same).value_mode == "shared"  # the same directory, spelled otherwise


def test_value_adapter_can_start_as_the_reward_adapter(tmp_path, prompts):
    from marlhf_edu.errors import ConfigError

    trainer = build(tmp_path, MultiAdapterBackend, prompts, value_mode="adapter", critic_init="reward_model")
    be = trainer.backend
    enc = _texts_batch(be.tokenizer, "left")
    n = enc["input_ids"].shape[1] - 1  # values of every position but the first
    with torch.no_grad():
        values = be.policy_forward(enc["input_ids"], enc["attention_mask"], n, 1.0)[1]
    scores = be.scores(enc["input_ids"], enc["attention_mask"])
    # left padding: the last real token is the last position, whose value is not among the R "before" values;
    # the last "before" value is V(s) one token earlier, so compare the head applied at the last position instead
    with torch.no_grad(), be._use_adapter("value"):
        hidden = be._hidden(enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(be.value_head(hidden[:, -1]).squeeze(-1), scores, atol=1e-5, rtol=1e-5)
    assert values.shape == (6, n)
    assert all(p.requires_grad for n_, p in be.model.named_parameters() if ".value." in n_)
    assert not any(p.requires_grad for n_, p in be.model.named_parameters() if ".reward." in n_)
    with pytest.raises(ConfigError, match="critic_init: reward_model needs value_mode: adapter"):
        build(tmp_path, MultiAdapterBackend, prompts, value_mode="shared", critic_init="reward_model")


def test_adapter_switches_keep_the_trainable_set(tmp_path, prompts):
    be = build(tmp_path, MultiAdapterBackend, prompts, value_mode="adapter").backend
    before = {n for n, p in be.model.named_parameters() if p.requires_grad}
    enc = _texts_batch(be.tokenizer, "right")
    be.scores(enc["input_ids"], enc["attention_mask"])  # switches to the reward adapter and back
    be.policy_forward(enc["input_ids"], enc["attention_mask"], 4, 1.0)  # switches to the value adapter and back
    assert {n for n, p in be.model.named_parameters() if p.requires_grad} == before
    # the reference turns every adapter off and on again: peft's disable_adapter would leave the value adapter frozen
    be.reference_logprobs(enc["input_ids"], enc["attention_mask"], 4, 1.0)
    assert {n for n, p in be.model.named_parameters() if p.requires_grad} == before
    # peft's own set_adapter would have frozen the policy adapter: the guard notices such a change
    be.model.set_adapter("reward")
    with pytest.raises(RuntimeError, match="trainable parameters changed"):
        be.check_trainable()


def test_four_bit_base_runs_a_step(tmp_path, prompts):
    import bitsandbytes as bnb

    trainer = build(tmp_path, MultiAdapterBackend, prompts, load_in_4bit=True)
    linear4 = [m for m in trainer.backend.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 4 * 7  # every projection of the 4 layers is NF4
    record = trainer.step()
    assert record["kl/k1"] == pytest.approx(0.0, abs=1e-5)
    assert all(v == v for v in record.values())  # no NaN
    trainer.backend.check_trainable()
