"""The 7B recipe's configs (configs/llama2_7b/) parse with their stages' own arguments and plan within MA-RLHF's
24 GB GPUs. Running them needs the gated base and a GPU (issue 14); these checks catch a renamed or mistyped key."""

import pytest

from marlhf_edu.ppo import PPOConfig
from marlhf_edu.stages.memory import main as memory_main
from marlhf_edu.training.args import parse_stage_args

CPU = ["--bf16", "false", "--use_cpu", "true"]  # transformers refuses bf16 where no GPU is visible


def test_sft_and_rm_configs_parse():
    from trl import ModelConfig, RewardConfig, SFTConfig

    from marlhf_edu.training.reward import RMScriptArguments
    from marlhf_edu.training.sft import SFTScriptArguments

    script, train, model = parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig),
                                            ["--config", "configs/llama2_7b/sft.yaml", *CPU])
    assert script.dataset_format == "pku-saferlhf" and model.lora_r == 64 and model.lora_alpha == 8
    assert train.gradient_checkpointing and train.learning_rate == pytest.approx(2e-5)
    assert train.per_device_train_batch_size * train.gradient_accumulation_steps == 16
    script, train, model = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig),
                                            ["--config", "configs/llama2_7b/rm.yaml", *CPU])
    assert model.lora_r == 32 and model.lora_modules_to_save == ["score"] and model.lora_task_type == "SEQ_CLS"
    assert train.learning_rate == pytest.approx(2e-5) and script.eval_split == "test"


def test_ma_ppo_config_parses_and_plans_within_24_gb(capsys):
    (config,) = parse_stage_args((PPOConfig,), ["--config", "configs/llama2_7b/ma_ppo.yaml"])
    config.validate()
    assert (config.actor_lora_r, config.batch_size, config.max_prompt_length, config.max_new_tokens) == (64, 16, 64, 256)
    assert config.learning_rate == pytest.approx(1e-5) and config.ppo_epochs == 1 and config.gradient_checkpointing
    plans = memory_main(["--config", "configs/llama2_7b/ma_ppo.yaml", "--model_shape", "llama-2-7b",
                         "--weight_dtype", "bfloat16", "--reward_lora_r", "32",
                         "--reward_target_modules", "q_proj", "k_proj", "v_proj", "o_proj"])
    out = capsys.readouterr().out
    assert "6,738,415,616 parameters" in out
    shared = plans["MA-PPO shared"]
    assert shared.peak < 24 * 2**30  # MA-RLHF trained on 24 GB GPUs
    assert plans["four-model"].peak > 2 * shared.peak
