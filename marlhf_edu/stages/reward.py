"""Stage 2: the reward model, with trl's `RewardTrainer` and a SEQ_CLS LoRA.

    marlhf-edu rm --config configs/tiny_rm.yaml [--key value ...]

The work is `marlhf_edu.training.reward.run_rm` (its docstring says what the stage does and why).

Taught in chapter 08.
"""

from __future__ import annotations

from marlhf_edu.training.args import parse_stage_args
from marlhf_edu.training.reward import RMScriptArguments, run_rm
from marlhf_edu.training.runs import run_trl_stage


def main(argv: list[str] | None = None):
    from trl import ModelConfig, RewardConfig

    script_args, training_args, model_args = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig), argv)
    return run_trl_stage("rm", run_rm, script_args, training_args, model_args)
