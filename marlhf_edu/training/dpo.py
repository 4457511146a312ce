"""DPO: the policy trained on preference pairs with trl's `DPOTrainer`, a LoRA, and no reward model (`run_dpo`;
the command is `marlhf-edu dpo`, `marlhf_edu.stages.dpo`).

The same pairs as the reward model (stage 2) and the same SFT model as PPO (stage 3). With a LoRA and no
`ref_model`, trl's reference is the policy's base with the adapter disabled: one model in memory, as in
MA-PPO. The loss is `marlhf_edu.math.dpo.dpo_loss` (a test pins trl's against it). On toy data the trained policy
answers the held-out prompts afterwards (chapter 11's evaluation).

Taught in chapter 12.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.loading.sources import load_tokenizer, resolve_zoo
from marlhf_edu.training.args import DataArguments
from marlhf_edu.training.policy import (PolicyEvalArguments, check_reward_before_loading, check_reward_vocabulary,
                                        evaluate_after, load_policy, lora_policy_config)
from marlhf_edu.training.rows import check_lengths, load_preference_data, select_rows
from marlhf_edu.training.runs import check_output_dir, resume_checkpoint


@dataclass
class DPOScriptArguments(DataArguments, PolicyEvalArguments):
    dataset_format: str = field(default="pku-saferlhf", metadata={"help": "generic, hh-rlhf, pku-saferlhf or trl"})


def run_dpo(script_args: DPOScriptArguments, training_args, model_args, dataset=None):
    """Train, save the adapter, evaluate on toy data; return `(trainer, metrics)`."""
    from trl import DPOTrainer

    check_output_dir("dpo", script_args, training_args)  # before anything loads
    peft_config = lora_policy_config(model_args, "DPO")
    scored = script_args.dataset_name == "toy" and script_args.eval_repeats  # the evaluation after training
    reward = check_reward_before_loading(script_args) if scored else None
    tokenizer = load_tokenizer(resolve_zoo(model_args.model_name_or_path))
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
    return trainer, evaluate_after(trainer, tokenizer, script_args, training_args, reward)
