"""4-bit bases stay trainable on every CPU: bitsandbytes' CPU inference repacking is kept off.

On an AVX512-BF16 CPU, an unguarded `Linear4bit` repacks its weight on its first no-grad eval forward and
then has no backward (see `marlhf_edu.loading.quantization`). These tests compare LoRA gradients after such a forward
with the gradients of a model that never ran one; without the guard they differ on such CPUs (the first
test below checks that the CPU running them can tell).
"""

import pytest
import torch

from marlhf_edu.loading.assets import SFT_DIR
from marlhf_edu.loading.quantization import is_cpu_repacked, keep_nf4_trainable, load_nf4
from tests.conftest import nf4_lora_pair

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def cpu_repacks() -> bool:
    import bitsandbytes.functional as F

    return bool(F.has_avx512bf16())


def nf4_lora_model(guard: bool = True):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf_edu.loading.quantization import nf4_loading_kwargs

    base = (load_nf4(AutoModelForCausalLM, SFT_DIR) if guard
            else AutoModelForCausalLM.from_pretrained(str(SFT_DIR), **nf4_loading_kwargs("cpu")))
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=ALL_LINEAR))
    with torch.no_grad():  # B = 0 at start would hide gradients that flow through the LoRA branches
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model.eval()  # the engine's models stay in eval mode (no dropout): when the repacking fires


def lora_grads(model, eval_forward_first: bool) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46], [1, 50, 51, 52, 53, 54, 55, 56]])
    if eval_forward_first:
        with torch.no_grad():
            model(input_ids=ids)  # a rollout, reward or reference pass
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_guard_switches_off_repacking_on_every_4bit_layer():
    from transformers import AutoModelForCausalLM

    model = load_nf4(AutoModelForCausalLM, SFT_DIR)
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 28 and all(m.support_avx512bf16_for_cpu is False for m in layers)
    with torch.no_grad():
        model.eval()(input_ids=torch.tensor([[1, 40, 41]]))
    assert not any(is_cpu_repacked(m) for m in layers)
    assert keep_nf4_trainable(torch.nn.Linear(2, 2)) == 0  # nothing 4-bit: nothing to do


@pytest.mark.skipif("not cpu_repacks()", reason="this CPU has no AVX512-BF16: bitsandbytes never repacks here")
def test_unguarded_bitsandbytes_repacks_and_cuts_gradients_on_this_cpu():
    """Pins the library behaviour the guard exists for; if bitsandbytes drops the fast path, this tells us."""
    model = nf4_lora_model(guard=False)
    fresh = lora_grads(nf4_lora_model(guard=False), eval_forward_first=False)
    after = lora_grads(model, eval_forward_first=True)
    assert any(is_cpu_repacked(m) for m in model.modules())
    assert any(not torch.allclose(after[n], fresh[n], rtol=1e-3, atol=1e-6) for n in fresh)


def test_lora_gradients_after_an_eval_forward_equal_a_fresh_models():
    fresh = lora_grads(nf4_lora_model(), eval_forward_first=False)
    after = lora_grads(nf4_lora_model(), eval_forward_first=True)
    assert fresh.keys() == after.keys() and len(fresh) == 4 * 7 * 2  # A and B of 7 projections in 4 layers
    for name in fresh:
        assert fresh[name].abs().sum() > 0, name
        torch.testing.assert_close(after[name], fresh[name], rtol=1e-5, atol=1e-7, msg=name)


def test_multi_adapter_policy_gradients_survive_a_rollout(tmp_path):
    """The engine path: a rollout (no-grad, eval) before the update must not change the update's gradients."""
    from marlhf_edu.data.toyworld import ToyWorld
    from marlhf_edu.ppo import PPOConfig, PPOTrainer
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

    config = PPOConfig(load_in_4bit=True, value_mode="adapter", batch_size=4, mini_batch_size=4, micro_batch_size=4,
                       forward_batch_size=4, max_new_tokens=8, device="cpu", eval_repeats=0, output_dir=str(tmp_path))
    prompts = [p.prompt for p in ToyWorld().train_prompts]

    def grads(after_rollout: bool, rollout):
        torch.manual_seed(0)
        backend = MultiAdapterBackend.from_config(config)
        with torch.no_grad():  # make the policy LoRA non-trivial, so gradients flow through it and the base
            for name, p in backend.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        trainer = PPOTrainer(backend, config, prompts)
        if after_rollout:
            rollout = trainer.rollout(trainer.batch_prompts(0))
        backend.model.zero_grad(set_to_none=True)
        logprobs, values, _ = backend.policy_forward(rollout.input_ids, rollout.attention_mask, rollout.n_response, 1.0)
        (logprobs * rollout.response_mask).sum().add(values.sum()).backward()
        return rollout, {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}

    rollout, after = grads(True, None)
    _, fresh = grads(False, rollout)
    assert fresh.keys() == after.keys()
    gate = next(n for n in fresh if "layers.0.mlp.gate_proj.lora_B.policy" in n)
    assert fresh[gate].abs().sum() > 0
    for name in fresh:
        torch.testing.assert_close(after[name], fresh[name], rtol=1e-5, atol=1e-7, msg=name)


def test_an_already_repacked_layer_is_an_error_not_a_silent_restore():
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM

    from marlhf_edu.loading.quantization import nf4_loading_kwargs

    model = AutoModelForCausalLM.from_pretrained(str(SFT_DIR), **nf4_loading_kwargs("cpu"))
    layer = model.model.layers[1].mlp.up_proj
    assert isinstance(layer, bnb.nn.Linear4bit)
    layer.weight.data, layer.weight.quant_state = F._convert_weight_packed_for_cpu(layer.weight.data,
                                                                                   layer.weight.quant_state)
    with pytest.raises(RuntimeError, match=r"layers\.1\.mlp\.up_proj: bitsandbytes already repacked"):
        keep_nf4_trainable(model)


# ---- nf4_dequantize_once: the dequantized weight kept, bit-identical to bitsandbytes ----------------------------

@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_dequantize_once_gives_bitsandbytes_outputs_and_gradients_bit_for_bit(double_quant, compute_dtype):
    plain, once = nf4_lora_pair(double_quant, compute_dtype)
    for _ in range(2):  # the second pass reads the kept weights
        with torch.no_grad():
            ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46], [1, 50, 51, 52, 53, 54, 55, 56]])
            assert torch.equal(plain(input_ids=ids).logits, once(input_ids=ids).logits)
        expected, got = lora_grads(plain, False), lora_grads(once, False)
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[n], got[n]) for n in expected)  # layer 0's LoRA: through every 4-bit layer
    import bitsandbytes as bnb

    layers = [m for m in once.modules() if isinstance(m, bnb.nn.Linear4bit)]
    dtype = getattr(torch, compute_dtype)
    assert all(m.__dict__["_dequantized"][1].dtype == dtype for m in layers)
    assert not any(is_cpu_repacked(m) for m in layers)


def test_dequantize_once_dequantizes_again_when_the_weight_changes():
    import bitsandbytes as bnb

    plain, once = nf4_lora_pair(True, "float32")
    q = {n: m for n, m in once.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    p = {n: m for n, m in plain.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    name, other = "base_model.model.model.layers.0.self_attn.q_proj.base_layer", \
        "base_model.model.model.layers.0.self_attn.o_proj.base_layer"
    x = torch.randn(3, q[name].in_features)
    with torch.no_grad():
        first = q[name](x)
        assert torch.equal(first, p[name](x))
        q[name].weight, p[name].weight = q[other].weight, p[other].weight  # a new parameter (as peft's merge does)
        assert torch.equal(q[name](x), p[name](x)) and not torch.equal(q[name](x), first)
        q[name].weight[:5] ^= 0x11  # an in-place write into the packed codes (of both layers sharing them)
        p[name].weight[:5] ^= 0x11
        assert torch.equal(q[name](x), p[name](x)) and torch.equal(q[other](x), p[other](x))


def test_dequantize_once_is_a_cpu_option_for_a_4bit_base(tmp_path):
    from marlhf_edu.errors import ConfigError
    from marlhf_edu.ppo import PPOConfig

    PPOConfig(output_dir=str(tmp_path), load_in_4bit=True, nf4_dequantize_once=True, device="cpu").validate()
    with pytest.raises(ConfigError, match="needs load_in_4bit: true"):
        PPOConfig(output_dir=str(tmp_path), load_in_4bit=False, nf4_dequantize_once=True, device="cpu").validate()


def test_the_planner_counts_the_dequantized_weights_a_run_keeps():
    """The plan's term equals the bytes the layers hold after a forward (tiny model, fp32 and bf16 compute)."""
    import bitsandbytes as bnb
    from dataclasses import replace

    from marlhf_edu.memory.measure import state_bytes_by_kind
    from marlhf_edu.memory.plan import MemorySettings, ModelShape, dequantized_once_bytes, plan_multi_adapter

    shape = ModelShape.resolve(str(SFT_DIR))
    for dtype in ("float32", "bfloat16"):
        plain, once = nf4_lora_pair(True, dtype)
        with torch.no_grad():
            once(input_ids=torch.tensor([[1, 40, 41]]))
            plain(input_ids=torch.tensor([[1, 40, 41]]))
        held = sum(m.__dict__["_dequantized"][1].nbytes for m in once.modules() if isinstance(m, bnb.nn.Linear4bit))
        assert held > 0
        # the measurement counts them with the base's weights
        with_once, without = state_bytes_by_kind({"policy": once}), state_bytes_by_kind({"policy": plain})
        assert with_once["weights"] - without["weights"] == held
        s = MemorySettings(load_in_4bit=True, nf4_dequantize_once=True, nf4_compute_dtype=dtype)
        assert dequantized_once_bytes(shape, s)[0] == held
        off = plan_multi_adapter(shape, replace(s, nf4_dequantize_once=False))
        assert plan_multi_adapter(shape, s).parts["weights"] - off.parts["weights"] == held
        assert dequantized_once_bytes(shape, replace(s, load_in_4bit=False)) == (0, 0)
