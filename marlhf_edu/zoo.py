"""Rebuild the shipped tiny tokenizer, SFT model and reward adapter from scratch.

    marlhf-edu zoo rebuild [--configs configs] [--out marlhf_edu/assets]

Deterministic: the same seeds give the same files. Runs the real stage code
(trl `SFTTrainer`, `RewardTrainer`) with `configs/tiny_sft.yaml` and
`configs/tiny_rm.yaml`, then measures both models on held-out toy prompts and
writes the numbers to `zoo_metrics.json` beside the models.

Taught in chapters 07 and 08.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

from marlhf_edu.models import ASSETS


def toy_corpus(world) -> list[str]:
    sft = [r["prompt"] + r["completion"] for r in world.sft_rows()]
    prefs = [" ".join([r["prompt"], r["response_0"], r["response_1"]]) for r in world.pku_rows()]
    return sft + prefs


def evaluate_sft(model, tokenizer, world, repeats: int = 4) -> dict:
    """Toy-world behaviour of a causal LM: sampled at temperature 1, each held-out prompt `repeats` times."""
    from marlhf_edu.generation import generate_responses

    metrics = world.evaluate(lambda prompts: generate_responses(model, tokenizer, prompts, seed=0), repeats=repeats)
    metrics["harmful_compliance_rate"] = 1.0 - metrics["harmful_refusal_rate"]
    return metrics


def rebuild(configs: pathlib.Path, out: pathlib.Path, work: pathlib.Path) -> dict:
    from trl import ModelConfig, RewardConfig, SFTConfig

    from marlhf_edu.models import load_sft_model, load_reward_model, train_tokenizer
    from marlhf_edu.stages.common import parse_stage_args
    from marlhf_edu.stages.reward import RMScriptArguments, run_rm
    from marlhf_edu.stages.sft import SFTScriptArguments, run_sft
    from marlhf_edu.toyworld import ToyWorld

    timings, start = {}, time.perf_counter()
    world = ToyWorld()
    tok_dir, sft_dir, rm_dir = out / "tokenizer", out / "tiny_sft", out / "tiny_reward_adapter"
    train_tokenizer(toy_corpus(world), out_dir=tok_dir)
    timings["tokenizer_s"] = time.perf_counter() - start

    t = time.perf_counter()
    args = parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig),
                            ["--config", str(configs / "tiny_sft.yaml"), "--output_dir", str(work / "sft"),
                             "--tokenizer_name_or_path", str(tok_dir)])
    run_sft(*args)
    shutil.rmtree(sft_dir, ignore_errors=True)
    sft_dir.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / "sft" / name, sft_dir / name)
    timings["sft_s"] = time.perf_counter() - t

    t = time.perf_counter()
    args = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig),
                            ["--config", str(configs / "tiny_rm.yaml"), "--output_dir", str(work / "rm"),
                             "--model_name_or_path", str(sft_dir)])
    _, rm_metrics = run_rm(*args)
    shutil.rmtree(rm_dir, ignore_errors=True)
    rm_dir.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(work / "rm" / name, rm_dir / name)
    relative_base_path(rm_dir, sft_dir)
    timings["rm_s"] = time.perf_counter() - t

    model, tokenizer = load_sft_model(sft_dir)
    metrics = {"sft": evaluate_sft(model, tokenizer, world),
               "reward_model": {k: v for k, v in rm_metrics.items() if not k.endswith("_scores")},
               "timings_s": {k: round(v, 1) for k, v in timings.items()},
               "total_s": round(time.perf_counter() - start, 1)}
    (out / "zoo_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def relative_base_path(adapter_dir: pathlib.Path, base_dir: pathlib.Path) -> str:
    """Record the adapter's base as a path relative to the adapter directory (peft writes the absolute build path,
    which names a directory on the machine that built it and nowhere else)."""
    import os

    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = os.path.relpath(base_dir.resolve(), adapter_dir.resolve())
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config["base_model_name_or_path"]


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="marlhf-edu zoo")
    parser.add_argument("action", choices=["rebuild"])
    parser.add_argument("--configs", default="configs", type=pathlib.Path)
    parser.add_argument("--out", default=ASSETS, type=pathlib.Path)
    parser.add_argument("--work", default="runs/zoo", type=pathlib.Path)
    args = parser.parse_args(argv)
    metrics = rebuild(args.configs, args.out, args.work)
    print(json.dumps(metrics, indent=2))
