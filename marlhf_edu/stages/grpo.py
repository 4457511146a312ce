"""GRPO: the policy trained on its own sampled answers with trl's `GRPOTrainer`, a LoRA, and no critic.

    marlhf-edu grpo --config configs/tiny_grpo.yaml [--key value ...]

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

from marlhf_edu.training.args import parse_stage_args
from marlhf_edu.training.grpo import GRPOScriptArguments, run_grpo
from marlhf_edu.training.runs import run_trl_stage


def main(argv: list[str] | None = None):
    from trl import GRPOConfig, ModelConfig

    script_args, training_args, model_args = parse_stage_args((GRPOScriptArguments, GRPOConfig, ModelConfig), argv)
    return run_trl_stage("grpo", run_grpo, script_args, training_args, model_args)
