"""The CPU speed targets on this machine in one command: this engine against trl 0.11.4 on the tiny work, and the
shipped SmolLM2 config against the engine at commit 7b49006, each measured side by side, records named after the CPU.

    python tools/speed_targets.py --trl-python trl011/bin/python [--kernels native|avx2|avx512] [--rounds 3]
    python tools/speed_targets.py --smollm2-floor [--kernels native|avx2|avx512] [--rounds 3]

1. `tools/compare_trl.py --steps 10 --repeats 3` → `benchmarks/speed_vs_trl_<cpu>.json` (every case, trl between).
2. For each of `--rounds` rounds, in turn: commit 7b49006 (a temporary `git worktree`, its own
   `configs/smollm2/ma_ppo.yaml` and `tools/bench_step.py`) and this checkout's shipped config, a 3-step run each
   (`tools/bench_step.py --steps 3 --skip 1`) → `benchmarks/smollm2_step_side_by_side_<cpu>.json`.
3. Prints each target against what was measured:

       tiny LoRA MA-PPO, CPU options      trl ÷ ours ≥ 1.05   (median of the repeats; each run shown)
       tiny four-model, CPU options       trl ÷ ours ≥ 1.0
       SmolLM2, shipped config            ours ÷ 7b49006 ≤ 0.6 (every round)

With `--smollm2-floor` (no `--trl-python`) only step 2 runs, each round first timing the SmolLM2 step's passes alone
(`tools/bench_floor.py --work smollm2`: bare transformers/peft calls over the padded batch, dense fp32, MKL), then
the two engines → `benchmarks/smollm2_step_floor_<cpu>.json`: what the 0.6 target leaves beside those passes on this
machine (floor ÷ 7b49006) and the shipped step against them. Not a strict floor: the engine packs its forwards and
can multiply by oneDNN. `--config configs/smollm2/<name>.yaml` runs that config on this checkout's side instead of
the shipped one (7b49006 keeps its own `ma_ppo.yaml`, the floor stays the fp32 one) →
`benchmarks/smollm2_step_floor_<cpu>_<name>.json` (its runs are still filed as engine "shipped"): e.g.
`ma_ppo_bf16.yaml`, whose 4-bit layers' products are bf16. `--matmul-precision bf16` (or `bf16_with_attention`)
runs this checkout's side with every fp32 product at bf16 precision (`tools/bench_step.py --matmul-precision`,
with `old_logprobs: recompute`) → a record whose name ends `_<precision>_products`.

`<cpu>` is the vendor and the widest vector extension `/proc/cpuinfo` lists: `amd_epyc_avx2`,
`intel_xeon_avx512`, `amd_epyc_avx512bf16`, ... With `--kernels avx2` or `avx512`, PyTorch's, oneDNN's and MKL's
kernels are held to that set (`KERNEL_ENV`) and the records are named `<cpu>_as_avx2` / `<cpu>_as_avx512`:
capped kernels, a CPU kind's instruction set on this machine's clock, caches and memory. `--tag <name>` ends every
record's name with `_<name>` (lowercase letters, digits and `_`), so a second machine of one CPU kind, or a second
record on one machine, is filed beside the first rather than refused; each record also holds this machine's
vector flags and reported clock (`cpu_flags`, `cpu_mhz_reported`). "CPU options" are
`compare_trl.CPU_OPTIONS`. The machine should be otherwise idle. On the 2-core AMD EPYC with AVX512-BF16 the
two parts took about 9 minutes (the comparison) and 2 minutes a round, on a 2-core Intel Xeon 12 and 3 minutes
(17 and 5 with AVX2 kernels); an AVX2-only CPU of the EPYC's family ran the engine at 7b49006 about 2.5 times
slower than the EPYC. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from marlhf_edu.records import cpu_features, cpu_kind

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASELINE = "7b49006"
SMOLLM2_CONFIG = "configs/smollm2/ma_ppo.yaml"
#: kernels held to an instruction set: PyTorch's own (ATen), oneDNN's, MKL's
KERNEL_ENV = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}
#: target name → (the compare_trl case, the least trl ÷ ours); the SmolLM2 target is SMOLLM2_TARGET
TRL_TARGETS = {"tiny LoRA MA-PPO, CPU options": ("lora", 1.05), "tiny four-model, CPU options": ("full", 1.0)}
SMOLLM2_TARGET = 0.6


def record_suffix(kind: str, kernels: str) -> str:
    if kernels not in KERNEL_ENV:
        raise ValueError(f"kernels must be one of {sorted(KERNEL_ENV)}, got {kernels!r}")
    return kind if kernels == "native" else f"{kind}_as_{kernels}"


def tag_suffix(tag: str | None) -> str:
    """'' without a tag, else `_<tag>`: the end of every record's name (`--tag`)."""
    if tag is not None and not re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", tag):
        raise ValueError(f"--tag {tag!r}: lowercase letters and digits, words joined by single '_' (a file name part)")
    return f"_{tag}" if tag else ""


def verdicts(speed: dict, smollm2: dict) -> list[dict]:
    """Each target against the records: `speed` (compare_trl's) and `smollm2` (`side_by_side`'s)."""
    out = []
    for name, (case, least) in TRL_TARGETS.items():
        row = next(s for s in speed["summary"] if s["case"] == case and s["label"].endswith("CPU options"))
        out.append({"target": name, "wanted": f"trl ÷ ours ≥ {least}", "median": row["median_trl_s_over_ours_s"],
                    "each": row["trl_s_over_ours_s"], "met": row["median_trl_s_over_ours_s"] >= least})
    ratios = smollm2["ratios"]["shipped_over_7b49006"]
    out.append({"target": "SmolLM2, shipped config", "wanted": f"ours ÷ {BASELINE} ≤ {SMOLLM2_TARGET}",
                "median": sorted(ratios)[len(ratios) // 2], "each": ratios,
                "met": all(r <= SMOLLM2_TARGET for r in ratios)})
    return out


def side_by_side(baseline_dir: pathlib.Path, rounds: int, env: dict, kernels: str, floor: bool = False,
                 config: str = SMOLLM2_CONFIG, precision: str = "ieee") -> dict:
    """`rounds` rounds of the SmolLM2 step, the engine at 7b49006 (its own `SMOLLM2_CONFIG`) then this checkout's
    with `config` (its fp32 products at `precision`, `bench_step.matmul_precision`), each a fresh process; with
    `floor`, the step's floor first in each round (`tools/bench_floor.py --work smollm2`)."""
    # bf16-rounded products: the sampler's log-probs no longer stand in for the training path's (bench_step refuses)
    ours = [] if precision == "ieee" else ["--matmul-precision", precision, "--", "--old_logprobs", "recompute"]
    runs, floors = [], []
    for round_ in range(1, rounds + 1):
        if floor:
            with tempfile.TemporaryDirectory() as tmp:
                out = pathlib.Path(tmp) / "floor.json"
                subprocess.run([sys.executable, str(ROOT / "tools" / "bench_floor.py"), "--work", "smollm2",
                                "--steps", "3", "--skip", "1", "--out", str(out)], check=True, cwd=ROOT,
                               stdout=subprocess.DEVNULL, env={**env, "PYTHONPATH": str(ROOT)})
                measured = json.loads(out.read_text())
            print(f"  SmolLM2 round {round_}, floor: {measured['floor_step_s']:.1f} s a step", flush=True)
            floors.append({"kernels": kernels, "round": round_,
                           **{k: measured[k] for k in ("floor_step_s", "phases_s", "generate_tokens_per_s", "per_step",
                                                       "measured_on", "machine")}})
        for engine, root, config_ in ((BASELINE, baseline_dir, SMOLLM2_CONFIG), ("shipped", ROOT, config)):
            with tempfile.TemporaryDirectory() as tmp:
                out = pathlib.Path(tmp) / "step.json"
                subprocess.run([sys.executable, str(root / "tools" / "bench_step.py"), "--command", "ma-ppo",
                                "--config", str(root / config_), "--steps", "3", "--skip", "1", "--out",
                                str(out), *(ours if engine == "shipped" else [])], check=True, cwd=ROOT,
                               stdout=subprocess.DEVNULL,
                               env={**env, "PYTHONPATH": str(root)})
                step = json.loads(out.read_text())
            print(f"  SmolLM2 round {round_}, {engine}: {step['step_s']:.1f} s a step", flush=True)
            runs.append({"kernels": kernels, "round": round_, "engine": engine,
                         **{k: step[k] for k in ("step_s", "phases_s", "response_length", "generate_tokens_per_s",
                                                 "steps_averaged", "fp32_products", "per_step", "measured_on",
                                                 "machine")},
                         "matmul_precision": step.get("matmul_precision", "ieee")})
    ratios = {"shipped_over_7b49006": [round(runs[i + 1]["step_s"] / runs[i]["step_s"], 4)
                                       for i in range(0, len(runs), 2)]}
    if not floor:
        return {"runs": runs, "ratios": ratios}
    ratios["floor_over_7b49006"] = [round(f["floor_step_s"] / runs[2 * i]["step_s"], 4) for i, f in enumerate(floors)]
    ratios["shipped_over_floor"] = [round(runs[2 * i + 1]["step_s"] / f["floor_step_s"], 4) for i, f in enumerate(floors)]
    return {"runs": runs, "floors": floors, "ratios": ratios}


def run_env(kernels: str) -> tuple[dict, str]:
    """The environment every measured process runs in, and the kernel caps as words for a record's command."""
    env = {**os.environ, **KERNEL_ENV[kernels], "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore",
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    return env, " ".join(f"{k}={v}" for k, v in KERNEL_ENV[kernels].items())


def with_baseline(measure):
    """`measure(baseline_dir)` with commit 7b49006 checked out in a temporary `git worktree`."""
    with tempfile.TemporaryDirectory() as tmp:
        baseline_dir = pathlib.Path(tmp) / BASELINE
        subprocess.run(["git", "worktree", "add", "--detach", str(baseline_dir), BASELINE], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            return measure(baseline_dir)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline_dir)], cwd=ROOT, check=False)


def smollm2_record(ran: str, kind: str, kernels: str, command: str, measured: dict,
                   config: str = SMOLLM2_CONFIG, precision: str = "ieee") -> dict:
    """A SmolLM2 side-by-side record: what `ran` in turn each round, on which CPU kind and kernels, by which command;
    `config` is the one this checkout ran (the engine at 7b49006 always runs its own `SMOLLM2_CONFIG`), its fp32
    products at `precision`."""
    ours = f"this checkout with {config} as shipped"
    if precision != "ieee":
        ours = (f"this checkout with {config}, old_logprobs: recompute, every fp32 matrix product at bf16 precision "
                "(torch.backends.mkldnn.matmul.fp32_precision = 'bf16', tools/bench_step.py --matmul-precision "
                f"{precision}: inputs rounded to bf16, sums in fp32), "
                + ("attention too" if precision == "bf16_with_attention" else "attention in fp32"))
    return {"what": f"seconds per MA-PPO step of SmolLM2-135M (NF4 base), mean of steps 2-3 of 3-step runs, {ran} in "
                    "turn each round",
            "engines": {BASELINE: f"commit {BASELINE} with its own {SMOLLM2_CONFIG}", "shipped": ours},
            "cpu_kind": kind, **here(), "kernels": kernels, "date": time.strftime("%Y-%m-%d"), "command": command,
            **measured}


def here() -> dict:
    """This machine's vector flags and reported clock (`records.cpu_features`), which two machines of one
    `cpu_kind` need not share."""
    return cpu_features(pathlib.Path("/proc/cpuinfo").read_text())


def config_path(config: str) -> str:
    """`config` (relative to the repository root or absolute) as a path from the root, e.g.
    `configs/smollm2/ma_ppo_bf16.yaml`; anything but a file under configs/smollm2/ of this checkout is refused."""
    path = (ROOT / config).resolve()
    if not path.is_file() or not path.is_relative_to(ROOT / "configs" / "smollm2"):
        raise SystemExit(f"speed_targets: --config {config}: not a file under configs/smollm2/ of this checkout")
    return str(path.relative_to(ROOT))


def config_suffix(config: str) -> str:
    """'' for `SMOLLM2_CONFIG`, else `_<the config file's stem>`: a record of another config is named apart."""
    config = config_path(config)
    return "" if config == SMOLLM2_CONFIG else "_" + pathlib.Path(config).stem


def smollm2_floor(args, kind: str, suffix: str) -> dict:
    """`--smollm2-floor`: the step's floor, 7b49006 and this checkout's `--config` in turn, `--rounds` rounds."""
    args.config = config_path(args.config)
    precision_suffix = "" if args.matmul_precision == "ieee" else f"_{args.matmul_precision}_products"
    out = args.out_dir / (f"smollm2_step_floor_{suffix}{config_suffix(args.config)}{precision_suffix}"
                          f"{args.tag_suffix}.json")
    if out.exists():  # a record is evidence: never overwritten
        sys.exit(f"speed_targets: {out} exists; move it aside (e.g. to a name ending _at_<commit>) or name the new "
                 "record apart with --tag")
    env, env_words = run_env(args.kernels)
    print(f"CPU kind {kind}, kernels {args.kernels}: record {out.name}", flush=True)
    print(f"SmolLM2: the floor, {BASELINE} and {args.config} in turn, {args.rounds} rounds", flush=True)
    measured = with_baseline(lambda baseline_dir: side_by_side(baseline_dir, args.rounds, env, args.kernels,
                                                               floor=True, config=args.config,
                                                               precision=args.matmul_precision))
    named = "" if args.config == SMOLLM2_CONFIG else f" --config {args.config}"
    if args.matmul_precision != "ieee":
        named += f" --matmul-precision {args.matmul_precision}"
    if args.tag:
        named += f" --tag {args.tag}"
    record = smollm2_record("the step's passes alone (tools/bench_floor.py --work smollm2: bare transformers/peft "
                            f"calls over the padded batch of {SMOLLM2_CONFIG}, dense fp32, MKL), {BASELINE} and "
                            f"this checkout's {args.config}",
                            kind, args.kernels, f"{env_words + ' ' if env_words else ''}python tools/speed_targets.py "
                            f"--smollm2-floor --kernels {args.kernels} --rounds {args.rounds}{named}", measured,
                            config=args.config, precision=args.matmul_precision)
    out.write_text(json.dumps(record, indent=1) + "\n")
    r = measured["ratios"]
    show = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    print(f"{args.config} ÷ {BASELINE}: {show(r['shipped_over_7b49006'])}; floor ÷ {BASELINE}: "
          f"{show(r['floor_over_7b49006'])} (target ≤ {SMOLLM2_TARGET}); {args.config} ÷ floor: {show(r['shipped_over_floor'])}")
    print(f"(record {out}; add it to benchmarks/README.md)")
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="python of the trl 0.11.4 environment (compare_trl.py)")
    parser.add_argument("--smollm2-floor", action="store_true",
                        help="only the SmolLM2 part, each round also timing the step's floor (tools/bench_floor.py "
                             "--work smollm2): benchmarks/smollm2_step_floor_<cpu>[_<config stem>].json")
    parser.add_argument("--kernels", choices=sorted(KERNEL_ENV), default="native")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "benchmarks")
    parser.add_argument("--tag", help="ends every record's name with _<tag> (e.g. the machine: xeon_b), so a record "
                                      "made on another machine of this CPU kind is filed beside the first")
    parser.add_argument("--config", default=SMOLLM2_CONFIG,
                        help="with --smollm2-floor: the config this checkout runs (under configs/smollm2/; the "
                             f"record's name ends _<its stem>); the engine at {BASELINE} runs its own {SMOLLM2_CONFIG}")
    parser.add_argument("--matmul-precision", choices=("ieee", "bf16", "bf16_with_attention"), default="ieee",
                        help="with --smollm2-floor: this checkout's fp32 products at bf16 precision "
                             "(tools/bench_step.py --matmul-precision; old_logprobs: recompute); the record's name "
                             "ends _<precision>_products")
    args = parser.parse_args(argv)
    if not args.smollm2_floor and args.matmul_precision != "ieee":
        parser.error("--matmul-precision is for --smollm2-floor: the targets are judged on fp32 products")
    if not args.smollm2_floor and not args.trl_python:
        parser.error("--trl-python is required (or --smollm2-floor)")
    if not args.smollm2_floor and config_path(args.config) != SMOLLM2_CONFIG:
        parser.error(f"--config is for --smollm2-floor: the targets are judged on {SMOLLM2_CONFIG}")

    kind = cpu_kind(pathlib.Path("/proc/cpuinfo").read_text())
    suffix = record_suffix(kind, args.kernels)
    try:
        args.tag_suffix = tag_suffix(args.tag)
    except ValueError as err:
        parser.error(str(err))
    speed_out = args.out_dir / f"speed_vs_trl_{suffix}{args.tag_suffix}.json"
    smollm2_out = args.out_dir / f"smollm2_step_side_by_side_{suffix}{args.tag_suffix}.json"
    if args.smollm2_floor:
        return smollm2_floor(args, kind, suffix)
    for path in (speed_out, smollm2_out):
        if path.exists():  # a record is evidence: never overwritten
            sys.exit(f"speed_targets: {path} exists; move it aside (e.g. to a name ending _at_<commit>) or name the "
                     "new record apart with --tag")
    env, env_words = run_env(args.kernels)

    def shown(path: pathlib.Path) -> str:  # a record's command names paths from the repository root, as run there
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)

    print(f"CPU kind {kind}, kernels {args.kernels}: records {speed_out.name}, {smollm2_out.name}", flush=True)

    print("1. this engine against trl 0.11.4 (tools/compare_trl.py)", flush=True)
    subprocess.run([sys.executable, str(ROOT / "tools" / "compare_trl.py"), "--trl-python", args.trl_python,
                    "--steps", "10", "--repeats", str(args.repeats), "--out", str(speed_out)],
                   check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    speed = json.loads(speed_out.read_text())
    speed.update(cpu_kind=kind, **here(), kernels=args.kernels, date=time.strftime("%Y-%m-%d"),
                 command=f"{env_words + ' ' if env_words else ''}python tools/compare_trl.py --trl-python "
                         f"{args.trl_python} --steps 10 --repeats {args.repeats} --out {shown(speed_out)} "
                         f"(tools/speed_targets.py)")
    speed_out.write_text(json.dumps(speed, indent=1) + "\n")

    print(f"2. SmolLM2: {BASELINE} and the shipped config in turn, {args.rounds} rounds", flush=True)
    measured = with_baseline(lambda baseline_dir: side_by_side(baseline_dir, args.rounds, env, args.kernels))
    smollm2 = smollm2_record(f"{BASELINE} and the shipped config", kind, args.kernels,
                             f"{env_words + ' ' if env_words else ''}python tools/speed_targets.py --trl-python "
                             f"{args.trl_python} --kernels {args.kernels} --rounds {args.rounds}"
                             + (f" --tag {args.tag}" if args.tag else ""), measured)
    smollm2_out.write_text(json.dumps(smollm2, indent=1) + "\n")

    print("3. the targets", flush=True)
    for v in verdicts(speed, smollm2):
        each = ", ".join(f"{x:.2f}" for x in v["each"])
        print(f"  {v['target']:32s} {v['wanted']:24s} {v['median']:.2f} ({each})  {'met' if v['met'] else 'NOT met'}")
    print(f"(kernels {args.kernels}; records {speed_out}, {smollm2_out}; add them to benchmarks/README.md)")


if __name__ == "__main__":
    main()
