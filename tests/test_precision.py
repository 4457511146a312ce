"""GPU precision, pinned on CPU: what the 7B run relies on transformers, peft and bitsandbytes to do.

A bf16 base (transformers keeps a checkpoint's dtype) carries fp32 LoRA adapters (peft's
`autocast_adapter_dtype`) and fp32 value and score heads; attention is SDPA; log-probs, entropies and values
leave the engine in fp32, with fp32 logits only at the response positions. An NF4 base computes in bf16 on CUDA
and fp32 on CPU. If a library changes any of these defaults, these tests fail before a GPU run does.
"""

import torch

from marlhf_edu.loading.models import load_sft_model
from marlhf_edu.loading.quantization import nf4_loading_kwargs
from marlhf_edu.ppo import PPOConfig
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend


def test_a_bf16_base_trains_fp32_adapters_and_heads(tmp_path, prompts):
    from conftest import build_trainer

    model, tok = load_sft_model()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    # reward_base_path: the zoo reward adapter belongs to this bf16 copy of its own base (a declared exception
    # to the check of the adapter's recorded base)
    base = dict(sft_model_path=str(tmp_path / "bf16"), reward_base_path=str(tmp_path / "bf16"), device="cpu",
                value_mode="adapter", actor_lora_r=8,
                batch_size=8, mini_batch_size=8, micro_batch_size=4, forward_batch_size=8, max_new_tokens=8)
    trainer = build_trainer(tmp_path, MultiAdapterBackend, prompts, base)
    be = trainer.backend
    core = be.model.get_base_model()
    assert core.model.embed_tokens.weight.dtype == torch.bfloat16  # the checkpoint's dtype, not upcast to fp32
    assert core.config._attn_implementation == "sdpa"
    trainable = [p for group in be.parameter_groups().values() for p in group]
    assert trainable and {p.dtype for p in trainable} == {torch.float32}  # adapters and value head: fp32 masters
    assert {p.dtype for n, p in be.model.named_parameters() if ".lora_" in n} == {torch.float32}
    assert be.reward_head.weight.dtype == torch.float32
    r = trainer.rollout(trainer.batch_prompts(0))
    assert r.logprobs.dtype == r.ref_logprobs.dtype == r.values.dtype == r.entropy.dtype == torch.float32
    stats = trainer.update(r)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert {p.dtype for p in trainable} == {torch.float32}  # still fp32 after an optimizer step


def test_nf4_computes_in_bf16_on_cuda_and_fp32_on_cpu():
    for device, dtype in (("cuda:1", torch.bfloat16), ("cuda", torch.bfloat16), ("cpu", torch.float32)):
        kwargs = nf4_loading_kwargs(device, double_quant=True)
        q = kwargs["quantization_config"]
        assert q.bnb_4bit_compute_dtype == dtype and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
        assert kwargs["device_map"] == {"": device}  # each data-parallel rank's base on its own GPU


def test_nf4_compute_dtype_float32_computes_as_the_cpu_does_on_cuda(monkeypatch):
    """`nf4_compute_dtype: float32`: fp32 compute and an fp32 residual stream on CUDA, as on the CPU; "auto" is the
    default above; anything else is refused, by the loader and the config."""
    import pytest

    from marlhf_edu.errors import ConfigError

    fp32 = nf4_loading_kwargs("cuda", compute_dtype="float32")
    assert fp32["quantization_config"].bnb_4bit_compute_dtype == torch.float32 and fp32["dtype"] is torch.float32
    assert nf4_loading_kwargs("cuda", compute_dtype="auto")["dtype"] is torch.bfloat16
    cpu_bf16 = nf4_loading_kwargs("cpu", compute_dtype="bfloat16")
    assert cpu_bf16["quantization_config"].bnb_4bit_compute_dtype == torch.bfloat16 and "dtype" not in cpu_bf16
    with pytest.raises(ValueError, match="float16"):
        nf4_loading_kwargs("cuda", compute_dtype="float16")
    with pytest.raises(ConfigError, match="nf4_compute_dtype"):
        PPOConfig(nf4_compute_dtype="fp32").validate()
    seen = {}  # the multi-adapter backend passes the setting through to the loader
    import marlhf_edu.ppo.multi_adapter as multi_adapter

    def spy(device, double_quant=True, compute_dtype="auto"):
        seen["compute_dtype"] = compute_dtype
        raise RuntimeError("stop after the loader's arguments")

    monkeypatch.setattr(multi_adapter, "nf4_loading_kwargs", spy)
    with pytest.raises(RuntimeError, match="stop after"):
        MultiAdapterBackend.from_config(PPOConfig(device="cpu", load_in_4bit=True, nf4_compute_dtype="float32"))
    assert seen == {"compute_dtype": "float32"}


def test_logits_reach_fp32_only_at_the_response_positions(monkeypatch, tmp_path):
    """The (B, R, V) fp32 copy is the response's; the prompt's logits are never made (chapter 02's memory)."""
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend as M

    be = M.from_config(PPOConfig(device="cpu", actor_lora_r=8))
    seen = []
    original = M._logits

    def spy(self, hidden, n_response, temperature):
        out = original(self, hidden, n_response, temperature)
        seen.append((tuple(hidden.shape), tuple(out.shape), out.dtype))
        return out

    monkeypatch.setattr(M, "_logits", spy)
    ids = be.tokenizer(["Question: what is 2 plus 3?\nAnswer: five"], return_tensors="pt")
    be.policy_forward(ids["input_ids"], ids["attention_mask"], 3, 1.0)
    (hidden_shape, logits_shape, dtype), = seen
    assert logits_shape[1] == 3 < hidden_shape[1] and dtype == torch.float32
