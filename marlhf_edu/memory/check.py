"""The planner checked against measurement: on the tiny models, and at Llama-2-7B's width.

`compare` lines up a plan and a `ppo_memory` measurement part by part.
`real_width_check` builds a random Llama with Llama-2-7B's widths (hidden 4096,
intermediate 11008, vocabulary 32000, 32 heads) but only a few layers, loads it
in 4-bit NF4, runs one multi-adapter PPO step on CPU and compares the measured
bytes with the planner's, whole model and per decoder layer. Nothing is
downloaded: the weights, the tokenizer (32000 words) and the reward adapter are
made on the spot; the numbers they produce mean nothing, the bytes they take are
real.

Used by `tools/bench_memory.py` and the tests; taught in chapter 10.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import replace

from marlhf_edu.loading.models import SPECIAL_TOKENS
from marlhf_edu.loading.quantization import is_cpu_repacked, load_nf4
from marlhf_edu.loading.quiet import quiet_loading
from marlhf_edu.memory.measure import ppo_memory
from marlhf_edu.memory.plan import (LLAMA_2_7B, MemoryPlan, MemorySettings, ModelShape, STATE_PARTS,
                                    multi_adapter_settings, plan_four_model, plan_multi_adapter, saved_lora_recipe)
from marlhf_edu.ppo.config import PPOConfig
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
from marlhf_edu.ppo.trainer import PPOTrainer


def compare(plan: MemoryPlan, measured: dict) -> dict:
    """`{part: {"planned", "measured", "ratio"}}` for the model state, its total, one layer and the activations."""
    def row(planned, got):
        return {"planned": int(planned), "measured": int(got), "ratio": round(planned / got, 6) if got else None}

    out = {k: row(plan.parts[k], measured["model"][k]) for k in STATE_PARTS}
    out["model state"] = row(plan.model_state, measured["model"]["total"])
    out.update({f"layer {k}": row(plan.per_layer[k], measured["layer"][k]) for k in STATE_PARTS})
    out.update({k: row(plan.parts[k], v) for k, v in measured["activations"].items()})
    return out


def plan_for(trainer, shape: ModelShape, reward_adapter_dir, measured: dict | None = None) -> MemoryPlan:
    """The plan of a trainer's own configuration (the measured batch shape, if given)."""
    cfg = trainer.config
    reward_r, reward_targets = saved_lora_recipe(reward_adapter_dir)
    weight_dtype = str(next(trainer.backend.policy_model.parameters()).dtype).removeprefix("torch.")
    s = MemorySettings.from_ppo_config(cfg, reward_lora_r=reward_r, reward_targets=reward_targets,
                                       weight_dtype=weight_dtype)
    if measured is not None:
        m = measured["shape"]
        s = replace(s, forward_batch_size=m["rows"], prompt_length=m["prompt_length"],
                    response_length=m["response_length"])
    if isinstance(trainer.backend, MultiAdapterBackend):
        return plan_multi_adapter(shape, multi_adapter_settings(s))
    return plan_four_model(shape, s)


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly `vocab_size` tokens ('w4' … plus <unk> <s> </s> <pad>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def random_llama_config(shape: ModelShape, tokenizer, max_position_embeddings: int = 512):
    """The `LlamaConfig` of a random model of `shape` that uses `tokenizer`'s special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.kv_heads,
                       tie_word_embeddings=shape.tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       max_position_embeddings=max_position_embeddings)


def build_random_llama(shape: ModelShape, out_dir, reward_r: int = 32, reward_targets=None, seed: int = 0,
                       reward: bool = True, dtype=None):
    """Save a random Llama of `shape` (causal LM + tokenizer; fp32, or `dtype`) in `out_dir/model` and, with
    `reward`, a random SEQ_CLS LoRA reward adapter with its score head in `out_dir/reward`. Returns the two paths
    (the second is None without `reward`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, LlamaForCausalLM

    out_dir = pathlib.Path(out_dir)
    model_dir, reward_dir = out_dir / "model", out_dir / "reward"
    tokenizer = synthetic_tokenizer(shape.vocab_size)
    config = random_llama_config(shape, tokenizer)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(dtype or torch.float32).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    if not reward:
        return model_dir, None
    # the reward adapter is built on a 4-bit copy: its LoRA and head shapes are all that matter
    reward = load_nf4(AutoModelForSequenceClassification, model_dir, "cpu", num_labels=1)
    lora = LoraConfig(task_type="SEQ_CLS", r=reward_r, lora_alpha=8, target_modules=list(reward_targets or
                                                                                       ["q_proj", "k_proj", "v_proj", "o_proj"]))
    get_peft_model(reward, lora).save_pretrained(str(reward_dir))
    return model_dir, reward_dir


def real_width_check(workdir, num_layers: int = 2, value_mode: str = "adapter", lora_r: int = 64,
                     reward_r: int = 32, batch_size: int = 2, max_new_tokens: int = 8,
                     double_quant: bool = True, gradient_checkpointing: bool = False) -> dict:
    """One MA-PPO step on a `num_layers`-layer model of Llama-2-7B's widths in NF4 on CPU; measured vs planned.

    Returns `{"shape", "settings", "cpu_repacked_layers" (0 while `keep_nf4_trainable` guards the base),
    "comparison" (see `compare`), "seconds"}`.
    """
    import torch

    import contextlib
    import io

    start = time.perf_counter()
    shape = LLAMA_2_7B.with_layers(num_layers)
    with quiet_loading(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        model_dir, reward_dir = build_random_llama(shape, workdir, reward_r=reward_r)
        config = PPOConfig(sft_model_path=str(model_dir), reward_adapter_path=str(reward_dir), load_in_4bit=True,
                           double_quant=double_quant, value_mode=value_mode, actor_lora_r=lora_r, actor_lora_alpha=8,
                           batch_size=batch_size, mini_batch_size=batch_size, micro_batch_size=batch_size,
                           forward_batch_size=batch_size, max_new_tokens=max_new_tokens, max_prompt_length=16,
                           gradient_checkpointing=gradient_checkpointing,
                           device="cpu", eval_repeats=0, output_dir=str(pathlib.Path(workdir) / "run"))
        torch.manual_seed(0)
        backend = MultiAdapterBackend.from_config(config)
        prompts = [" ".join(f"w{100 * i + j}" for j in range(8)) for i in range(4 * batch_size)]
        trainer = PPOTrainer(backend, config, prompts)
        measured = ppo_memory(trainer)
    plan = plan_for(trainer, shape, reward_dir, measured)

    repacked = sum(is_cpu_repacked(m) for m in backend.model.modules())  # 0: the standard NF4 layout was measured
    return {"shape": vars(shape), "settings": dict(vars(plan.settings)), "cpu_repacked_layers": repacked,
            "comparison": compare(plan, measured), "seconds": round(time.perf_counter() - start, 1)}
