"""Where a PPO step's time goes: the per-phase breakdown of any config, on this machine.

    python tools/bench_step.py --command ma-ppo --config configs/tiny_ma_ppo.yaml --steps 10 \
        --out benchmarks/step_tiny_ma_ppo.json [-- --load_in_4bit false --value_mode shared]

Builds the stage's backend and `PPOTrainer` exactly as `marlhf-edu ppo` / `ma-ppo` do (no evaluation, no
checkpoints), runs `--steps` steps and reports the mean of steps `--skip`+1 … `--steps` (the first steps pay for
allocator warm-up and lazy initialisation) of each phase the trainer times (`PPOTrainer.step` records them):

    generate   sampling the responses (KV cache)
    score      the reward model's scores
    policy     the rollout's no-grad policy (and critic) forward: old log-probs, values, entropy (0 with
               `old_logprobs: sampler`, which keeps the sampler's own)
    reference  the reference model's log-probs
    update     the PPO epochs (forward with graph, backward, optimizer)

plus the step time, the rollout's sampled tokens per second of generation, and the machine; `per_step` keeps
every step's times and what it trained (`STAT_KEYS`: KL, score, answer length, ...). Chapter 09
explains the breakdown; `tools/compare_trl.py` runs trl 0.11.4 on the same work. Not part of `make test`.

`--matmul-precision bf16` runs the whole step with PyTorch's fp32 matrix products at bf16 precision
(`torch.backends.mkldnn.matmul.fp32_precision`: oneDNN rounds both inputs to bf16 and sums in fp32, on AMX or
AVX512-BF16 instructions), attention kept at fp32 (`matmul_precision`); `bf16_with_attention` puts attention under
it too. A measurement of what that precision would buy, not an engine option: the sampler's log-probs cannot stand
in for the training path's then, so it needs `-- --old_logprobs recompute`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import tempfile
import time

from marlhf_edu.records import cpu_features, machine, measured_on, write_result

PHASE_KEYS = ("generate", "score", "policy", "reference", "update")
#: what each step trained, kept beside its times: two runs of one seed can be compared step by step
STAT_KEYS = ("kl/k1", "score/mean", "response/length", "response/no_eos_rate", "loss/policy", "rollout/logprob_gap",
             "policy/entropy", "value/mean", "loss/value")
#: `--matmul-precision`: fp32 products in fp32 (PyTorch's default), at bf16 with attention in fp32, or all at bf16
MATMUL_PRECISIONS = ("ieee", "bf16", "bf16_with_attention")


@contextlib.contextmanager
def matmul_precision(precision: str):
    """PyTorch's fp32 matrix products at `precision` inside the block, restored after (see the module docstring).

    With "bf16", `torch.nn.functional.scaled_dot_product_attention` runs at "ieee": under bf16 PyTorch's CPU flash
    attention took 7x as long on a 2-core Intel Xeon with AMX (one profiled SmolLM2 step, not recorded), more than
    the products gained. transformers' SDPA attention looks that function up on every call, so the wrapper is what
    it runs."""
    import torch
    import torch.nn.functional as F

    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision must be one of {MATMUL_PRECISIONS}, got {precision!r}")
    backend = torch.backends.mkldnn.matmul
    before, attention = backend.fp32_precision, F.scaled_dot_product_attention

    def fp32_attention(*args, **kwargs):
        inside = backend.fp32_precision
        backend.fp32_precision = "ieee"
        try:
            return attention(*args, **kwargs)
        finally:
            backend.fp32_precision = inside

    backend.fp32_precision = "ieee" if precision == "ieee" else "bf16"
    if precision == "bf16":
        F.scaled_dot_product_attention = fp32_attention
    try:
        yield
    finally:
        backend.fp32_precision, F.scaled_dot_product_attention = before, attention


def bf16_instructions(cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists AVX512-BF16 or AMX-BF16 (`/proc/cpuinfo`, or `cpuinfo`): the instructions bf16 precision
    runs on. PyTorch's own check also passes AVX-512 without them (emulated bf16), which is not what is measured."""
    if cpuinfo is None:
        path = pathlib.Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_features(cpuinfo)["cpu_flags"]))


def bench_steps(command: str, config_path: str, steps: int, overrides: list[str], precision: str = "ieee") -> dict:
    """Run `steps` PPO steps of `command` (`ppo` or `ma-ppo`) with `config_path` and `overrides`, fp32 products at
    `precision` (`matmul_precision`); every step's record."""
    import torch

    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.loading.cpu_products import fp32_products_where_needed
    from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
    from marlhf_edu.training.args import parse_stage_args

    factory = {"ppo": FourModelBackend.from_config, "ma-ppo": MultiAdapterBackend.from_config}[command]
    # as every `marlhf-edu` command runs: bf16/fp16 products in fp32 on a CPU without their kernels
    with tempfile.TemporaryDirectory() as out, fp32_products_where_needed() as mode:
        (config,) = parse_stage_args((PPOConfig,), ["--config", config_path, *overrides, "--output_dir", out,
                                                    "--total_steps", str(steps), "--eval_repeats", "0",
                                                    "--save_steps", "0"])
        config.validate()
        if precision != "ieee":
            if config.old_logprobs == "sampler":  # refused before anything loads
                raise SystemExit(f"bench_step: --matmul-precision {precision} with old_logprobs: sampler would take "
                                 "the PPO ratio against the sampler's bf16-rounded log-probs; add -- --old_logprobs "
                                 "recompute")
            if config.resolved_device != "cpu" or not bf16_instructions():
                raise SystemExit(f"bench_step: --matmul-precision {precision} is for a CPU run on a CPU with bf16 "
                                 "instructions (AVX512-BF16 or AMX); /proc/cpuinfo lists neither, or the run is not "
                                 "on the CPU")
        torch.manual_seed(config.seed)
        with matmul_precision(precision):
            start = time.perf_counter()
            backend = factory(config)
            load_s = time.perf_counter() - start
            trainer = PPOTrainer(backend, config, load_prompts(config, backend.tokenizer))
            records = [trainer.step() for _ in range(steps)]
        fp32_products = "off" if mode is None else "entered" if getattr(mode, "entered", True) else "never entered"
    return {"config": config, "records": records, "load_s": load_s, "fp32_products": fp32_products}


def summarise(records: list[dict], skip: int) -> dict:
    kept = records[skip:] or records
    mean = lambda key: sum(r[key] for r in kept) / len(kept)  # noqa: E731
    phases = {p: round(mean(f"time/{p}_s"), 4) for p in PHASE_KEYS}
    step = mean("time/step_s")
    return {"steps_averaged": f"{skip + 1}-{len(records)}" if records[skip:] else f"1-{len(records)}",
            "step_s": round(step, 4), "phases_s": phases,
            "other_s": round(step - sum(phases.values()), 4),  # score transforms, GAE, statistics, the KL controller
            "generate_tokens_per_s": round(mean("time/generate_tokens_per_s"), 1),
            "tokens_per_s": round(mean("time/tokens_per_s"), 1),
            "response_length": round(mean("response/length"), 2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--command", choices=("ppo", "ma-ppo"), default="ppo")
    parser.add_argument("--config", default="configs/tiny_ppo.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="leading steps left out of the means")
    parser.add_argument("--label", default="", help="a name for this case in the output")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON file to write (else print only)")
    parser.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="ieee",
                        help="fp32 matrix products at bf16 precision for the run (see above); needs old_logprobs: "
                             "recompute")
    parser.add_argument("extra", nargs="*", help="more stage overrides, after --")
    args = parser.parse_args(argv)

    result = bench_steps(args.command, args.config, args.steps, args.extra, args.matmul_precision)
    cfg = result["config"]
    precision = ("" if args.matmul_precision == "ieee"
                 else f" (tools/bench_step.py --matmul-precision {args.matmul_precision})")
    summary = {
        "label": args.label or " ".join([args.command, args.config, *args.extra]) + precision,
        "command": " ".join(["marlhf-edu", args.command, "--config", args.config, *args.extra]) + precision,
        "shape": {"batch_size": cfg.batch_size, "mini_batch_size": cfg.mini_batch_size,
                  "forward_batch_size": cfg.forward_batch_size, "max_new_tokens": cfg.max_new_tokens,
                  "ppo_epochs": cfg.ppo_epochs},
        **summarise(result["records"], args.skip),
        "load_s": round(result["load_s"], 2),
        "fp32_products": result["fp32_products"],  # cpu_products: off here, entered, or never entered (no bf16)
        "matmul_precision": args.matmul_precision,
        "per_step": [{k: round(v, 4) if k.startswith("time/") else v for k, v in r.items()
                      if k.startswith("time/") or k in STAT_KEYS} for r in result["records"]],
        "measured_on": measured_on(),
        "machine": machine(),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "per_step"}, indent=1))
    write_result(args.out, summary)
    return summary


if __name__ == "__main__":
    main()
