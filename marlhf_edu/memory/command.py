"""`marlhf-edu memory --config FILE`: four-model PPO and MA-PPO side by side, planned before anything loads.

    marlhf-edu memory --config configs/tiny_ma_ppo.yaml
    marlhf-edu memory --config configs/memory_llama2_7b.yaml
    marlhf-edu memory --config configs/tiny_ma_ppo.yaml --model_shape llama-2-7b --actor_lora_r 64

Reads a PPO config (the same file `ppo` / `ma-ppo` run) plus a few planning
options, and prints the planner's table. Taught in chapter 10.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.errors import ConfigError


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
    from marlhf_edu.memory.plan import MemorySettings, ModelShape, saved_lora_recipe
    from marlhf_edu.models import REWARD_ADAPTER_DIR

    shape = ModelShape.resolve(args.model_shape or config.sft_model_path)
    r, targets = args.reward_lora_r, list(args.reward_target_modules)
    if not r or not targets:
        adapter = REWARD_ADAPTER_DIR if config.reward_adapter_path == "zoo" else config.reward_adapter_path
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


def main(argv: list[str] | None = None):
    from marlhf_edu.memory.plan import ALL_LINEAR, memory_table, plan_both
    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.stages.common import parse_stage_args

    config, args = parse_stage_args((PPOConfig, MemoryArguments), argv)
    config.validate()
    shape, s = settings_and_shape(config, args)
    plans = plan_both(shape, s, lora_baseline=True)
    quant = ("NF4" + (" + double quant" if s.double_quant else "")) if s.load_in_4bit else s.weight_dtype
    print(f"model: {shape.name}: {shape.n_params:,} parameters, {shape.num_layers} layers, hidden {shape.hidden_size}, "
          f"vocabulary {shape.vocab_size}")
    def modules(names):
        return ",".join(m.removesuffix("_proj") for m in ALL_LINEAR if m in names)

    policy = (f"LoRA r={s.policy_lora_r} on {modules(s.policy_targets)}" if s.policy_lora_r
              else "full fine-tuning (MA-PPO: LoRA r=16)")
    print(f"recipe: base {quant} (other weights {s.weight_dtype}); policy and value: {policy}; reward: LoRA "
          f"r={s.reward_lora_r} on {modules(s.reward_targets)}; {s.optimizer}; "
          f"{s.forward_batch_size} rows × ({s.prompt_length} + {s.response_length}) tokens per forward")
    print("four-model: each role on its own copy of the base, same recipe. LoRA PPO (trl 0.11 with peft, MA-RLHF's "
          "LoRA PPO): one policy base with LoRA and a value head, the reference = that base with the adapter disabled, "
          f"the reward model on a second base. The config's MA-PPO value_mode is {config.value_mode!r}\n")
    print(memory_table(plans))
    return plans
