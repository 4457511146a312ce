"""DPO: the policy trained on preference pairs with trl's `DPOTrainer`, a LoRA, and no reward model.

    marlhf-edu dpo --config configs/tiny_dpo.yaml [--key value ...]

The same pairs as the reward model (stage 2) and the same SFT model as PPO (stage 3). With a LoRA and no
`ref_model`, trl's reference is the policy's base with the adapter disabled: one model in memory, as in
MA-PPO. The loss is `marlhf_edu.dpo.dpo_loss` (a test pins trl's against it). On toy data the trained policy
answers the held-out prompts afterwards (chapter 11's evaluation).

Taught in chapter 12.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.errors import ConfigError
from marlhf_edu.stages.common import DataArguments


@dataclass
class PolicyEvalArguments:
    """The held-out toy evaluation after a DPO or GRPO run (toy data only)."""

    eval_repeats: int = field(default=4, metadata={"help": "answers per held-out toy prompt after training; 0 = none"})
    eval_max_new_tokens: int = field(default=32, metadata={"help": "token budget of each held-out answer"})
    reward_adapter_path: str = field(default="zoo", metadata={"help": "reward adapter that scores the answers ('zoo' = shipped)"})
    reward_base_path: str = field(default="zoo", metadata={"help": "base model of the reward adapter ('zoo' = shipped SFT)"})


@dataclass
class DPOScriptArguments(DataArguments, PolicyEvalArguments):
    dataset_format: str = field(default="pku-saferlhf", metadata={"help": "generic, hh-rlhf, pku-saferlhf or trl"})


def load_policy(model_args):
    """The SFT model to train (`zoo` = the shipped tiny one) and its tokenizer, optionally 4-bit."""
    from transformers import AutoModelForCausalLM

    from marlhf_edu.models import SFT_DIR, load_tokenizer
    from marlhf_edu.quantization import keep_nf4_trainable
    from marlhf_edu.stages.common import quantization_and_device_map, resolve_zoo, torch_dtype

    path = resolve_zoo(model_args.model_name_or_path, SFT_DIR)
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


def evaluate_after(trainer, tokenizer, script_args, training_args) -> dict:
    """The held-out toy evaluation of the trained policy (`{}` unless toy data and `eval_repeats` > 0)."""
    if script_args.dataset_name != "toy" or not script_args.eval_repeats:
        return {}
    from marlhf_edu.models import REWARD_ADAPTER_DIR, SFT_DIR
    from marlhf_edu.stages.common import evaluate_trained_policy, resolve_zoo

    return evaluate_trained_policy(
        trainer.model, tokenizer, toy_seed=script_args.toy_seed,
        reward_base=resolve_zoo(script_args.reward_base_path, SFT_DIR),
        reward_adapter=resolve_zoo(script_args.reward_adapter_path, REWARD_ADAPTER_DIR),
        repeats=script_args.eval_repeats, max_new_tokens=script_args.eval_max_new_tokens,
        seed=1000 + training_args.seed, output_dir=training_args.output_dir)


def check_reward_before_loading(script_args) -> None:
    """The reward adapter a trl stage scores with (GRPO's reward, the evaluation after DPO or GRPO), checked
    before any model (or the policy's tokenizer, which can convert a GGUF model) loads: a folder with exactly one
    score head that fits the width of `reward_base_path`, trained on that base (the base its
    `adapter_config.json` records; a `reward_base_path` other than `zoo` says it belongs there under another name,
    as in PPO). `check_reward_vocabulary` follows once the policy's tokenizer is loaded."""
    from marlhf_edu.models import REWARD_ADAPTER_DIR, SFT_DIR
    from marlhf_edu.ppo.multi_adapter import check_reward_adapter_base, check_reward_head
    from marlhf_edu.sources import require_adapter_folder
    from marlhf_edu.stages.common import resolve_zoo

    adapter = resolve_zoo(script_args.reward_adapter_path, REWARD_ADAPTER_DIR)
    base = resolve_zoo(script_args.reward_base_path, SFT_DIR)
    require_adapter_folder(adapter, "reward_adapter_path")
    check_reward_head(adapter, base)  # the base it goes on
    if script_args.reward_base_path == "zoo":
        check_reward_adapter_base(adapter, base)


def check_reward_vocabulary(script_args, tokenizer) -> None:
    """The reward model reads the policy's vocabulary (`tokenizer`), compared from the tokenizers alone: a scorer
    fed another vocabulary's ids returns numbers, not an error."""
    from marlhf_edu.models import SFT_DIR, load_tokenizer
    from marlhf_edu.ppo.backends import check_same_vocabulary
    from marlhf_edu.stages.common import resolve_zoo

    check_same_vocabulary(tokenizer, load_tokenizer(resolve_zoo(script_args.reward_base_path, SFT_DIR)))


def run_dpo(script_args: DPOScriptArguments, training_args, model_args, dataset=None):
    """Train, save the adapter, evaluate on toy data; return `(trainer, metrics)`."""
    from trl import DPOTrainer

    from marlhf_edu.models import SFT_DIR, load_tokenizer
    from marlhf_edu.stages.common import check_output_dir, resolve_zoo, resume_checkpoint, select_rows
    from marlhf_edu.stages.reward import check_lengths, load_preference_data

    check_output_dir("dpo", script_args, training_args)  # before anything loads
    peft_config = lora_policy_config(model_args, "DPO")
    scored = script_args.dataset_name == "toy" and script_args.eval_repeats  # the evaluation after training
    if scored:
        check_reward_before_loading(script_args)
    tokenizer = load_tokenizer(resolve_zoo(model_args.model_name_or_path, SFT_DIR))
    if scored:
        check_reward_vocabulary(script_args, tokenizer)
    if dataset is None:  # max_tokens and max_rows, reported, as in the reward-model stage
        dataset = select_rows(load_preference_data(script_args, tokenizer), tokenizer, script_args, "preference")
    check_lengths(dataset, tokenizer, training_args.max_length)  # before the model loads
    model, _ = load_policy(model_args)
    trainer = DPOTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config)
    # `--resume_from_checkpoint true`: the newest complete checkpoint-N (transformers read "true" as a folder)
    trainer.train(resume_from_checkpoint=resume_checkpoint("dpo", training_args, log=print))
    trainer.save_model(training_args.output_dir)
    return trainer, evaluate_after(trainer, tokenizer, script_args, training_args)


def main(argv: list[str] | None = None):
    from trl import DPOConfig, ModelConfig

    from marlhf_edu.stages.common import parse_stage_args, run_trl_stage

    script_args, training_args, model_args = parse_stage_args((DPOScriptArguments, DPOConfig, ModelConfig), argv)
    return run_trl_stage("dpo", run_dpo, script_args, training_args, model_args)
