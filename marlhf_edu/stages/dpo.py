"""DPO: the policy trained on preference pairs with trl's `DPOTrainer`, a LoRA, and no reward model.

    marlhf-edu dpo --config configs/tiny_dpo.yaml [--key value ...]

The same pairs as the reward model (stage 2) and the same SFT model as PPO (stage 3). With a LoRA and no
`ref_model`, trl's reference is the policy's base with the adapter disabled: one model in memory, as in
MA-PPO. The loss is `marlhf_edu.math.dpo.dpo_loss` (a test pins trl's against it). On toy data the trained policy
answers the held-out prompts afterwards (chapter 11's evaluation).

Taught in chapter 12.
"""

from __future__ import annotations

from marlhf_edu.training.args import parse_stage_args
from marlhf_edu.training.dpo import DPOScriptArguments, run_dpo
from marlhf_edu.training.runs import run_trl_stage


def main(argv: list[str] | None = None):
    from trl import DPOConfig, ModelConfig

    script_args, training_args, model_args = parse_stage_args((DPOScriptArguments, DPOConfig, ModelConfig), argv)
    return run_trl_stage("dpo", run_dpo, script_args, training_args, model_args)
