"""The planning options of `marlhf-edu memory` and `preflight` (`MemoryArguments`), and the memory settings and
model shape a PPO config plus those options describe (`settings_and_shape`). Taught in chapter 10."""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.sources import resolve_zoo
from marlhf_edu.memory.plan import MemorySettings, ModelShape, saved_lora_recipe


@dataclass
class MemoryArguments:
    model_shape: str = field(default="", metadata={"help": "preset ('llama-2-7b', 'tiny') or a model directory; "
                                                           "empty = the config's sft_model_path"})
    weight_dtype: str = field(default="auto", metadata={"help": "dtype of unquantized weights; 'auto' = bfloat16 on "
                                                                "cuda, float32 on cpu"})
    reward_lora_r: int = field(default=0, metadata={"help": "rank of the reward adapter; 0 = read its adapter_config.json"})
    reward_target_modules: list[str] = field(default_factory=list, metadata={"help": "empty = from the adapter's config"})
    optimizer: str = field(default="adamw", metadata={"help": "'adamw', 'adamw_8bit' or 'sgd'"})
    prompt_length: int = field(default=0, metadata={"help": "tokens per prompt; 0 = max_prompt_length"})


def settings_and_shape(config, args: MemoryArguments):
    """The `(ModelShape, MemorySettings)` a PPO config and the planning options describe."""
    shape = ModelShape.resolve(args.model_shape or config.sft_model_path)
    r, targets = args.reward_lora_r, list(args.reward_target_modules)
    if not r or not targets:
        adapter = resolve_zoo(config.reward_adapter_path, "reward_adapter")
        saved = saved_lora_recipe(adapter)
        if saved is None and not r:
            raise ConfigError(f"reward adapter {adapter} not found: pass --reward_lora_r (and "
                              f"--reward_target_modules) to plan without it")
        if saved is not None:
            r, targets = r or saved[0], targets or list(saved[1])
    dtype = args.weight_dtype
    if dtype == "auto":
        dtype = "bfloat16" if config.device.startswith("cuda") else "float32"
    settings = MemorySettings.from_ppo_config(config, reward_lora_r=r, reward_targets=targets or config.lora_target_modules,
                                              weight_dtype=dtype, optimizer=args.optimizer,
                                              prompt_length=args.prompt_length)
    return shape, settings.validate()
