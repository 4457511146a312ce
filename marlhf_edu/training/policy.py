"""The policy of a trl stage (DPO, GRPO): loaded with its quantization, device map and dtype, wrapped in a LoRA,
and evaluated after training; and the reward adapter such a stage scores with, checked before loading."""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.adapters import RewardAdapter, check_same_vocabulary
from marlhf_edu.loading.quantization import keep_nf4_trainable
from marlhf_edu.loading.sources import load_tokenizer, resolve_zoo
from marlhf_edu.ppo.judging import evaluate_trained_policy


def quantization_and_device_map(model_args):
    """trl's own helpers: a `BitsAndBytesConfig` when `load_in_4bit`/`load_in_8bit`, else None."""
    import torch
    from trl import get_quantization_config

    quantization = get_quantization_config(model_args)
    if quantization is None:
        return {}
    # one process, one device: the whole model on it (accelerate's multi-GPU launch sets the rank's device)
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return {"quantization_config": quantization, "device_map": {"": device}}


def torch_dtype(model_args):
    import torch

    name = model_args.dtype
    if name in (None, "auto"):
        return None if name is None else "auto"
    return getattr(torch, name)


@dataclass
class PolicyEvalArguments:
    """The held-out toy evaluation after a DPO or GRPO run (toy data only)."""

    eval_repeats: int = field(default=4, metadata={"help": "answers per held-out toy prompt after training; 0 = none"})
    eval_max_new_tokens: int = field(default=32, metadata={"help": "token budget of each held-out answer"})
    reward_adapter_path: str = field(default="zoo", metadata={"help": "reward adapter that scores the answers ('zoo' = shipped)"})
    reward_base_path: str = field(default="zoo", metadata={"help": "base model of the reward adapter ('zoo' = shipped SFT)"})


def load_policy(model_args):
    """The SFT model to train (`zoo` = the shipped tiny one) and its tokenizer, optionally 4-bit."""
    from transformers import AutoModelForCausalLM

    path = resolve_zoo(model_args.model_name_or_path)
    kwargs = quantization_and_device_map(model_args)
    if torch_dtype(model_args) is not None:
        kwargs["dtype"] = torch_dtype(model_args)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    keep_nf4_trainable(model)  # a 4-bit base must stay trainable after trl's no-grad evaluations (chapter 10)
    return model, load_tokenizer(path)


def lora_policy_config(model_args, stage: str):
    """trl's peft config of the run, which must be a causal-LM LoRA: its disabled adapter is the reference."""
    from trl import get_peft_config


    peft_config = get_peft_config(model_args)
    if peft_config is None:
        raise ConfigError(f"{stage} in this book trains a LoRA (use_peft: true), so that the reference is the base "
                          "with the adapter disabled rather than a second copy of the model")
    if str(peft_config.task_type) != "CAUSAL_LM":
        raise ConfigError(f"lora_task_type must be CAUSAL_LM for a {stage} policy, got {peft_config.task_type}")
    return peft_config


def evaluate_after(trainer, tokenizer, script_args, training_args, reward: RewardAdapter) -> dict:
    """The held-out toy evaluation of the trained policy (`{}` unless toy data and `eval_repeats` > 0), scored by
    `reward` as `check_reward_before_loading` resolved and checked it."""
    if script_args.dataset_name != "toy" or not script_args.eval_repeats:
        return {}

    return evaluate_trained_policy(
        trainer.model, tokenizer, toy_seed=script_args.toy_seed, reward_base=reward.base,
        reward_adapter=reward.folder, repeats=script_args.eval_repeats, max_new_tokens=script_args.eval_max_new_tokens,
        seed=1000 + training_args.seed, output_dir=training_args.output_dir)


def check_reward_before_loading(script_args) -> RewardAdapter:
    """The reward adapter a trl stage scores with (GRPO's reward, the evaluation after DPO or GRPO), resolved and
    checked once, before any model (or the policy's tokenizer, which can convert a GGUF model) loads: a folder with
    exactly one score head that fits the width of `reward_base_path`, trained on that base (the base its
    `adapter_config.json` records; a `reward_base_path` other than `zoo` says it belongs there under another name,
    as in PPO). `check_reward_vocabulary` follows once the policy's tokenizer is loaded."""
    return RewardAdapter.resolve(script_args.reward_adapter_path, script_args.reward_base_path,
                                 base_named=script_args.reward_base_path != "zoo")


def check_reward_vocabulary(script_args, tokenizer) -> None:
    """The reward model reads the policy's vocabulary (`tokenizer`), compared from the tokenizers alone: a scorer
    fed another vocabulary's ids returns numbers, not an error."""
    check_same_vocabulary(tokenizer, load_tokenizer(resolve_zoo(script_args.reward_base_path)))
