"""Do runs of one config and seed give the same numbers in every fresh process? Run it several times and compare.

    python tools/replay_check.py --config configs/smollm2/ma_ppo.yaml --runs 6 --steps 2 [--control] [--out FILE]

Each run is a fresh `marlhf-edu <command> --config FILE --total_steps STEPS` process (the console script next to
this Python, as a user starts it; `--launcher module` starts `python -m marlhf_edu.cli` instead) with the held-out evaluations
off (`--eval_repeats 0 --eval_every 0`), its own `PYTHONHASHSEED` (0, 1, 2, ...: Python's hashing differs between
processes anyway) and a temporary output folder. Two runs replay each other when every step's record of
`metrics.jsonl` is equal, timings (`time/*`) aside, to the last digit JSON holds. The result names the distinct
record sequences and which runs gave each, with step 1's `kl/k1`, `rollout/logprob_gap` and `score/mean`: one
sequence means every run replayed the first.

`--control` runs every hash seed twice in turn: as shipped, then with `MARLHF_EDU_VML_WARMUP=0` (the package's
one-thread warm-up of MKL's vector functions off, `marlhf_edu/loading/mkl_vml.py`). The site's engine guide reads
the stored result (`benchmarks/replay_*.json`). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from marlhf_edu.records import machine, measured_on, write_result

SHOWN = ("kl/k1", "rollout/logprob_gap", "score/mean")


def launcher_argv(launcher: str) -> list[str]:
    """How a run is started: the `marlhf-edu` console script installed next to this Python, or `python -m`."""
    if launcher == "module":
        return [sys.executable, "-m", "marlhf_edu.cli"]
    script = pathlib.Path(sys.executable).parent / "marlhf-edu"
    if not script.is_file():
        raise SystemExit(f"replay_check: no console script {script} (install the package, or --launcher module)")
    return [str(script)]


def run_once(command: str, config: str, steps: int, hash_seed: int, warmup: bool, extra: list[str],
             launcher: str = "script") -> list[dict]:
    """The step records (timings dropped) of one fresh run."""
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    env.pop("MARLHF_EDU_VML_WARMUP", None)
    if not warmup:
        env["MARLHF_EDU_VML_WARMUP"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "run"
        argv = [*launcher_argv(launcher), command, "--config", config, "--total_steps", str(steps),
                "--eval_repeats", "0", "--eval_every", "0", "--save_steps", str(steps + 1), "--output_dir", str(out),
                *extra]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"replay_check: run with PYTHONHASHSEED={hash_seed} failed ({done.returncode}):\n"
                             f"{done.stderr[-2000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def variants(runs: list[dict]) -> list[dict]:
    """The distinct record sequences of `runs`, each with the runs that gave it and step 1's `SHOWN` values."""
    groups: list[dict] = []
    for run in runs:
        for group in groups:
            if group["records"] == run["records"]:
                group["hash_seeds"].append(run["hash_seed"])
                break
        else:
            groups.append({"records": run["records"], "hash_seeds": [run["hash_seed"]]})
    return [{"hash_seeds": g["hash_seeds"], "step1": {k: g["records"][0].get(k) for k in SHOWN}} for g in groups]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--command", default="ma-ppo", choices=("ppo", "ma-ppo"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--runs", type=int, default=6, help="fresh processes (hash seeds 0 .. runs-1) per case")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--control", action="store_true", help="also each hash seed with the VML warm-up off")
    parser.add_argument("--launcher", default="script", choices=("script", "module"),
                        help="the marlhf-edu console script (default) or python -m marlhf_edu.cli")
    parser.add_argument("--out", type=pathlib.Path)
    args, extra = parser.parse_known_args(argv)
    if not pathlib.Path(args.config).is_file():
        raise SystemExit(f"replay_check: no config file {args.config}")
    cases = {"shipped": True, **({"vml_warmup_off": False} if args.control else {})}
    runs = {case: [] for case in cases}
    started = time.time()
    for seed in range(args.runs):
        for case, warmup in cases.items():
            records = run_once(args.command, args.config, args.steps, seed, warmup, extra, args.launcher)
            runs[case].append({"hash_seed": seed, "records": records})
            print(f"[{time.time() - started:5.0f} s] {case}, PYTHONHASHSEED={seed}: step 1 "
                  + ", ".join(f"{k} {records[0].get(k)}" for k in SHOWN), flush=True)
    result = {"command": "python tools/replay_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "measured_on": measured_on(), "machine": machine(),
              "steps": args.steps, "runs": args.runs, "launcher": " ".join(launcher_argv(args.launcher)),
              "cases": {case: {"replayed": len(variants(r)) == 1, "variants": variants(r)} for case, r in runs.items()}}
    print(json.dumps(result["cases"], indent=1))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
