"""Do runs of one config and seed give the same numbers in every fresh process? Run it several times and compare.

    python tools/replay_check.py --config configs/smollm2/ma_ppo.yaml --runs 6 --steps 2 [--control] [--out FILE]

Each run is a fresh `marlhf-edu <command> --config FILE --total_steps STEPS` process (the console script next to
this Python, as a user starts it; `--launcher module` starts `python -m marlhf_edu.cli` instead) with the held-out
evaluations off (`--eval_repeats 0 --eval_every 0`, `--save_steps` past the last step), its own `PYTHONHASHSEED`
(0, 1, 2, ...: Python's hashing differs between processes anyway) and a temporary output folder; stage overrides
it does not know are passed on. Two runs replay each other when every step's record of `metrics.jsonl` is equal,
timings (`time/*`) aside, to the last digit JSON holds. The result stores each distinct record sequence once
(`sequences`, over all cases) and, per case, which runs gave which sequence, with step 1's `kl/k1`,
`rollout/logprob_gap` and `score/mean` (one sequence in a case: every run of it replayed the first), the thread
settings the runs inherited and the oneMKL build.

`--control` runs every hash seed twice in turn: as shipped, then with `MARLHF_EDU_VML_WARMUP=0` (the package's
one-thread warm-up of MKL's vector functions off, `marlhf_edu/loading/mkl_vml.py`). The site's engine guide reads
the stored result (`benchmarks/replay_*.json`). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

import torch

from marlhf_edu.ppo.trainer import read_metrics
from marlhf_edu.records import machine, measured_on, write_result

SHOWN = ("kl/k1", "rollout/logprob_gap", "score/mean")
#: options the tool sets on every run itself (`--config` is its own argument, so never among the passed-on ones)
OWN_OPTIONS = ("--total_steps", "--eval_repeats", "--eval_every", "--save_steps", "--output_dir")


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
        records = read_metrics(out / "metrics.jsonl")
    if len(records) != steps:
        raise SystemExit(f"replay_check: run with PYTHONHASHSEED={hash_seed} wrote {len(records)} step records, "
                         f"not {steps}")
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def variants(runs: list[dict], sequences: list[list[dict]]) -> list[dict]:
    """Which record sequence each of `runs` gave: each sequence's index in `sequences` (a new one appended), the
    runs that gave it and step 1's `SHOWN` values, in order of first appearance."""
    groups: dict[int, dict] = {}
    for run in runs:
        if run["records"] not in sequences:
            sequences.append(run["records"])
        index = sequences.index(run["records"])
        groups.setdefault(index, {"sequence": index, "hash_seeds": [],
                                  "step1": {k: run["records"][0].get(k) for k in SHOWN}})["hash_seeds"].append(
            run["hash_seed"])
    return list(groups.values())


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
    if args.runs < 1 or args.steps < 1:
        raise SystemExit(f"replay_check: --runs and --steps must be at least 1 (got {args.runs} and {args.steps})")
    taken = [a for a in extra if a.startswith("--") and a.split("=")[0].replace("-", "_").lstrip("_") in
             {o.lstrip("-") for o in OWN_OPTIONS}]
    if taken:
        raise SystemExit(f"replay_check: {taken} are set by the tool itself (--steps, a temporary folder, evaluations "
                         "off); leave them out")
    cases = {"shipped": True, **({"vml_warmup_off": False} if args.control else {})}
    runs = {case: [] for case in cases}
    started = time.time()
    for seed in range(args.runs):
        for case, warmup in cases.items():
            records = run_once(args.command, args.config, args.steps, seed, warmup, extra, args.launcher)
            runs[case].append({"hash_seed": seed, "records": records})
            print(f"[{time.time() - started:5.0f} s] {case}, PYTHONHASHSEED={seed}: step 1 "
                  + ", ".join(f"{k} {records[0].get(k)}" for k in SHOWN), flush=True)
    sequences: list[list[dict]] = []
    cases_result = {}
    for case, case_runs in runs.items():
        found = variants(case_runs, sequences)
        cases_result[case] = {"replayed": len(found) == 1, "variants": found}
    result = {"command": shlex.join(["python", "tools/replay_check.py", *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "measured_on": measured_on(), "machine": machine(),
              "steps": args.steps, "runs": args.runs,
              "launcher": "marlhf-edu" if args.launcher == "script" else "python -m marlhf_edu.cli",
              # what the runs inherited: the thread settings (unset: torch takes every CPU) and the oneMKL build
              "run_environment": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
              "onemkl": next((line.strip(" -") for line in torch.__config__.show().splitlines()
                              if "Math Kernel Library" in line), None),
              "cases": cases_result, "sequences": sequences}
    print(json.dumps(result["cases"], indent=1))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
