"""Issue 34: what a GPU run of the 7B recipe does differently from the CPU runs, pinned on CPU.

Each test fails without its fix. The GPU measurements that found or confirmed them are in
`benchmarks/gpu_check.json` (`tools/gpu_check.py`, one H100); the tool itself is checked in tests/test_gpu_check.py.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import yaml


@pytest.fixture(scope="module")
def fp16_checkpoint(tmp_path_factory):
    """A tiny Llama saved in float16, as meta-llama/Llama-2-7b-hf is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("fp16")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(path)
    return path


def test_a_float16_checkpoint_loads_with_a_bf16_residual_stream_for_cuda(fp16_checkpoint):
    """transformers loads `dtype="auto"`: the checkpoint's float16. The NF4 loading kwargs for CUDA ask for bf16, so
    embeddings, norms and LM head (everything not quantized) are bf16; on CPU the checkpoint's dtype is kept."""
    from transformers import AutoModelForCausalLM

    from marlhf_edu.quantization import nf4_loading_kwargs

    auto = AutoModelForCausalLM.from_pretrained(fp16_checkpoint)
    assert auto.model.embed_tokens.weight.dtype == torch.float16  # the library default this guards against
    kwargs = nf4_loading_kwargs("cuda")
    assert kwargs["dtype"] is torch.bfloat16 and kwargs["quantization_config"].bnb_4bit_compute_dtype is torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(fp16_checkpoint, dtype=kwargs["dtype"])
    assert {model.model.embed_tokens.weight.dtype, model.model.norm.weight.dtype, model.lm_head.weight.dtype,
            model.model.layers[0].input_layernorm.weight.dtype} == {torch.bfloat16}
    assert "dtype" not in nf4_loading_kwargs("cpu")


def test_scoring_builds_no_kv_cache_and_reads_an_fp32_head_over_a_bf16_backbone():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from marlhf_edu.scoring import sequence_scores

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    seen = {}
    model.model.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    ids = torch.randint(1, 64, (3, 7))
    mask = torch.ones_like(ids)
    fp32 = sequence_scores(model, ids, mask)
    assert seen["use_cache"] is False  # no KV cache: about 10.7 GB at 7B for 64 x 320 tokens
    model.model.to(torch.bfloat16)  # the backbone in bf16, the head fp32: what the reward stage trains on a GPU
    mixed = sequence_scores(model, ids, mask)
    assert mixed.dtype == torch.float32 and torch.allclose(mixed, fp32, atol=0.05)


def test_checkpointing_works_on_transformers_without_the_new_name(monkeypatch):
    """transformers 5.17 (on the GPU image the check ran on) has only `gradient_checkpointing_enable`."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

    from marlhf_edu.checkpointing import decoder_layers_of, enable_checkpointing

    new = PreTrainedModel.activation_checkpointing_enable
    called = []

    def old_name(self, gradient_checkpointing_kwargs=None):  # the API of transformers <= 5.17
        called.append(gradient_checkpointing_kwargs)
        new(self, activation_checkpointing_kwargs=gradient_checkpointing_kwargs)

    monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", old_name)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the older name is deprecated in newer transformers
        enable_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in decoder_layers_of(model))
    assert called and called[0]["use_reentrant"] is False


def test_the_pipeline_frees_a_finished_stage_before_the_next(tmp_path, monkeypatch):
    """A trl trainer sits in reference cycles, so its model outlives the stage until the cyclic collector runs (on
    an H100 the PPO stage started with 3.5 GiB left by the reward model). The pipeline collects after each stage."""
    from marlhf_edu.stages import pipeline, sft

    refs = []
    real = sft.main

    def remembering(argv):
        trainer = real(argv)
        refs.append(weakref.ref(trainer.model))
        return None

    monkeypatch.setattr(sft, "main", remembering)
    spec = {"stages": {"sft": "configs/tiny_sft.yaml"},
            "overrides": {"sft": {"output_dir": str(tmp_path / "sft"), "max_steps": 2, "logging_steps": 1}}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(spec))
    gc.disable()  # the test must not depend on when Python's own collector happens to run
    try:
        pipeline.main(["--config", str(tmp_path / "p.yaml")])
        assert refs and refs[0]() is None, "the SFT model is still alive after its stage"
    finally:
        gc.enable()
