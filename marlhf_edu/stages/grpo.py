"""GRPO: the policy trained on its own sampled answers with trl's `GRPOTrainer`, a LoRA, and no critic.

    marlhf-edu grpo --config configs/tiny_grpo.yaml [--key value ...]

The work is `marlhf_edu.training.grpo.run_grpo` (its docstring says what the stage does and why).

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
