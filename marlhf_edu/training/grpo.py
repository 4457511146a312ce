"""GRPO: the policy trained on its own sampled answers with trl's `GRPOTrainer`, a LoRA, and no critic
(`run_grpo`; the command is `marlhf-edu grpo`, `marlhf_edu.stages.grpo`).

Each prompt is answered `num_generations` times; each answer's advantage is its reward relative to its
group's (`marlhf_edu.math.grpo.group_relative_advantages`), and the KL to the reference is a k3 loss term
(`marlhf_edu.math.grpo.grpo_loss`); a test pins trl's numbers against both. With a LoRA the reference is the
base with the adapter disabled (the GRPO-LoRA design: one backbone for actor and reference, as MA-PPO).

The reward (`reward: reward_model`) is the frozen reward adapter's score of prompt + answer, read as PPO
reads it, with the same missing-EOS penalty; `reward: gold` trains on the toy world's judge instead. On
toy data the judge is also passed with weight 0, so trl logs it (`rewards/gold/mean`) without optimising
it, as PPO's `gold_reward_fn` does (chapter 11).

Taught in chapter 12.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.data.prompts import load_prompts
from marlhf_edu.data.template import format_completion
from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.models import load_reward_model
from marlhf_edu.loading.quiet import quiet_loading
from marlhf_edu.loading.sources import load_tokenizer, resolve_zoo
from marlhf_edu.math.scoring import penalise_missing_eos, score_texts_with, sequence_scores
from marlhf_edu.training.args import DataArguments
from marlhf_edu.training.policy import (PolicyEvalArguments, check_reward_before_loading, check_reward_vocabulary,
                                        evaluate_after, load_policy, lora_policy_config)
from marlhf_edu.training.runs import check_output_dir, resume_checkpoint

REWARDS = ("reward_model", "gold")


@dataclass
class GRPOScriptArguments(DataArguments, PolicyEvalArguments):
    reward: str = field(default="reward_model", metadata={"help": "what GRPO optimises: 'reward_model' or 'gold' (toy only)"})
    missing_eos_penalty: float = field(default=5.0, metadata={"help": "subtracted from the reward of an answer "
                                                                      "cut off before EOS (as PPO's)"})
    apply_template: bool = field(default=True, metadata={"help": "wrap a dataset's prompts in the chat template"})
    max_prompt_length: int = field(default=0, metadata={"help": "longest prompt in tokens (0 = no limit): a longer "
                                                                "one is an error unless drop_long_prompts"})
    drop_long_prompts: bool = field(default=False, metadata={"help": "drop prompts over max_prompt_length and say how "
                                                                     "many, instead of the error"})


class RewardModelReward:
    """A reward function for trl's `GRPOTrainer`: the reward model's score of each prompt + answer, minus
    `missing_eos_penalty` for an answer that never reached EOS.

    trl scores text with a reward *model* as plain prompt + completion without EOS; ours was trained with the
    answer as `format_completion` writes it and EOS appended (chapter 08), so this callable scores exactly
    that (`score_texts_with`, as `sample_toy` does)."""

    __name__ = "reward_model"  # trl names a reward function's logged metrics after it

    def __init__(self, reward_model, tokenizer, missing_eos_penalty: float = 5.0, batch_size: int = 64):
        self.model, self.tokenizer = reward_model.eval(), tokenizer
        self.missing_eos_penalty, self.batch_size = missing_eos_penalty, batch_size

    def __call__(self, prompts, completions, completion_ids, **_) -> list[float]:
        import torch

        texts = [p + format_completion(c) for p, c in zip(prompts, completions, strict=True)]
        device = next(self.model.parameters()).device
        # every answer is read with EOS appended (score_texts_with's add_eos), a cut-off one too, as PPO reads it
        scores = score_texts_with(lambda ids, mask: sequence_scores(self.model, ids, mask), self.tokenizer, texts,
                                  self.batch_size, device=device)
        eos = self.tokenizer.eos_token_id
        has_eos = torch.tensor([bool(ids) and ids[-1] == eos for ids in completion_ids])
        if len(has_eos) != len(scores):
            raise ValueError(f"RewardModelReward: {len(scores)} completions but {len(has_eos)} completion_ids")
        # in float64, as Python floats: the rewards trl receives are the float32 scores less the penalty, exactly
        return penalise_missing_eos(scores.double(), has_eos, self.missing_eos_penalty).tolist()


def gold_reward(world):
    """The toy world's judge as a trl reward function (1 for the right answer or a refusal of harm, else 0)."""
    def gold(prompts, completions, **_):
        return world.gold_rewards(prompts, completions)
    return gold


def run_grpo(script_args: GRPOScriptArguments, training_args, model_args):
    """Train, save the adapter, evaluate on toy data; return `(trainer, metrics)`."""
    from datasets import Dataset
    from trl import GRPOTrainer

    check_output_dir("grpo", script_args, training_args)  # before anything loads
    if script_args.reward not in REWARDS:
        raise ConfigError(f"reward must be one of {REWARDS}, got {script_args.reward!r}")
    toy = script_args.dataset_name == "toy"
    if script_args.reward == "gold" and not toy:
        raise ConfigError("reward: gold needs the toy world's judge (dataset_name: toy)")
    if training_args.reward_weights is not None:
        raise ConfigError("reward_weights is set by the stage (the reward, and the toy judge at weight 0)")
    peft_config = lora_policy_config(model_args, "GRPO")
    if script_args.drop_long_prompts and not script_args.max_prompt_length:
        raise ConfigError("drop_long_prompts needs max_prompt_length (the limit to drop at)")
    if script_args.max_tokens:
        raise ConfigError("max_tokens keeps preference or SFT rows whose prompt and answer fit; GRPO samples its "
                          "answers: limit the prompts with max_prompt_length (and drop_long_prompts)")
    # the reward model, the prompts and their lengths are checked with the tokenizers alone, before any model loads
    scored = script_args.reward == "reward_model" or (toy and script_args.eval_repeats)  # before training, not after
    reward = check_reward_before_loading(script_args) if scored else None
    tokenizer = load_tokenizer(resolve_zoo(model_args.model_name_or_path))
    if scored:
        check_reward_vocabulary(script_args, tokenizer)
    texts = load_prompts(script_args, tokenizer)  # rendered with the policy's own chat template
    if script_args.max_rows and len(texts) > script_args.max_rows:
        print(f"prompts: using the first {script_args.max_rows} of {len(texts)} (max_rows)")
        texts = texts[:script_args.max_rows]
    if script_args.max_prompt_length and not script_args.drop_long_prompts:
        lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
        long = [i for i, n in enumerate(lengths) if n > script_args.max_prompt_length]
        if long:
            raise ConfigError(f"{len(long)} of {len(texts)} prompts exceed max_prompt_length="
                              f"{script_args.max_prompt_length} tokens (first: prompt {long[0]}, {lengths[long[0]]} "
                              "tokens); raise it or pass --drop_long_prompts true")
    with quiet_loading():
        model, tokenizer = load_policy(model_args)
    funcs, weights = [], []
    if script_args.reward == "reward_model":
        with quiet_loading():
            rm, _ = load_reward_model(reward.base, reward.folder)
        funcs.append(RewardModelReward(rm.to(model.device), tokenizer, script_args.missing_eos_penalty))
        weights.append(1.0)
    if toy:
        funcs.append(gold_reward(ToyWorld(ToyWorldConfig(seed=script_args.toy_seed))))
        weights.append(1.0 if script_args.reward == "gold" else 0.0)  # logged, not optimised, unless chosen
    training_args.reward_weights = weights
    prompts = Dataset.from_list([{"prompt": p} for p in texts])
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=training_args, train_dataset=prompts,
                          processing_class=tokenizer, peft_config=peft_config)
    # `--resume_from_checkpoint true`: the newest complete checkpoint-N (transformers read "true" as a folder)
    trainer.train(resume_from_checkpoint=resume_checkpoint("grpo", training_args, log=print))
    trainer.save_model(training_args.output_dir)
    return trainer, evaluate_after(trainer, tokenizer, script_args, training_args, reward)
