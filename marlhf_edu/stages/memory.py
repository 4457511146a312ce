"""`marlhf-edu memory --config FILE`: four-model PPO and MA-PPO side by side, planned before anything loads.

    marlhf-edu memory --config configs/tiny_ma_ppo.yaml
    marlhf-edu memory --config configs/memory_llama2_7b.yaml
    marlhf-edu memory --config configs/tiny_ma_ppo.yaml --model_shape llama-2-7b --actor_lora_r 64

Reads a PPO config (the same file `ppo` / `ma-ppo` run) plus a few planning
options, and prints the planner's table. Taught in chapter 10.
"""

from __future__ import annotations

from marlhf_edu.memory.plan import ALL_LINEAR, memory_table, plan_both
from marlhf_edu.memory.settings import MemoryArguments, settings_and_shape
from marlhf_edu.ppo.config import PPOConfig
from marlhf_edu.training.args import parse_stage_args


def main(argv: list[str] | None = None):
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
