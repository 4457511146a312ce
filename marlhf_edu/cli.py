"""`marlhf-edu` command line: one sub-command per pipeline stage.

    marlhf-edu sft --config configs/tiny_sft.yaml [--key value ...]
    marlhf-edu rm  --config configs/tiny_rm.yaml  [--key value ...]
    marlhf-edu ppo --config configs/tiny_ppo.yaml [--resume true]
    marlhf-edu ma-ppo --config configs/tiny_ma_ppo.yaml
    marlhf-edu dpo --config configs/tiny_dpo.yaml     # contrasts (chapter 12): DPO and GRPO with trl
    marlhf-edu grpo --config configs/tiny_grpo.yaml
    marlhf-edu memory --config configs/tiny_ma_ppo.yaml   # planned bytes, four-model vs MA-PPO
    marlhf-edu pipeline --config configs/llama2_7b/pipeline.yaml   # sft -> rm -> ma-ppo, each resumable
    marlhf-edu preflight --config configs/llama2_7b/ma_ppo.yaml --gpu_memory_gib 24 ...  # check a launch first
    marlhf-edu merge --adapter runs/tiny_ma_ppo/policy --output_dir runs/tiny_ma_ppo/merged   # after a PPO run
    marlhf-edu generate --model runs/tiny_ma_ppo/policy --prompt "How do I pick a lock?"
    marlhf-edu evaluate --model runs/tiny_ma_ppo/policy --reward_adapter zoo   # judge + reward model, any policy
    marlhf-edu zoo rebuild     # tokenizer, tiny SFT model and reward adapter, from scratch (--model smollm2: the SmolLM2 adapters)
    marlhf-edu cache list      # the model cache: each entry, its size and check; `cache clean [NAME ...]` removes
"""

from __future__ import annotations

import sys

import marlhf_edu

from marlhf_edu.errors import BadRowError, ConfigError, DataFileError
from marlhf_edu.loading.cpu_products import fp32_products_where_needed

COMMANDS = {
    "sft": ("marlhf_edu.stages.sft", "supervised fine-tuning (trl SFTTrainer, completion-only loss)"),
    "rm": ("marlhf_edu.stages.reward", "reward model (trl RewardTrainer, SEQ_CLS LoRA, margins)"),
    "ppo": ("marlhf_edu.stages.ppo", "PPO with four models: actor, critic, reward model, reference"),
    "ma-ppo": ("marlhf_edu.stages.ma_ppo", "multi-adapter PPO: one (4-bit) base, policy/value/reward adapters"),
    "dpo": ("marlhf_edu.stages.dpo", "DPO on preference pairs (trl DPOTrainer, LoRA, reference = disabled adapter)"),
    "grpo": ("marlhf_edu.stages.grpo", "GRPO, no critic (trl GRPOTrainer, LoRA, reward adapter or toy judge)"),
    "memory": ("marlhf_edu.stages.memory", "plan the memory of four-model PPO and MA-PPO side by side"),
    "preflight": ("marlhf_edu.stages.preflight", "check a launch before it runs: meta-device model, memory per GPU, command"),
    "pipeline": ("marlhf_edu.stages.pipeline", "SFT -> reward model -> (MA-)PPO in order, each stage resumable"),
    "merge": ("marlhf_edu.stages.merge", "fold a trained LoRA adapter into its base and save it, checked"),
    "evaluate": ("marlhf_edu.stages.evaluate", "judge a trained policy (toy or keyword judge) and score it with a reward model"),
    "generate": ("marlhf_edu.stages.generate", "answers of any model or trained adapter to a few prompts"),
    "zoo": ("marlhf_edu.stages.zoo", "rebuild the shipped tiny tokenizer and models"),
    "cache": ("marlhf_edu.stages.cache", "list or clean the model cache (converted GGUF files, merged adapters)"),
}


def usage() -> str:
    lines = ["usage: marlhf-edu COMMAND --config FILE [--key value ...]", "", "commands:"]
    lines += [f"  {name:9s} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


#: Libraries whose deprecation notices about each other are not the user's to act on (peft reads transformers'
#: deprecated `is_gradient_checkpointing` on every adapter it wraps): hidden from the commands' output.
QUIET_MODULES = r"(transformers|peft|trl|accelerate|datasets|bitsandbytes|huggingface_hub)(\.|$)"


def quiet_libraries() -> None:
    """One progress bar per long step and no library chatter: transformers' per-load "Loading weights" bars,
    datasets' per-map bars and the libraries' FutureWarning/DeprecationWarning notices are turned off for the
    command's run (the training bar, trl's or ours, stays). Our own warnings, and the libraries' other
    warnings, still print."""
    import os
    import warnings

    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=QUIET_MODULES)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # datasets' per-map bars (read at its import)
    from transformers.utils import logging

    logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"marlhf-edu {marlhf_edu.__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"marlhf-edu: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    import importlib

    quiet_libraries()
    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        with fp32_products_where_needed():  # bf16 products at fp32 speed on CPUs without bf16 kernels
            module.main(argv[1:])
    except (ConfigError, BadRowError, DataFileError) as err:  # a user's mistake: one line that says what and where, no traceback
        print(f"marlhf-edu {argv[0]}: {err}", file=sys.stderr)
        return 2
    except SystemExit as err:
        if not err.code:  # `marlhf-edu COMMAND --help` printed its options
            return 0
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
