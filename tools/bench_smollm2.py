"""The MA-PPO run on SmolLM2-135M that chapter 13 and the benchmarks page (site/benchmarks.md) report.

    python tools/bench_smollm2.py [--seed 0] --out benchmarks/smollm2_eos/config_seed0 [-- extra ma-ppo overrides]

Runs `marlhf-edu ma-ppo --config configs/smollm2/ma_ppo.yaml` (the shipped SFT and reward adapters; the
keyword judge of chapter 13 before and after training) into runs/smollm2/bench_seed<N>, timed, and copies
what the chapter reads into `--out`: `metrics.jsonl` (one record per step), `eval.json` (the judge's rates
before and after), `eval_samples.jsonl` (every judged answer), `eval_curve.jsonl` (the held-out evaluation
every `eval_every` updates, when on) and `run.json` (steps, seconds, seed, settings, machine).
About 25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

from marlhf_edu.records import machine, measured_on

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="configs/smollm2/ma_ppo.yaml")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="the run's record folder, e.g. benchmarks/smollm2_eos/config_seed1")
    parser.add_argument("--run_dir", type=pathlib.Path, default=None,
                        help="where the run writes (default runs/smollm2/bench_seed<N>; give another to run two at once)")
    parser.add_argument("extra", nargs="*", help="more ma-ppo overrides, after --")
    args = parser.parse_args(argv)

    from marlhf_edu.stages.ma_ppo import main as ma_ppo_main

    run_dir = ROOT / (args.run_dir or pathlib.Path("runs") / "smollm2" / f"bench_seed{args.seed}")
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    result = ma_ppo_main(["--config", str(ROOT / args.config), "--output_dir", str(run_dir), "--seed", str(args.seed),
                          *args.extra])
    wall = time.perf_counter() - start
    config = result["trainer"].config
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "eval.json", "eval_samples.jsonl", "eval_curve.jsonl"):
        if (run_dir / name).exists() or name != "eval_curve.jsonl":
            shutil.copy(run_dir / name, out / name)
    records = result["records"]
    info = {"config": args.config, "overrides": args.extra, "seed": args.seed, "steps": len(records),
            "batch_size": config.batch_size, "max_new_tokens": config.max_new_tokens,
            "temperature": config.temperature, "missing_eos_penalty": config.missing_eos_penalty,
            "truncated_scoring": config.truncated_scoring, "reward": config.reward,
            "helpful_prompt_share": config.helpful_prompt_share, "eval_every": config.eval_every,
            "whiten_scores": config.whiten_scores, "kl_coef": config.kl_coef, "learning_rate": config.learning_rate,
            "ppo_epochs": config.ppo_epochs, "rollouts_per_prompt": config.rollouts_per_prompt,
            "group_baseline": config.group_baseline, "load_in_4bit": config.load_in_4bit,
            "merged_rollout": config.merged_rollout,
            "reward_adapter_path": config.reward_adapter_path,
            "eval_repeats": config.eval_repeats, "eval_prompts": config.eval_prompts,
            "train_s": round(sum(r.get("time/step_s", 0.0) for r in records), 1), "wall_s": round(wall, 1),
            "measured_on": measured_on(),
            "machine": machine()}
    (out / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
