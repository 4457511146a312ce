"""Benchmark the PPO demonstration runs on this machine and record the numbers the benchmarks page (site/benchmarks.md) quotes.

    python tools/bench_ppo.py [--config configs/tiny_ppo.yaml] [--out benchmarks/ppo_tiny.json]

Runs the stage exactly as a user would (`marlhf-edu ppo --config ...`, fresh output
directory), then reads its `eval.json` and `metrics.jsonl`: before/after evaluation on
the toy world's held-out prompts, mean score of the first and last five steps, KL,
step time and tokens per second, total wall time, and the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from marlhf_edu.records import machine

ROOT = pathlib.Path(__file__).resolve().parent.parent


def bench(command: str, config: str, out_dir: pathlib.Path, extra: list[str]) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "marlhf_edu.cli", command, "--config", config, "--output_dir", str(out_dir),
                    *extra], check=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    evals = json.loads((out_dir / "eval.json").read_text())
    mean = lambda key, rs: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    return {
        "command": f"marlhf-edu {command} --config {config} {' '.join(extra)}".strip(),
        "steps": len(records), "wall_s": round(wall, 1),
        "step_s": round(mean("time/step_s", records), 3),
        "tokens_per_s": round(mean("time/tokens_per_s", records), 1),
        "score_first5": round(mean("score/mean", records[:5]), 3), "score_last5": round(mean("score/mean", records[-5:]), 3),
        "kl_last5": round(mean("kl/k1", records[-5:]), 3), "kl_max": round(max(r["kl/k1"] for r in records), 3),
        "before": {k: round(v, 4) for k, v in evals["before"].items()},
        "after": {k: round(v, 4) for k, v in evals["after"].items()},
        "machine": machine(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--command", default="ppo")
    parser.add_argument("--config", default="configs/tiny_ppo.yaml")
    parser.add_argument("--out", default="benchmarks/ppo_tiny.json")
    parser.add_argument("--run_dir", default="runs/bench_ppo")
    args, extra = parser.parse_known_args(argv)
    result = bench(args.command, args.config, ROOT / args.run_dir, extra)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
