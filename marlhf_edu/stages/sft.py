"""Stage 1: supervised fine-tuning with trl's `SFTTrainer` and completion-only loss.

    marlhf-edu sft --config configs/tiny_sft.yaml [--key value ...]

`model_name_or_path: tiny-llama` starts the toy world's tiny Llama from random
weights (it has no pretraining); any other value is loaded with
`from_pretrained`. `load_in_4bit` and `use_peft` (trl's `ModelConfig`) turn the
same stage into QLoRA: a config switch, not another code path.

Taught in chapter 07.
"""

from __future__ import annotations

from marlhf_edu.training.args import parse_stage_args
from marlhf_edu.training.runs import run_trl_stage
from marlhf_edu.training.sft import SFTScriptArguments, run_sft


def main(argv: list[str] | None = None):
    from trl import ModelConfig, SFTConfig

    script_args, training_args, model_args = parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig), argv)
    return run_trl_stage("sft", run_sft, script_args, training_args, model_args)
