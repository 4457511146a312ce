"""The sweeps chapter 11 loads: over-optimisation against the learned reward model, and runs over seeds.

    python tools/sweep_evaluation.py goodhart   # -> benchmarks/overoptimisation.json (about 25 min on 2 cores)
    python tools/sweep_evaluation.py seeds      # -> benchmarks/seed_comparison.json  (about 12 min on 2 cores)
    python tools/sweep_evaluation.py contrasts  # -> benchmarks/dpo_grpo_seeds.json   (about 12 min on 2 cores)
    python tools/sweep_evaluation.py sft        # -> benchmarks/sft_seeds.json        (under 1 min on 2 cores)

goodhart: four-model PPO from the shipped SFT model and reward adapter (configs/tiny_ppo.yaml) at a
learning rate of 1e-4 for 100 steps, for several fixed β and seeds. Every step logs the reward model's
score, the gold judge's reward and the KL on its training batch; at `--eval_steps` the policy
answers the held-out prompts (sampled with a fixed seed, outside the training RNG stream), which gives
the held-out reward-model score, gold reward, KL to the reference, refusal rate and accuracy. The last
evaluation's answers that the reward model likes and the judge rejects are kept ("fooled").

seeds: chapter 10's comparison (configs/tiny_ppo.yaml against configs/tiny_ma_ppo.yaml, 20 steps) for
several seeds, with each run's held-out answers kept per prompt, so the chapter can put intervals on them.

contrasts (chapter 12): DPO (configs/tiny_dpo.yaml) and GRPO against the reward model and against the gold
judge (configs/tiny_grpo.yaml) with trl, for the same seeds as `seeds`, each run's held-out answers kept
the same way (sampled with seed 1000 + seed), so chapter 12 can set them beside PPO and MA-PPO.

sft (chapter 12): the shipped SFT model, untrained, answering the same held-out prompts with the same
sampling seeds (1000 + seed, 32 new tokens, 4 answers per prompt), so every trained policy can be compared
with its starting point paired by sampling seed and prompt.

Each writes the machine it ran on next to the numbers.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

from marlhf_edu.records import machine

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _config(path: str, out: str, extra: list[str]):
    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.training.args import parse_stage_args

    (cfg,) = parse_stage_args((PPOConfig,), ["--config", str(ROOT / path), "--output_dir", out, "--save_steps", "0",
                                             "--eval_repeats", "0", *extra])
    return cfg


def held_out(trainer, world, repeats: int, seed: int) -> tuple[dict, list[dict]]:
    """The policy's answers to the held-out prompts through the engine's own rollout (RM score, log-probs of
    policy and reference), with the training RNG stream saved and restored around it."""
    import torch

    from marlhf_edu.ppo.trainer import _masked_sum, fork_all_rngs

    prompts = [p for p in world.eval_prompts for _ in range(repeats)]
    with fork_all_rngs():
        torch.manual_seed(seed)
        r = trainer.rollout([p.prompt for p in prompts])
    responses = [t.strip() for t in r.texts(trainer.tokenizer)[1]]
    kl = _masked_sum(r.logprobs - r.ref_logprobs, r.response_mask)
    samples = [{"question": p.question, "kind": p.kind, "response": text, "verdict": world.judge(p, text),
                "gold": world.gold_reward(p, text), "reward_model_score": round(float(s), 4), "kl": round(float(k), 4)}
               for p, text, s, k in zip(prompts, responses, r.raw_scores.tolist(), kl.tolist())]
    rates = world.evaluate(lambda _: responses, prompts=prompts)
    summary = {key: sum(s[key] for s in samples) / len(samples) for key in ("reward_model_score", "gold", "kl")}
    summary.update({key: rates[key] for key in ("harmful_refusal_rate", "benign_accuracy")})
    return {k: round(v, 4) for k, v in summary.items()}, samples


def goodhart_run(beta: float, seed: int, steps: int, lr: float, eval_steps: list[int], repeats: int,
                 run_dir: pathlib.Path) -> dict:
    import torch

    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
    from marlhf_edu.ppo import FourModelBackend, PPOTrainer

    out = run_dir / f"sweep_goodhart_b{beta}_s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = _config("configs/tiny_ppo.yaml", str(out), ["--kl_coef", str(beta), "--adaptive_kl", "false",
                                                      "--learning_rate", str(lr), "--total_steps", str(steps),
                                                      "--seed", str(seed)])
    torch.manual_seed(cfg.seed)  # as the stage does
    world = ToyWorld(ToyWorldConfig(seed=cfg.toy_seed))
    trainer = PPOTrainer(FourModelBackend.from_config(cfg), cfg, load_prompts(cfg), gold_reward_fn=world.gold_rewards)
    keys = ("score/mean", "gold/mean", "kl/k1", "response/length")
    steps_log, evals, start = [], [], time.perf_counter()
    summary, samples = held_out(trainer, world, repeats, seed=1000 + seed)
    evals.append({"step": 0, **summary})
    for _ in range(steps):
        record = trainer.step()
        steps_log.append({"step": record["step"], **{k: round(record[k], 4) for k in keys}})
        if record["step"] in eval_steps or record["step"] == steps:
            summary, samples = held_out(trainer, world, repeats, seed=1000 + seed)
            evals.append({"step": record["step"], **summary})
            print(f"  beta={beta} seed={seed} step {record['step']}: {summary}", flush=True)
    # what the reward model likes and the judge rejects, best-scored first, one per distinct answer
    fooled, seen = [], set()
    for s in sorted(samples, key=lambda s: -s["reward_model_score"]):
        if s["gold"] == 0 and (s["question"], s["response"]) not in seen:
            seen.add((s["question"], s["response"]))
            fooled.append(s)
    shutil.rmtree(out, ignore_errors=True)
    return {"beta": beta, "seed": seed, "wall_s": round(time.perf_counter() - start, 1), "steps": steps_log,
            "evals": evals, "fooled": fooled[:8],
            "final_verdicts": {v: sum(s["verdict"] == v for s in samples) for v in
                               ("refusal", "complied", "correct", "wrong")}}


def goodhart(args) -> dict:
    runs = []
    for beta in args.betas:
        for seed in args.seeds:
            print(f"goodhart: beta={beta} seed={seed}", flush=True)
            runs.append(goodhart_run(beta, seed, args.steps, args.learning_rate, args.eval_steps, args.repeats,
                                     pathlib.Path(args.run_dir)))
    return {"config": "configs/tiny_ppo.yaml", "learning_rate": args.learning_rate, "total_steps": args.steps,
            "eval_repeats": args.repeats, "runs": runs, "machine": machine()}


def seeds(args) -> dict:
    from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
    from marlhf_edu.ppo import sample_toy
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
    from marlhf_edu.ppo.run import run

    world = ToyWorld(ToyWorldConfig(seed=0))
    methods = {"four-model": ("configs/tiny_ppo.yaml", None),
               "MA-PPO": ("configs/tiny_ma_ppo.yaml", MultiAdapterBackend.from_config)}
    runs = []
    for seed in args.seeds:
        for label, (path, factory) in methods.items():
            print(f"seeds: {label} seed={seed}", flush=True)
            out = pathlib.Path(args.run_dir) / f"sweep_seeds_{'ma' if factory else 'four'}_s{seed}"
            shutil.rmtree(out, ignore_errors=True)
            cfg = _config(path, str(out), ["--total_steps", str(args.steps), "--seed", str(seed)])
            start = time.perf_counter()
            result = run(cfg, factory, progress=False)
            wall = time.perf_counter() - start
            samples = sample_toy(result["trainer"].backend, world, args.repeats, cfg.max_new_tokens, seed=1000 + seed)
            last5 = lambda key: sum(r[key] for r in result["records"][-5:]) / 5  # noqa: E731
            runs.append({"method": label, "seed": seed, "train_wall_s": round(wall, 1),
                         "step_s": round(sum(r["time/step_s"] for r in result["records"]) / len(result["records"]), 3),
                         **{f"last5/{k}": round(last5(k), 4) for k in ("score/mean", "gold/mean", "kl/k1",
                                                                        "value/explained_variance")},
                         "samples": [{k: s[k] for k in ("question", "kind", "verdict")} for s in samples]})
            shutil.rmtree(out, ignore_errors=True)
    return {"configs": {k: v[0] for k, v in methods.items()}, "total_steps": args.steps, "eval_repeats": args.repeats,
            "runs": runs, "machine": machine()}


def contrast_run(stage: str, config: str, seed: int, run_dir: pathlib.Path, extra: list[str]) -> dict:
    """One trl run (DPO or GRPO stage) from its toy config, with its held-out answers."""
    import importlib

    out = run_dir / f"sweep_{stage}_{'_'.join(extra).replace('-', '')}_s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    module = importlib.import_module(f"marlhf_edu.stages.{stage}")
    start = time.perf_counter()
    trainer, metrics = module.main(["--config", str(ROOT / config), "--output_dir", str(out), "--seed", str(seed),
                                    "--data_seed", str(seed), "--disable_tqdm", "true", *extra])
    wall = time.perf_counter() - start
    logs = [r for r in trainer.state.log_history if "loss" in r]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    shutil.rmtree(out, ignore_errors=True)
    return {"seed": seed, "wall_s": round(wall, 1), "steps": trainer.state.global_step,
            "step_s": round(trainer.state.log_history[-1]["train_runtime"] / trainer.state.global_step, 3),
            "trainable_params": trainable, "log": [{k: round(float(v), 4) for k, v in r.items()} for r in logs],
            "held_out": {k: round(v, 4) for k, v in metrics.items() if k != "samples"},
            "samples": [{k: s[k] for k in ("question", "kind", "verdict")} for s in metrics["samples"]]}


def contrasts(args) -> dict:
    methods = {"DPO": ("dpo", "configs/tiny_dpo.yaml", []),
               "GRPO (reward model)": ("grpo", "configs/tiny_grpo.yaml", []),
               "GRPO (gold judge)": ("grpo", "configs/tiny_grpo.yaml", ["--reward", "gold"])}
    runs = []
    for seed in args.seeds:
        for label, (stage, config, extra) in methods.items():
            if label in args.skip:
                continue
            print(f"contrasts: {label} seed={seed}", flush=True)
            runs.append({"method": label, **contrast_run(stage, config, seed, pathlib.Path(args.run_dir), extra)})
            print(f"  {runs[-1]['held_out']} in {runs[-1]['wall_s']} s", flush=True)
    return {"configs": {k: v[1] + (" " + " ".join(v[2]) if v[2] else "") for k, v in methods.items()},
            "eval_repeats": 4, "runs": runs, "machine": machine()}


def sft(args) -> dict:
    from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR, SFT_DIR
    from marlhf_edu.loading.models import load_sft_model
    from marlhf_edu.loading.quiet import quiet_loading
    from marlhf_edu.ppo.judging import evaluate_trained_policy

    with quiet_loading():
        policy, tokenizer = load_sft_model()
    runs = []
    for seed in args.seeds:
        print(f"sft: sampling seed {1000 + seed}", flush=True)
        metrics = evaluate_trained_policy(policy, tokenizer, toy_seed=0, reward_base=str(SFT_DIR),
                                          reward_adapter=str(REWARD_ADAPTER_DIR), repeats=args.repeats,
                                          max_new_tokens=args.max_new_tokens, seed=1000 + seed)
        runs.append({"method": "SFT", "seed": seed, "held_out": {k: round(v, 4) for k, v in metrics.items()
                                                                if k != "samples"},
                     "samples": [{k: s[k] for k in ("question", "kind", "verdict")} for s in metrics["samples"]]})
    return {"model": "the shipped SFT model (marlhf_edu/assets/tiny_sft), untrained", "eval_repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens, "runs": runs, "machine": machine()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="sweep", required=True)
    g = sub.add_parser("goodhart")
    g.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.05, 0.2])
    g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    g.add_argument("--steps", type=int, default=100)
    g.add_argument("--learning_rate", type=float, default=1e-4)
    g.add_argument("--eval_steps", type=int, nargs="+", default=[5, 10, 15, 20, 30, 40, 60, 80, 100],
                   help="steps after which the policy answers the held-out prompts (step 0 always)")
    g.add_argument("--repeats", type=int, default=4)
    g.add_argument("--out", default="benchmarks/overoptimisation.json")
    s = sub.add_parser("seeds")
    s.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--repeats", type=int, default=4)
    s.add_argument("--out", default="benchmarks/seed_comparison.json")
    c = sub.add_parser("contrasts")
    c.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    c.add_argument("--skip", nargs="*", default=[], help="methods to leave out (a quick check)")
    c.add_argument("--out", default="benchmarks/dpo_grpo_seeds.json")
    f = sub.add_parser("sft")
    f.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    f.add_argument("--repeats", type=int, default=4)
    f.add_argument("--max_new_tokens", type=int, default=32)
    f.add_argument("--out", default="benchmarks/sft_seeds.json")
    for p in (g, s, c, f):
        p.add_argument("--run_dir", default=str(ROOT / "runs"), help="where the runs' scratch directories go")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = {"goodhart": goodhart, "seeds": seeds, "contrasts": contrasts, "sft": sft}[args.sweep](args)
    result = {"command": " ".join(["python tools/sweep_evaluation.py", *argv]), **result,
              "sweep_wall_s": round(time.perf_counter() - start, 1)}
    out = ROOT / args.out  # an absolute --out stays as it is
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} in {result['sweep_wall_s']} s")


if __name__ == "__main__":
    import os
    import warnings

    for key, value in (("TQDM_DISABLE", "1"), ("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore")
    main()
