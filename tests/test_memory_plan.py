"""The memory planner: known 7B arithmetic, agreement with measurement on the tiny engines and at 7B width.

The layout checked is bitsandbytes' standard NF4 layout: a uint8 tensor of packed 4-bit weights, an fp32
absmax per block of 64 (or, with double quantization, uint8 absmax + an fp32 offset, scales per block of 256
and a 256-entry code table) and a 16-entry code table. That is the layout the engine trains on, on every CPU:
`keep_nf4_trainable` keeps bitsandbytes from converting it to its CPU inference layout (bf16 absmax, no
double quantization), which would change both the bytes and the gradients. Each test asserts that no layer
was converted.
"""

from dataclasses import replace

import pytest
import torch

from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR
from marlhf_edu.loading.quantization import is_cpu_repacked
from marlhf_edu.memory import (LLAMA_2_7B, MemorySettings, ModelShape, plan_both, plan_four_model,
                               plan_multi_adapter, ppo_memory, state_bytes_by_kind, storage_bytes)
from marlhf_edu.memory.check import compare, plan_for, real_width_check
from marlhf_edu.memory.plan import ALL_LINEAR, base_weight_bytes, lora_params
from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_llama_2_7b_arithmetic_matches_the_published_counts():
    assert LLAMA_2_7B.n_params == 6_738_415_616
    s = MemorySettings(weight_dtype="bfloat16")
    assert base_weight_bytes(LLAMA_2_7B, s) == pytest.approx(13.48e9, rel=1e-3)
    assert base_weight_bytes(LLAMA_2_7B, replace(s, load_in_4bit=True, double_quant=False)) == pytest.approx(4.17e9, rel=2e-3)
    assert base_weight_bytes(LLAMA_2_7B, replace(s, load_in_4bit=True, double_quant=True)) == pytest.approx(3.87e9, rel=2e-3)
    assert LLAMA_2_7B.num_layers * lora_params(LLAMA_2_7B, 64, QKVO) == pytest.approx(67.1e6, rel=1e-3)
    assert LLAMA_2_7B.num_layers * lora_params(LLAMA_2_7B, 64, LLAMA_2_7B.linear_shapes()) == pytest.approx(159.9e6, rel=1e-3)
    kv = plan_multi_adapter(LLAMA_2_7B, replace(s, forward_batch_size=1, prompt_length=1, response_length=0)).parts
    assert kv["kv_cache"] == 2**19  # 0.5 MiB per token in bf16


def test_ma_ppo_plans_at_most_a_third_of_four_model_at_7b():
    s = MemorySettings(weight_dtype="bfloat16", load_in_4bit=True, double_quant=True, policy_lora_r=64,
                       value_lora_r=64, reward_lora_r=32, reward_targets=QKVO)
    for targets in (QKVO, LLAMA_2_7B.linear_shapes()):
        plans = plan_both(LLAMA_2_7B, replace(s, policy_targets=tuple(targets), value_targets=tuple(targets)))
        four, shared, adapter = (p.model_state for p in plans.values())
        assert shared <= four / 3
        assert shared < adapter < four  # a second trainable adapter costs its weights, gradients and moments
    # one base instead of four (critic and reward backbones have no LM head, V·H bf16 values each)
    plans = plan_both(LLAMA_2_7B, s)
    lm_head = 32000 * 4096 * 2
    assert plans["four-model"].parts["weights"] == 4 * plans["MA-PPO shared"].parts["weights"] - 2 * lm_head


def test_lora_ppo_baseline_shares_the_policy_base_with_the_reference():
    """trl 0.11 / MA-RLHF LoRA PPO: two bases (policy = reference, reward); MA-PPO: one."""
    from marlhf_edu.memory import plan_lora_ppo

    s = MemorySettings(weight_dtype="bfloat16", load_in_4bit=True, double_quant=True, policy_lora_r=64,
                       value_lora_r=64, reward_lora_r=32, reward_targets=QKVO)
    plans = plan_both(LLAMA_2_7B, s, lora_baseline=True)
    assert list(plans) == ["four-model", "LoRA PPO", "MA-PPO shared", "MA-PPO adapter"]
    lora, shared = plans["LoRA PPO"], plans["MA-PPO shared"]
    lm_head = 32000 * 4096 * 2
    assert lora.parts["weights"] == 2 * shared.parts["weights"] - lm_head  # the reward backbone has no LM head
    # the same trainable set as MA-PPO with a shared head: policy LoRA + value head
    assert lora.trainable_params == shared.trainable_params
    assert lora.parts["gradients"] == shared.parts["gradients"] and lora.parts["optimizer"] == shared.parts["optimizer"]
    # the reward model keeps peft's second copy of the score head as a separate model: one h-vector more
    assert lora.parts["adapters"] == shared.parts["adapters"] + 2 * 4096 * 2 - 4096 * 4
    assert shared.model_state < lora.model_state < plans["four-model"].model_state
    with pytest.raises(ConfigError, match="policy rank must be > 0"):
        plan_lora_ppo(LLAMA_2_7B, MemorySettings(policy_lora_r=0))


def test_planner_rejects_what_cannot_train():
    with pytest.raises(ConfigError, match="4-bit model cannot be trained in full"):
        plan_four_model(LLAMA_2_7B, MemorySettings(load_in_4bit=True, policy_lora_r=0))
    with pytest.raises(ConfigError, match="trains LoRA adapters"):
        plan_multi_adapter(LLAMA_2_7B, MemorySettings(policy_lora_r=0))
    with pytest.raises(ConfigError, match="unknown module"):
        plan_multi_adapter(LLAMA_2_7B, MemorySettings(policy_targets=("qproj",)))
    with pytest.raises(ConfigError, match="not a preset"):
        ModelShape.resolve("no/such-model")
    assert ModelShape.resolve("zoo").n_params == 1_967_808


def test_saved_tensor_bytes_counts_what_autograd_keeps_and_not_the_weights():
    from marlhf_edu.memory.measure import saved_tensor_bytes

    lin = torch.nn.Linear(4, 3)
    x = torch.ones(2, 4)
    # a trainable linear keeps its input (for the weight's gradient); tanh keeps its output; the weights are state
    _, nbytes = saved_tensor_bytes(lambda: torch.tanh(lin(x)), lin)
    assert nbytes == 2 * 4 * 4 + 2 * 3 * 4
    # frozen, with an input that needs a gradient: only the weight is needed, and it is not an activation
    lin.requires_grad_(False)
    _, nbytes = saved_tensor_bytes(lambda: torch.tanh(lin(x.requires_grad_(True))), lin)
    assert nbytes == 2 * 3 * 4
    # without the module passed, its weight counts as a saved tensor
    _, nbytes = saved_tensor_bytes(lambda: lin(x))
    assert nbytes == 3 * 4 * 4


def test_activation_plan_with_checkpointing_and_the_peak():
    from marlhf_edu.memory.plan import forward_activation_bytes, layer_activation_values, recompute_bytes

    s = MemorySettings(weight_dtype="bfloat16", load_in_4bit=True, policy_lora_r=64, micro_batch_size=2,
                       prompt_length=64, response_length=256)
    full = forward_activation_bytes(LLAMA_2_7B, s, 64, ALL_LINEAR, lm_logits=False, value_head=False)
    ckpt = forward_activation_bytes(LLAMA_2_7B, replace(s, gradient_checkpointing=True), 64, ALL_LINEAR,
                                    lm_logits=False, value_head=False)
    tokens, h = 2 * 320, 4096
    layer = layer_activation_values(LLAMA_2_7B, 64, ALL_LINEAR) + 320  # + the padding mask
    assert layer == 8 * h + 4 * 11008 + 7 * 64 + 32 + 2 + 320
    # 32 layers' activations and RoPE's tables → 32 layer inputs, the final norm's input and its 1/rms
    assert full - ckpt == tokens * 2 * (32 * layer + 2 * 128 - (33 * h + 1))
    ckpt_settings = replace(s, value_mode="shared", gradient_checkpointing=True)
    assert recompute_bytes(LLAMA_2_7B, ckpt_settings, 64, ALL_LINEAR) == tokens * 2 * layer  # one layer, again
    assert recompute_bytes(LLAMA_2_7B, replace(ckpt_settings, gradient_checkpointing=False), 64, ALL_LINEAR) == 0
    plan = plan_multi_adapter(LLAMA_2_7B, replace(s, value_mode="shared"))
    assert plan.recompute == 0 and plan.activations_checkpointed < plan.parts["activations"]
    sampling = plan.parts["kv_cache"] + plan.parts["logits"]
    update = plan.parts["activations"] + 2 * 256 * 32000 * 4
    assert plan.peak == plan.model_state + max(sampling, update)
    ckpt_plan = plan_multi_adapter(LLAMA_2_7B, ckpt_settings)
    assert ckpt_plan.recompute == tokens * 2 * layer
    assert ckpt_plan.parts["activations"] + ckpt_plan.recompute == plan.activations_checkpointed
    assert ckpt_plan.peak == ckpt_plan.model_state + max(sampling, ckpt_plan.parts["activations"] + ckpt_plan.recompute
                                                         + 2 * 256 * 32000 * 4)


def test_storages_are_counted_once():
    w = torch.zeros(10, 10)
    assert storage_bytes([w, w[:5], w.view(100)]) == 400
    shared = torch.nn.Linear(10, 10, bias=False)
    models = {"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)}
    assert state_bytes_by_kind(models)["weights"] == 400


@pytest.fixture(scope="module")
def prompts():
    return [p.prompt for p in ToyWorld().train_prompts]


TINY = dict(batch_size=16, mini_batch_size=16, micro_batch_size=8, forward_batch_size=16, max_new_tokens=16,
            device="cpu", eval_repeats=0)


@pytest.mark.parametrize("backend_cls, overrides", [
    (FourModelBackend, {}),                                              # full actor and critic, fp32
    (FourModelBackend, {"actor_lora_r": 8}),                             # LoRA actor and critic
    (MultiAdapterBackend, {"value_mode": "shared", "load_in_4bit": True}),
    (MultiAdapterBackend, {"value_mode": "adapter", "load_in_4bit": True}),
    (MultiAdapterBackend, {"value_mode": "adapter", "load_in_4bit": True, "double_quant": False}),
    (MultiAdapterBackend, {"value_mode": "adapter", "actor_lora_r": 4}),  # fp32 base
    (FourModelBackend, {"gradient_checkpointing": True}),
    (MultiAdapterBackend, {"value_mode": "adapter", "load_in_4bit": True, "gradient_checkpointing": True}),
    (FourModelBackend, {"critic": "shared_head"}),                      # trl 0.11's value head on the actor
    (FourModelBackend, {"critic": "shared_head", "actor_lora_r": 8, "merged_rollout": True}),
    (MultiAdapterBackend, {"value_mode": "shared", "load_in_4bit": True, "merged_rollout": True}),
    (FourModelBackend, {"critic": "shared_head", "merged_reward": True}),  # the reward LoRA merged into its base
], ids=["four-full", "four-lora", "ma-shared-nf4", "ma-adapter-nf4", "ma-adapter-nf4-plain", "ma-adapter-fp32",
        "four-full-ckpt", "ma-adapter-nf4-ckpt", "four-shared-head", "four-shared-head-lora-merged",
        "ma-shared-nf4-merged", "four-shared-head-merged-reward"])
@pytest.mark.slow
def test_planner_agrees_with_measurement_on_tiny_models(tmp_path, prompts, backend_cls, overrides):
    config = PPOConfig(output_dir=str(tmp_path), **{**TINY, **overrides})
    torch.manual_seed(0)
    trainer = PPOTrainer(backend_cls.from_config(config), config, prompts)
    measured = ppo_memory(trainer)
    assert measured["model"]["gradients"] > 0 and measured["model"]["optimizer"] > 0
    assert all(p.grad is None for p in trainer.optimizer.param_groups[0]["params"])  # freed again
    assert not any(is_cpu_repacked(m) for model in trainer.backend.models().values() for m in model.modules())
    rows = compare(plan_for(trainer, ModelShape.resolve("zoo"), REWARD_ADAPTER_DIR, measured), measured)
    assert rows["activations"]["measured"] > 0  # what autograd kept for one micro-batch of the update
    for part, row in rows.items():
        if row["planned"] == row["measured"] == 0:  # e.g. no adapter in a layer: full training, reward merged
            continue
        # the issue asked ≤ 10 %; model state is exact, activations within 0.3 % (the loss's small tensors)
        assert row["ratio"] == pytest.approx(1.0, abs=0.02 if part != "activations" else 0.005), (part, row)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.slow
def test_planner_matches_one_ma_ppo_step_at_llama_2_7b_width(tmp_path, checkpointing):
    """One decoder layer of Llama-2-7B's widths in NF4, policy + value LoRA r=64, reward LoRA r=32: ~1 min on CPU."""
    result = real_width_check(tmp_path, num_layers=1, value_mode="adapter", lora_r=64, reward_r=32,
                              gradient_checkpointing=checkpointing)
    assert result["settings"]["gradient_checkpointing"] == checkpointing
    rows = result["comparison"]
    assert result["cpu_repacked_layers"] == 0  # the standard NF4 layout, see the module docstring
    assert rows["layer weights"]["measured"] > 100e6  # 202 M weights at ~0.52 B each
    for part, row in rows.items():
        assert row["ratio"] == pytest.approx(1.0, abs=0.02), (part, row)


def test_memory_command_prints_the_side_by_side_table(capsys):
    from marlhf_edu.cli import main

    assert main(["memory", "--config", "configs/memory_llama2_7b.yaml"]) == 0
    out = capsys.readouterr().out
    assert "llama-2-7b: 6,738,415,616 parameters" in out and "NF4 + double quant" in out
    header = next(line for line in out.splitlines() if "four-model" in line and "MA-PPO shared" in line).split()
    assert header == ["four-model", "LoRA", "PPO", "MA-PPO", "shared", "MA-PPO", "adapter"]
    ratios = next(line for line in out.splitlines() if line.startswith("÷ four-model")).split()[2:]
    assert float(ratios[0]) == 1.0 and float(ratios[2]) <= 1 / 3
    fair = next(line for line in out.splitlines() if line.startswith("÷ LoRA PPO")).split()[3:]
    assert float(fair[1]) == 1.0 and float(fair[2]) < 0.7 and float(fair[3]) < 1.0
    assert "activations, ckpt" in out and "(+ layer recomputed)" not in out
    assert main(["memory", "--config", "configs/memory_llama2_7b.yaml", "--gradient_checkpointing", "true"]) == 0
    ckpt = capsys.readouterr().out
    assert "(+ layer recomputed)" in ckpt and "activations, ckpt" not in ckpt
    assert main(["memory", "--config", "configs/tiny_ma_ppo.yaml", "--model_shap", "x"]) == 2
    assert "did you mean 'model_shape'" in capsys.readouterr().err


def test_four_model_critic_follows_the_actor_recipe(tmp_path):
    config = PPOConfig(output_dir=str(tmp_path), actor_lora_r=4, device="cpu", eval_repeats=0)
    backend = FourModelBackend.from_config(config)
    value = backend.parameter_groups()["value"]
    names = {id(p): n for n, p in backend.critic.named_parameters()}
    assert value and all("lora_" in names[id(p)] or "value_head" in names[id(p)] for p in value)


def test_grpo_and_dpo_plans_are_ma_ppo_without_the_critic():
    """GRPO-LoRA holds what MA-PPO (adapter mode) holds less the value adapter and head and their training
    state; DPO-LoRA holds less again (no reward adapter) and never samples. Both share one base with the
    reference (the disabled adapter)."""
    from marlhf_edu.memory import plan_dpo_lora, plan_grpo_lora

    s = MemorySettings(weight_dtype="bfloat16", load_in_4bit=True, double_quant=True, policy_lora_r=64,
                       value_lora_r=64, reward_lora_r=32, reward_targets=QKVO, value_mode="adapter")
    ma, grpo, dpo = plan_multi_adapter(LLAMA_2_7B, s), plan_grpo_lora(LLAMA_2_7B, s), plan_dpo_lora(LLAMA_2_7B, s)
    L, h = LLAMA_2_7B.num_layers, LLAMA_2_7B.hidden_size
    value = L * lora_params(LLAMA_2_7B, 64, ALL_LINEAR)  # value adapter params (fp32)
    reward = L * lora_params(LLAMA_2_7B, 32, QKVO)
    assert grpo.parts["weights"] == ma.parts["weights"] == dpo.parts["weights"]
    assert grpo.parts["adapters"] == ma.parts["adapters"] - value * 4 - (h + 1) * 4
    assert grpo.trainable_params == ma.trainable_params - value - (h + 1) == dpo.trainable_params
    assert grpo.parts["gradients"] == ma.parts["gradients"] - (value + h + 1) * 4
    assert grpo.parts["optimizer"] == ma.parts["optimizer"] - 2 * (value + h + 1) * 4
    assert grpo.parts["kv_cache"] == ma.parts["kv_cache"] > 0 and dpo.parts["kv_cache"] == 0
    assert dpo.parts["adapters"] == grpo.parts["adapters"] - reward * 4 - h * 4
    # the update keeps the policy's forward only: MA-PPO's less its value adapter's
    assert grpo.parts["activations"] == dpo.parts["activations"] < ma.parts["activations"]
    assert dpo.model_state < grpo.model_state < ma.model_state
    with pytest.raises(ConfigError, match="policy rank must be > 0"):
        plan_grpo_lora(LLAMA_2_7B, MemorySettings(policy_lora_r=0))
    with pytest.raises(ConfigError, match="policy rank must be > 0"):
        plan_dpo_lora(LLAMA_2_7B, MemorySettings(policy_lora_r=0))
