"""`onednn_matmuls`: frozen fp32 weights reordered once and multiplied by oneDNN (`marlhf_edu.loading.onednn`).

The same function as `F.linear` up to fp32 rounding (oneDNN sums in another order than MKL), so every comparison
here has a tolerance. That the oneDNN path really runs is checked where it matters: a reordered weight replaced by
zeros changes the output (a plain linear, a 4-bit layer), the merged copy follows a changed adapter, and a training
step holds reordered weights in every 4-bit layer, the LM head and the copy (a silent fallback to `F.linear` fails).
The byte counts are `numel × element_size` of the reordered tensors, what the planner counts (oneDNN's own
allocation is opaque).
"""

import pytest
import torch
from torch import nn

from marlhf_edu.loading import onednn
from marlhf_edu.loading.assets import SFT_DIR
from marlhf_edu.loading.onednn import OneDNNWeight, frozen_linear, onednn_weights, use_onednn
from tests.conftest import nf4_lora_pair

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear product")

#: fp32 rounding of sums of ~100 products of O(1) numbers, summed in another order
TOL = dict(rtol=1e-5, atol=1e-5)


def test_frozen_linear_is_f_linear_forward_and_input_gradient():
    torch.manual_seed(0)
    w, b = torch.randn(96, 48), torch.randn(96)
    x = torch.randn(3, 5, 48, requires_grad=True)
    y = frozen_linear(x, OneDNNWeight(w), b)
    assert y.shape == (3, 5, 96)
    y.div_(0.7)  # written in place, as the engine divides the LM head's logits by T
    (y.square() * torch.arange(96)).sum().backward()
    expected_x = x.detach().clone().requires_grad_(True)
    ref = nn.functional.linear(expected_x, w, b).div(0.7)
    (ref.square() * torch.arange(96)).sum().backward()
    torch.testing.assert_close(y, ref, **TOL)
    torch.testing.assert_close(x.grad, expected_x.grad, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(frozen_linear(x, OneDNNWeight(w, backward=False), b), ref * 0.7, **TOL)


def test_frozen_linear_refuses_what_it_cannot_differentiate():
    w = torch.randn(8, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="bias requires grad"):
        frozen_linear(x, OneDNNWeight(w), torch.zeros(8, requires_grad=True))
    with pytest.raises(RuntimeError, match="without its transpose"):
        frozen_linear(x, OneDNNWeight(w, backward=False)).sum().backward()
    with pytest.raises(ValueError, match="fp32 CPU weight"):
        OneDNNWeight(w.bfloat16())


def test_use_onednn_reads_the_reordered_weight_reorders_after_a_write_and_leaves_trainable_layers_alone():
    torch.manual_seed(0)
    frozen, trainable = nn.Linear(16, 32), nn.Linear(32, 8)
    frozen.requires_grad_(False)
    model = nn.Sequential(frozen, trainable)
    assert use_onednn(model) == 2
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), trainable(nn.functional.linear(x, frozen.weight, frozen.bias)), **TOL)
        assert "_onednn_weight" in frozen.__dict__ and "_onednn_weight" not in trainable.__dict__
        key = frozen.__dict__["_onednn_weight"][0]
        frozen.__dict__["_onednn_weight"] = (key, OneDNNWeight(torch.zeros(32, 16)))
        torch.testing.assert_close(frozen(x), frozen.bias.expand(4, 32))  # the reordered weight is what runs
        frozen.weight.mul_(2)  # an in-place write: reordered again
        torch.testing.assert_close(frozen(x), nn.functional.linear(x, frozen.weight, frozen.bias), **TOL)
    assert sum(t.numel() for t in onednn_weights(model)) == 2 * 32 * 16  # W and Wᵀ


def lora_grads(model) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46], [1, 50, 51, 52, 53, 54, 55, 56]])
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_4bit_base_through_onednn_gives_the_same_outputs_and_lora_gradients_to_rounding():
    import bitsandbytes as bnb

    plain, fast = nf4_lora_pair(onednn=True)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46], [1, 50, 51, 52, 53, 54, 55, 56]])
    with torch.no_grad():
        expected, got = plain(input_ids=ids).logits, fast(input_ids=ids).logits
    torch.testing.assert_close(got, expected, **TOL)
    assert not torch.equal(got, expected)  # oneDNN's sums, not MKL's bits (true on the CPUs the book runs on)
    grads, fast_grads = lora_grads(plain), lora_grads(fast)
    assert grads.keys() == fast_grads.keys() and len(grads) == 2 * 28
    for name in grads:  # layer 0's LoRA gradient flows back through every later layer's input gradient (Wᵀ)
        torch.testing.assert_close(fast_grads[name], grads[name], rtol=1e-4, atol=1e-6)
    layers = [m for m in fast.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert all(isinstance(m.__dict__["_dequantized"][1], OneDNNWeight) for m in layers)
    layer = layers[0]
    key, kept = layer.__dict__["_dequantized"]
    layer.__dict__["_dequantized"] = (key, OneDNNWeight(torch.zeros(kept.shape)))
    with torch.no_grad():
        assert not torch.allclose(fast(input_ids=ids).logits, got, **TOL)  # the reordered weight is what runs


def test_the_merged_copy_through_onednn_follows_the_adapter_after_a_refresh():
    """The copy's weights are written in place by `refresh`: its reordered weights must follow, or it would sample
    from the adapter before the update."""
    from marlhf_edu.ppo.merged_rollout import MergedPolicy

    _, fast = nf4_lora_pair(onednn=True)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    merged = MergedPolicy(fast, "default", onednn=True)
    with torch.no_grad():
        before = merged.model(input_ids=ids).logits
        torch.testing.assert_close(before, fast(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        assert "_onednn_weight" in merged.model.lm_head.__dict__
        for name, p in fast.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
        merged.refresh()
        after = merged.model(input_ids=ids).logits
        torch.testing.assert_close(after, fast(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(after, before, rtol=1e-2, atol=1e-2)


def test_the_planner_and_the_measurement_count_the_reordered_weights(tmp_path):
    """A tiny MA-PPO step with onednn_matmuls (4-bit base, merged copy): the measured weights exceed the run
    without it by exactly the plan's `onednn_bytes`."""
    from dataclasses import replace

    from marlhf_edu.memory.measure import model_state_bytes
    from marlhf_edu.memory.plan import MemorySettings, ModelShape, onednn_bytes
    from marlhf_edu.ppo import PPOConfig, PPOTrainer
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

    held = {}
    for flag in (False, True):
        config = PPOConfig(output_dir=str(tmp_path / str(flag)), load_in_4bit=True, nf4_dequantize_once=True,
                           merged_rollout=True, onednn_matmuls=flag, device="cpu", batch_size=4, mini_batch_size=2,
                           forward_batch_size=4, micro_batch_size=2, max_new_tokens=4, total_steps=1, seed=0)
        backend = MultiAdapterBackend.from_config(config)
        trainer = PPOTrainer(backend, config, ["Hello there", "How are you", "Tell me a story", "Why"])
        trainer.step()
        held[flag] = model_state_bytes(backend._with_rollout_copy(backend.models()))["total"]
    shape = ModelShape.resolve(str(SFT_DIR))
    s = MemorySettings(load_in_4bit=True, nf4_dequantize_once=True, merged_rollout=True, onednn_matmuls=True)
    assert held[True] - held[False] == onednn_bytes(shape, s)[0] > 0
    assert onednn_bytes(shape, replace(s, onednn_matmuls=False)) == (0, 0)


def test_a_multi_adapter_step_through_onednn_matches_the_default_engine(tmp_path):
    """Same seed, same prompts: the first step's statistics agree to rounding, the first minibatch's ratio is 1."""
    from marlhf_edu.ppo import PPOConfig, PPOTrainer
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

    records, firsts = {}, {}
    for flag in (False, True):
        config = PPOConfig(output_dir=str(tmp_path / str(flag)), load_in_4bit=True, nf4_dequantize_once=True,
                           merged_rollout=True, onednn_matmuls=flag, device="cpu", batch_size=4, mini_batch_size=2,
                           forward_batch_size=4, micro_batch_size=2, max_new_tokens=6, total_steps=1, seed=0)
        torch.manual_seed(0)
        backend = MultiAdapterBackend.from_config(config)
        trainer = PPOTrainer(backend, config, ["Hello there", "How are you", "Tell me a story", "Why"])
        records[flag], firsts[flag] = trainer.step(), trainer.minibatch_stats[0]
        if flag:  # the copy, every 4-bit layer and the head hold reordered weights: their products ran on oneDNN
            import bitsandbytes as bnb

            assert backend._merged.nbytes() > 2 * sum(p.numel() * 4 for p in backend._merged.model.parameters()) * 0.9
            assert "_onednn_weight" in backend.model.get_base_model().lm_head.__dict__
            layers = [m for m in backend.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
            assert layers and all(isinstance(m.__dict__["_dequantized"][1], OneDNNWeight) for m in layers)
    off, on = records[False], records[True]
    assert on["response/length"] == off["response/length"]  # the same answers here (rounding could flip a token)
    for key in ("score/mean", "loss/policy", "loss/value", "value/mean"):
        assert on[key] == pytest.approx(off[key], rel=1e-3, abs=1e-5), key
    # policy and reference run the same oneDNN products: KL 0 and ratio 1 at the first minibatch, as without it
    assert on["kl/k1"] == pytest.approx(0.0, abs=1e-6)
    assert firsts[True]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert firsts[True]["policy/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert on["rollout/logprob_gap"] < 1e-3  # the oneDNN copy samples what the training path scores


def test_a_torch_without_the_onednn_operators_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from marlhf_edu.errors import ConfigError
    from marlhf_edu.ppo import PPOConfig

    monkeypatch.setattr(onednn, "available", lambda: False)
    with pytest.raises(ConfigError, match="no oneDNN linear product"):
        PPOConfig(output_dir=str(tmp_path), onednn_matmuls=True, device="cpu").validate()
    PPOConfig(output_dir=str(tmp_path), device="cpu").validate()  # off: nothing asked of oneDNN


def test_onednn_matmuls_is_a_cpu_fp32_option(tmp_path):
    from marlhf_edu.errors import ConfigError
    from marlhf_edu.ppo import PPOConfig

    ok = PPOConfig(output_dir=str(tmp_path), load_in_4bit=True, nf4_dequantize_once=True, onednn_matmuls=True,
                   device="cpu")
    ok.validate()
    PPOConfig(output_dir=str(tmp_path), onednn_matmuls=True, device="cpu").validate()  # a dense base
    for bad in (dict(load_in_4bit=True, nf4_dequantize_once=False),
                dict(load_in_4bit=True, nf4_dequantize_once=True, nf4_compute_dtype="bfloat16")):
        with pytest.raises(ConfigError, match="onednn_matmuls multiplies"):
            PPOConfig(output_dir=str(tmp_path), onednn_matmuls=True, device="cpu", **bad).validate()


FOUR_MODEL_CASES = [dict(critic="shared_head", actor_lora_r=0),  # a fully trained actor, the reward LoRA unmerged
                    dict(critic="separate", actor_lora_r=8, actor_lora_alpha=16, merged_rollout=True,
                         merged_reward=True),
                    # the critic starts as a copy of the reward model: its own weights, trained, never reordered
                    dict(critic="separate", actor_lora_r=0, critic_init="reward_model")]


def _four_model_trainer(tmp_path, flag, **overrides):
    from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer

    config = PPOConfig(output_dir=str(tmp_path / str(flag)), onednn_matmuls=flag, device="cpu", batch_size=4,
                       mini_batch_size=2, forward_batch_size=4, micro_batch_size=2, max_new_tokens=6, total_steps=1,
                       seed=0, **overrides)
    torch.manual_seed(0)
    backend = FourModelBackend.from_config(config)
    return PPOTrainer(backend, config, ["Hello there", "How are you", "Tell me a story", "Why"])


@pytest.mark.parametrize("overrides", FOUR_MODEL_CASES)
def test_a_four_model_step_through_onednn_matches_and_reorders_only_the_frozen_models(tmp_path, overrides):
    """Four-model PPO with onednn_matmuls: the reference, the reward model and a merged copy multiply through
    oneDNN, the actor and critic (trained) do not; the first step's statistics agree with the default engine's to
    rounding; the measured weights exceed the run without it by exactly the plan's `onednn_bytes`."""
    from marlhf_edu.memory.measure import model_state_bytes
    from marlhf_edu.memory.plan import MemorySettings, ModelShape, onednn_bytes

    records, held = {}, {}
    for flag in (False, True):
        trainer = _four_model_trainer(tmp_path, flag, **overrides)
        records[flag] = trainer.step()
        be = trainer.backend
        held[flag] = model_state_bytes(be._with_rollout_copy(be.models()))["total"]
    reordered = {name: sum(1 for _ in onednn_weights(model)) for name, model in be.models().items()}
    assert reordered["reference"] > 0 and reordered["reward"] > 0
    assert reordered["actor"] == 0 and reordered["critic"] == 0
    assert reordered.get("rollout copy", 0) == (0 if not overrides.get("merged_rollout") else reordered["reference"])
    off, on = records[False], records[True]
    assert on["response/length"] == off["response/length"]
    for key in ("score/mean", "kl/k1", "loss/policy", "loss/value", "value/mean"):
        assert on[key] == pytest.approx(off[key], rel=1e-3, abs=1e-5), key
    shape = ModelShape.resolve(str(SFT_DIR))
    reward_r = be.reward.peft_config["default"].r if hasattr(be.reward, "peft_config") else 0
    s = MemorySettings(critic=overrides["critic"], policy_lora_r=overrides["actor_lora_r"],
                       value_lora_r=overrides["actor_lora_r"], reward_lora_r=reward_r,
                       merged_rollout=overrides.get("merged_rollout", False),
                       merged_reward=overrides.get("merged_reward", False), onednn_matmuls=True)
    assert held[True] - held[False] == onednn_bytes(shape, s, "four-model")[0] > 0


def test_the_options_that_assume_fp32_refuse_a_model_loaded_in_bf16(tmp_path):
    """transformers loads a checkpoint saved in bf16 as bf16: old_logprobs: sampler and onednn_matmuls (fp32
    arithmetic) refuse it by the model's name, in both engines; fp32 checkpoints pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marlhf_edu.errors import ConfigError
    from marlhf_edu.ppo import FourModelBackend, PPOConfig
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

    bf16 = tmp_path / "sft_bf16"
    AutoModelForCausalLM.from_pretrained(str(SFT_DIR), dtype=torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(str(SFT_DIR)).save_pretrained(bf16)
    from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR

    common = dict(output_dir=str(tmp_path / "run"), device="cpu", sft_model_path=str(bf16),
                  reward_adapter_path=str(REWARD_ADAPTER_DIR), reward_base_path=str(SFT_DIR))
    with pytest.raises(ConfigError, match="the actor holds bfloat16"):
        FourModelBackend.from_config(PPOConfig(critic="shared_head", old_logprobs="sampler", **common))
    with pytest.raises(ConfigError, match="onednn_matmuls needs fp32 weights"):
        FourModelBackend.from_config(PPOConfig(onednn_matmuls=True, **common))
    FourModelBackend.from_config(PPOConfig(**common))  # neither option: bf16 weights are the user's choice
    with pytest.raises(ConfigError, match="the base holds bfloat16"):
        # the reward adapter was trained on this very model, saved in fp32: named as its base
        MultiAdapterBackend.from_config(PPOConfig(onednn_matmuls=True, **{**common, "reward_base_path": str(bf16)}))


def test_the_planner_counts_no_merged_copy_for_a_fully_trained_four_model_actor():
    """A fully trained four-model actor samples from its own dense weights: `merged_rollout` (refused by the engine,
    not by the planner's settings) adds no reordered copy; a LoRA actor's copy is counted."""
    from dataclasses import replace

    from marlhf_edu.memory.plan import MemorySettings, ModelShape, onednn_bytes

    shape = ModelShape.resolve(str(SFT_DIR))
    full = MemorySettings(policy_lora_r=0, value_lora_r=0, critic="shared_head", onednn_matmuls=True)
    assert onednn_bytes(shape, replace(full, merged_rollout=True), "four-model") == onednn_bytes(shape, full,
                                                                                                  "four-model")
    lora = replace(full, policy_lora_r=8, value_lora_r=8)
    assert (onednn_bytes(shape, replace(lora, merged_rollout=True), "four-model")[0]
            > onednn_bytes(shape, lora, "four-model")[0])
    with pytest.raises(ValueError, match="engine must be"):
        onednn_bytes(shape, full, "four_model")
