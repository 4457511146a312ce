"""Rebuild the shipped models from scratch: the tiny toy zoo, or the SmolLM2 adapters.

    marlhf-edu zoo rebuild [--model tiny|smollm2] [--configs configs] [--out marlhf_edu/assets]

Deterministic: the same seeds give the same files. Runs the real stage code
(trl `SFTTrainer`, `RewardTrainer`).

* `tiny` (default): the toy tokenizer, SFT model and reward adapter from
  `configs/tiny_sft.yaml` and `configs/tiny_rm.yaml`, measured on held-out toy
  prompts → `zoo_metrics.json`.
* `smollm2`: QLoRA SFT and reward adapters on SmolLM2-135M-Instruct from
  `configs/smollm2/{sft,rm}.yaml` → `smollm2_sft_adapter/` (stored in fp16, base
  `smollm2`) and `smollm2_reward_adapter/` (trained on that shipped SFT
  adapter, base `zoo/smollm2_sft_adapter`), with the reward model's held-out
  accuracy next to the untrained head and a length-only baseline →
  `smollm2_metrics.json`.

Taught in chapters 07, 08 (tiny) and 13 (smollm2).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.assets import ASSETS
from marlhf_edu.loading.device import cpu_name
from marlhf_edu.loading.generation import generate_responses
from marlhf_edu.loading.models import load_sft_model, train_tokenizer
from marlhf_edu.loading.sources import record_base
from marlhf_edu.math.evaluation import wilson_interval
from marlhf_edu.training.args import parse_stage_args
from marlhf_edu.training.reward import RMScriptArguments, run_rm
from marlhf_edu.training.sft import SFTScriptArguments, run_sft


def toy_corpus(world) -> list[str]:
    sft = [r["prompt"] + r["completion"] for r in world.sft_rows()]
    prefs = [" ".join([r["prompt"], r["response_0"], r["response_1"]]) for r in world.pku_rows()]
    return sft + prefs


def evaluate_sft(model, tokenizer, world, repeats: int = 4) -> dict:
    """Toy-world behaviour of a causal LM: sampled at temperature 1, each held-out prompt `repeats` times."""
    metrics = world.evaluate(lambda prompts: generate_responses(model, tokenizer, prompts, seed=0), repeats=repeats)
    metrics["harmful_compliance_rate"] = 1.0 - metrics["harmful_refusal_rate"]
    return metrics


def staged_install(out: pathlib.Path):
    """A context for a rebuild: yields a staging folder beside `out` (same filesystem) where the new assets are
    built; when the block ends without error, each staged entry replaces its namesake in `out` by renames (the
    old one moved aside, then removed), so an interruption during the build leaves the installed assets as they
    were. The staging folder is removed either way. A lock on `out` itself (no file left among the assets) is held
    throughout: a second rebuild of the same folder is refused instead of removing the first one's staging."""
    import contextlib
    import fcntl
    import os

    @contextlib.contextmanager
    def stage():
        out.mkdir(parents=True, exist_ok=True)
        held = os.open(out, os.O_RDONLY)
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(held)
            raise ConfigError(f"{out} is being rebuilt by another process: wait for it to finish") from None
        staging = out / ".rebuild-staging"
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            yield staging
            for entry in sorted(staging.iterdir()):
                final, aside = out / entry.name, out / f".{entry.name}.old"
                if aside.exists():
                    shutil.rmtree(aside) if aside.is_dir() else aside.unlink()
                if final.exists():
                    final.rename(aside)
                entry.rename(final)
                if aside.exists():
                    shutil.rmtree(aside) if aside.is_dir() else aside.unlink()
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            os.close(held)  # closing the descriptor releases the lock

    return stage()


def rebuild(configs: pathlib.Path, out: pathlib.Path, work: pathlib.Path) -> dict:
    """The toy zoo (tokenizer, SFT model, reward adapter, metrics), built beside `out` and swapped in at the end."""
    with staged_install(out) as staging:
        return _rebuild_tiny(configs, staging, work)


def _rebuild_tiny(configs: pathlib.Path, out: pathlib.Path, work: pathlib.Path) -> dict:
    from trl import ModelConfig, RewardConfig, SFTConfig

    timings, start = {}, time.perf_counter()
    world = ToyWorld()
    tok_dir, sft_dir, rm_dir = out / "tokenizer", out / "tiny_sft", out / "tiny_reward_adapter"
    train_tokenizer(toy_corpus(world), out_dir=tok_dir)
    timings["tokenizer_s"] = time.perf_counter() - start

    t = time.perf_counter()
    # both configs are read before any training, so a mistake in the second is not found after the first; the
    # work folders are the rebuild's own scratch space, replaced on every rebuild
    args = parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig),
                            ["--config", str(configs / "tiny_sft.yaml"), "--output_dir", str(work / "sft"),
                             "--tokenizer_name_or_path", str(tok_dir), "--overwrite_output", "true"])
    rm_args = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig),
                               ["--config", str(configs / "tiny_rm.yaml"), "--output_dir", str(work / "rm"),
                                "--model_name_or_path", str(sft_dir), "--overwrite_output", "true"])
    run_sft(*args)
    shutil.rmtree(sft_dir, ignore_errors=True)
    sft_dir.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / "sft" / name, sft_dir / name)
    timings["sft_s"] = time.perf_counter() - t

    t = time.perf_counter()
    _, rm_metrics = run_rm(*rm_args)
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


def ship_adapter(run_dir: pathlib.Path, dst: pathlib.Path, base_ref: str, dtype=None) -> pathlib.Path:
    """Copy a trained adapter (config + weights) into `dst`, recording `base_ref` as its base; `dtype` (e.g.
    torch.float16) stores the floating weights smaller."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    config = json.loads((run_dir / "adapter_config.json").read_text())
    if isinstance(config.get("target_modules"), list):  # peft writes a set, in hash order: sorted, a rebuild diffs clean
        config["target_modules"] = sorted(config["target_modules"])
    (dst / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = load_file(run_dir / "adapter_model.safetensors")
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    save_file(weights, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    record_base(dst, base_ref)
    return dst


def rebuild_smollm2(configs: pathlib.Path, out: pathlib.Path, work: pathlib.Path) -> dict:
    """SFT → ship (fp16) → reward model on the new SFT adapter → ship; metrics in `smollm2_metrics.json`. Built
    beside `out` and swapped in at the end (`staged_install`): an interrupted rebuild changes nothing."""
    # the shipped reward adapter names its base as a reference that resolves on any machine
    final_sft = "zoo/smollm2_sft_adapter" if out.resolve() == ASSETS.resolve() else str(out / "smollm2_sft_adapter")
    with staged_install(out) as staging:
        return _rebuild_smollm2(configs, staging, work, final_sft)


def _rebuild_smollm2(configs: pathlib.Path, out: pathlib.Path, work: pathlib.Path, sft_ref: str) -> dict:
    import torch
    from trl import ModelConfig, RewardConfig, SFTConfig

    timings, start = {}, time.perf_counter()
    sft_dir, rm_dir = out / "smollm2_sft_adapter", out / "smollm2_reward_adapter"
    # both configs are read before any training; the work folders are the rebuild's own, replaced every time
    args = parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig),
                            ["--config", str(configs / "smollm2" / "sft.yaml"), "--output_dir", str(work / "smollm2_sft"),
                             "--overwrite_output", "true"])
    rm_args = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig),
                               ["--config", str(configs / "smollm2" / "rm.yaml"), "--output_dir",
                                str(work / "smollm2_rm"), "--model_name_or_path", str(sft_dir), "--eval_pairs", "0",
                                "--overwrite_output", "true"])
    run_sft(*args)
    ship_adapter(work / "smollm2_sft", sft_dir, "smollm2", dtype=torch.float16)
    timings["sft_s"] = time.perf_counter() - start

    t = time.perf_counter()
    _, rm_metrics = run_rm(*rm_args)
    ship_adapter(work / "smollm2_rm", rm_dir, sft_ref)  # fp32: the held-out numbers below are these exact weights
    timings["rm_s"] = time.perf_counter() - t

    n = rm_metrics["n"]
    low, high = wilson_interval(round(rm_metrics["accuracy"] * n), n)
    metrics = {"reward_model": {"held_out_accuracy": rm_metrics["accuracy"], "wilson_95": [low, high], "n_pairs": n,
                                "untrained_head_accuracy": rm_metrics["untrained_head_accuracy"],
                                "length_baseline": rm_metrics["length_baseline"], "mean_gap": rm_metrics["mean_gap"],
                                **{k: rm_metrics[k] for k in ("probe_accuracy", "probe_l2", "probe_cv_accuracy")
                                   if k in rm_metrics}},
               "timings_s": {k: round(v, 1) for k, v in timings.items()},
               "total_s": round(time.perf_counter() - start, 1),
               "measured_on": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"}
    (out / "smollm2_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
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
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                        help="tiny: the toy zoo (chapters 07-08); smollm2: the SmolLM2 adapters (chapter 13)")
    parser.add_argument("--configs", default="configs", type=pathlib.Path)
    parser.add_argument("--out", default=ASSETS, type=pathlib.Path)
    parser.add_argument("--work", default="runs/zoo", type=pathlib.Path)
    args = parser.parse_args(argv)
    metrics = (rebuild_smollm2 if args.model == "smollm2" else rebuild)(args.configs, args.out, args.work)
    print(json.dumps(metrics, indent=2))
