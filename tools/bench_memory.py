"""Measure PPO's memory against the planner and record the numbers the benchmarks page (site/benchmarks.md) quotes.

    python tools/bench_memory.py [--out benchmarks/memory.json] [--layers 2]

1. Tiny models, at the demonstration configs' own batch shapes: four-model PPO
   (`configs/tiny_ppo.yaml`) and MA-PPO in both value modes
   (`configs/tiny_ma_ppo.yaml`, NF4 base), each also with gradient
   checkpointing: measured bytes of every storage the models and AdamW hold and
   of the activations one update micro-batch saves, next to the planner's.
2. Llama-2-7B's widths with `--layers` decoder layers, NF4, one MA-PPO step on
   CPU in both value modes (and with gradient checkpointing): measured vs planned, whole model and per layer.
3. Llama-2-7B planned (`configs/memory_llama2_7b.yaml`), LoRA on q,k,v,o and on
   all seven linear layers: four-model vs MA-PPO.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time
from dataclasses import replace

from marlhf_edu.records import machine

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tiny(config_path: str, overrides: list[str]) -> dict:
    import torch

    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR
    from marlhf_edu.memory import ModelShape, ppo_memory
    from marlhf_edu.memory.check import compare, plan_for
    from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
    from marlhf_edu.teaching.book import quietly
    from marlhf_edu.training.args import parse_stage_args

    with tempfile.TemporaryDirectory() as tmp:
        (config,) = parse_stage_args((PPOConfig,), ["--config", str(ROOT / config_path), "--output_dir", tmp, *overrides])
        cls = MultiAdapterBackend if "ma_ppo" in config_path else FourModelBackend
        torch.manual_seed(config.seed)
        with quietly():
            trainer = PPOTrainer(cls.from_config(config), config, load_prompts(config))
            measured = ppo_memory(trainer)
        plan = plan_for(trainer, ModelShape.resolve("zoo"), REWARD_ADAPTER_DIR, measured)
    return {"config": " ".join([config_path, *overrides]), "architecture": plan.architecture,
            "measured_model_state": measured["model"]["total"], "measured": measured,
            "comparison": compare(plan, measured)}


def planned_7b() -> dict:
    from marlhf_edu.memory import plan_both
    from marlhf_edu.memory.settings import MemoryArguments, settings_and_shape
    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.training.args import parse_stage_args

    config, args = parse_stage_args((PPOConfig, MemoryArguments), ["--config", str(ROOT / "configs/memory_llama2_7b.yaml")])
    shape, s = settings_and_shape(config, args)
    out = {}
    for label, targets in (("q,k,v,o", ("q_proj", "k_proj", "v_proj", "o_proj")), ("all linear", tuple(shape.linear_shapes()))):
        for fmt, load_in_4bit in (("nf4", True), ("bf16", False)):
            plans = plan_both(shape, replace(s, policy_targets=targets, value_targets=targets, load_in_4bit=load_in_4bit))
            four = plans["four-model"].model_state
            out[f"{fmt}, LoRA r=64 on {label}"] = {
                name: {"model_state": p.model_state, "ratio_to_four_model": round(p.model_state / four, 4),
                       "parts": p.parts, "per_layer": p.per_layer, "trainable_params": p.trainable_params}
                for name, p in plans.items()}
    return out


def main(argv=None):
    from marlhf_edu.memory.check import real_width_check

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/memory.json")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = {"tiny": [tiny("configs/tiny_ppo.yaml", []),
                       tiny("configs/tiny_ma_ppo.yaml", ["--value_mode", "shared"]),
                       tiny("configs/tiny_ma_ppo.yaml", ["--value_mode", "adapter"]),
                       tiny("configs/tiny_ppo.yaml", ["--gradient_checkpointing", "true"]),
                       tiny("configs/tiny_ma_ppo.yaml", ["--value_mode", "adapter", "--gradient_checkpointing", "true"])]}
    result["real_width"] = []
    for mode, ckpt in (("shared", False), ("adapter", False), ("adapter", True)):
        with tempfile.TemporaryDirectory() as tmp:
            result["real_width"].append({"value_mode": mode, "num_layers": args.layers, "gradient_checkpointing": ckpt,
                                         **real_width_check(tmp, num_layers=args.layers, value_mode=mode,
                                                            gradient_checkpointing=ckpt)})
    result["planned_llama_2_7b"] = planned_7b()
    result["machine"] = machine()
    result["wall_s"] = round(time.perf_counter() - start, 1)
    (ROOT / args.out).write_text(json.dumps(result, indent=1) + "\n")
    worst = max(abs(row["ratio"] - 1) for entry in result["tiny"] + result["real_width"]
                for row in entry["comparison"].values() if row["ratio"] is not None)
    print(f"wrote {args.out} in {result['wall_s']} s; worst planned/measured deviation {worst:.2%}")


if __name__ == "__main__":
    main()
