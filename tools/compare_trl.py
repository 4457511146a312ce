"""This engine against trl 0.11.4's PPOTrainer (the engine MA-RLHF runs on), on the same work, back to back.

    python tools/compare_trl.py --trl-python trl011/bin/python [--steps 10] [--repeats 3] [--out benchmarks/speed_vs_trl.json]
    python tools/compare_trl.py --trl-python trl011/bin/python --trl-clip-check --steps 12 --out RECORD

trl 0.11.4 needs its own environment (it cannot share one with transformers 5); build it once, beside the repo:

    python3.11 -m venv trl011
    trl011/bin/pip install torch==2.13.0
    trl011/bin/pip install trl==0.11.4 transformers==4.44.2 peft==0.12.0 accelerate==0.34.2 \
        "datasets<3" "numpy<2" "pyarrow<16" rich

The same work: the shipped tiny SFT model and reward model (its LoRA merged, scored in one batch at the last real
token), the toy prompts in the order our trainer visits them, the batch shape of `configs/tiny_ppo.yaml` (64
rollouts, mini-batch 16, 32 new tokens at T = 1, 1 PPO epoch), AdamW with the gradient norm clipped at our config's
`max_grad_norm` (1.0, as MA-RLHF's PPO config has it; trl's default is no clipping) in every minibatch (unpatched,
trl 0.11.4's first clip_grad_norm_ call exhausts its parameter `filter` and no later call clips anything:
`trl_worker` makes it a list; `--trl-clip-check` counts what each unpatched call receives), fp32, on
this machine's cores. The models are written in transformers 4.44's format first (its config keys; BPE merges as
"a b" strings, which tokenizers of that era need). Each engine runs in a fresh process, one after the other; the
mean of steps 3 … N of each is reported (the first steps pay for warm-up), with each engine's mean response length,
since the time of a step grows with it.

Cases (ours, then trl's):
    full       `ppo` (separate critic, as the book teaches), `ppo --critic shared_head` and the same with
               `--merged_reward true` (the reward LoRA merged, as trl's side has it), against trl's
               AutoModelForCausalLMWithValueHead with a separate reference copy;
    lora       `ma-ppo --load_in_4bit false --value_mode shared` (LoRA r = 16 on all linear layers, value head on
               the policy) with and without `--merged_rollout true`, and with `--merged_reward true` too (the
               reward adapter merged into the sampling copy to score, as trl's side scores with merged weights),
               against trl with the same peft LoRA (reference = adapter disabled).
Each case's last setting adds the CPU options (`CPU_OPTIONS`: `old_logprobs: sampler`, `onednn_matmuls`,
`token_draw: inverse_cdf`; the same numbers up to fp32 rounding, the tokens from another random stream).
Not part of `make test`; its output is stored in `benchmarks/` and quoted by site/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = "configs/tiny_ppo.yaml"
LORA = ["--load_in_4bit", "false", "--value_mode", "shared", "--actor_lora_r", "16", "--actor_lora_alpha", "32"]
#: the CPU options of configs/smollm2/ma_ppo.yaml (chapter 09): the sampler's own log-probs and values and frozen
#: weights through oneDNN (the same numbers up to fp32 rounding), and the inverse-CDF token draw (the same
#: distribution from another random stream, so other tokens)
CPU_OPTIONS = ["--old_logprobs", "sampler", "--onednn_matmuls", "true", "--token_draw", "inverse_cdf"]
OURS = {  # case → [(label, command, overrides)]
    "full": [("separate critic (chapter 09)", "ppo", []),
             ("critic: shared_head", "ppo", ["--critic", "shared_head"]),
             ("critic: shared_head, merged_reward", "ppo", ["--critic", "shared_head", "--merged_reward", "true"]),
             ("critic: shared_head, merged_reward, CPU options", "ppo",
              ["--critic", "shared_head", "--merged_reward", "true", *CPU_OPTIONS])],
    "lora": [("LoRA, value head on the policy", "ma-ppo", LORA),
             ("LoRA, value head on the policy, merged_rollout", "ma-ppo", LORA + ["--merged_rollout", "true"]),
             ("LoRA, value head on the policy, merged_rollout, merged_reward", "ma-ppo",
              LORA + ["--merged_rollout", "true", "--merged_reward", "true"]),
             ("LoRA, value head on the policy, merged_rollout, merged_reward, CPU options", "ma-ppo",
              LORA + ["--merged_rollout", "true", "--merged_reward", "true", *CPU_OPTIONS])],
}


# ---- in this repository's environment ------------------------------------------------------------------------

def to_transformers_4_44(model_dir: pathlib.Path) -> None:
    """Rewrite a transformers-5 Llama directory so transformers 4.44 loads the same model and tokenizer."""
    config = json.loads((model_dir / "config.json").read_text())
    rope = config.pop("rope_parameters", {}) or {}
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    config["rope_scaling"] = None
    config["torch_dtype"] = config.pop("dtype", "float32")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    merges = tok["model"].get("merges", [])
    tok["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in merges]
    (model_dir / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 writes its own "TokenizersBackend"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def prepare(workdir: pathlib.Path, steps: int) -> dict:
    """The models (4.44 format), each step's prompts and the batch shape, in `workdir`."""
    from types import SimpleNamespace

    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.models import load_reward_model
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.ppo import PPOConfig, PPOTrainer
    from marlhf_edu.training.args import parse_stage_args

    sft = workdir / "sft"
    shutil.copytree(SFT_DIR, sft)
    to_transformers_4_44(sft)
    reward, tokenizer = load_reward_model()
    merged = reward.merge_and_unload()
    merged.save_pretrained(workdir / "reward")
    tokenizer.save_pretrained(workdir / "reward")
    to_transformers_4_44(workdir / "reward")
    (config,) = parse_stage_args((PPOConfig,), ["--config", str(ROOT / CONFIG)])
    prompts = load_prompts(config, load_tokenizer(SFT_DIR))
    view = SimpleNamespace(prompts=prompts, config=config)  # the trainer's own order of prompts, no models needed
    job = {"steps": [PPOTrainer.batch_prompts(view, s) for s in range(steps)],
           "batch_size": config.batch_size, "mini_batch_size": config.mini_batch_size,
           "max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
           "learning_rate": config.learning_rate, "kl_coef": config.kl_coef, "seed": config.seed,
           "max_grad_norm": config.max_grad_norm,
           "lora_r": 16, "lora_alpha": 32, "lora_targets": LORA_TARGETS}
    (workdir / "job.json").write_text(json.dumps(job))
    return job


def run_ours(label: str, command: str, extra: list[str], steps: int, skip: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "ours.json"
        subprocess.run([sys.executable, str(ROOT / "tools" / "bench_step.py"), "--command", command, "--config", CONFIG,
                        "--steps", str(steps), "--skip", str(skip), "--label", label, "--out", str(out), "--", *extra],
                       check=True, cwd=ROOT, env=_quiet_env(), stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    result.pop("per_step")
    return result


def run_trl(trl_python: str, workdir: pathlib.Path, case: str, skip: int, unpatched_clip: bool = False) -> dict:
    done = subprocess.run([trl_python, str(pathlib.Path(__file__).resolve()), "--trl-worker", str(workdir), "--case", case,
                           "--skip", str(skip), *(["--unpatched-clip"] if unpatched_clip else [])],
                          capture_output=True, text=True, env=_quiet_env())
    if done.returncode:
        raise RuntimeError(f"the trl 0.11.4 worker failed ({case}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _quiet_env() -> dict:
    return {**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# ---- in trl 0.11.4's environment (imports nothing from this repository) ------------------------------------

def trl_worker(workdir: pathlib.Path, case: str, skip: int, unpatched_clip: bool = False) -> dict:
    import time

    import torch
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    job = json.loads((workdir / "job.json").read_text())
    torch.manual_seed(job["seed"])
    tokenizer = AutoTokenizer.from_pretrained(workdir / "sft")
    peft_config = (LoraConfig(r=job["lora_r"], lora_alpha=job["lora_alpha"], lora_dropout=0.0, task_type="CAUSAL_LM",
                              target_modules=job["lora_targets"]) if case == "lora" else None)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(workdir / "sft"), peft_config=peft_config)
    ref = None if case == "lora" else AutoModelForCausalLMWithValueHead.from_pretrained(str(workdir / "sft"))
    reward = AutoModelForSequenceClassification.from_pretrained(str(workdir / "reward")).eval()
    config = PPOConfig(batch_size=job["batch_size"], mini_batch_size=job["mini_batch_size"], ppo_epochs=1,
                       learning_rate=job["learning_rate"], init_kl_coef=job["kl_coef"], adap_kl_ctrl=False,
                       cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, seed=job["seed"],
                       max_grad_norm=job["max_grad_norm"], log_with=None)  # ours clips (1.0), as MA-RLHF's config does
    trainer = PPOTrainer(config, model, ref, tokenizer)
    # trl 0.11.4 keeps the trainable parameters as a `filter` object, which its first clip_grad_norm_ call exhausts:
    # every later call gets nothing to clip. A list makes it clip every minibatch, as ours does. `unpatched_clip`
    # leaves the filter and counts the parameters each clip_grad_norm_ call receives (`--trl-clip-check`)
    clip_calls = []
    if unpatched_clip:
        clip = trainer.accelerator.clip_grad_norm_

        def counting_clip(parameters, *a, **k):
            parameters = list(parameters)
            clip_calls.append(len(parameters))
            return clip(parameters, *a, **k)

        trainer.accelerator.clip_grad_norm_ = counting_clip
    else:
        trainer.model_params = list(trainer.model_params)
    sampling = dict(max_new_tokens=job["max_new_tokens"], do_sample=True, top_k=0, top_p=1.0,
                    temperature=job["temperature"], pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id)
    records = []
    for prompts in job["steps"]:
        queries = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
        t0 = time.perf_counter()
        responses = trainer.generate(queries, batch_size=len(queries), return_prompt=False, **sampling)
        t1 = time.perf_counter()
        with torch.no_grad():  # one batch, right-padded, read at the last real token (the model's own pooling)
            texts = [torch.cat([q, r]) for q, r in zip(queries, responses)]
            batch = tokenizer.pad({"input_ids": texts}, padding=True, return_tensors="pt")
            scores = reward(**batch).logits[:, 0]
        rewards = list(scores.float())
        t2 = time.perf_counter()
        stats = trainer.step(queries, responses, rewards)
        t3 = time.perf_counter()
        records.append({"generate": t1 - t0, "score": t2 - t1, "step": t3 - t2, "total": t3 - t0,
                        "forward_pass": stats["time/ppo/forward_pass"], "optimize": stats["time/ppo/optimize_step"],
                        "response_length": sum(len(r) for r in responses) / len(responses),
                        "generated_tokens": sum(len(r) for r in responses)})
    kept = records[skip:]
    mean = lambda k: sum(r[k] for r in kept) / len(kept)  # noqa: E731
    import transformers
    import trl

    return {"engine": f"trl {trl.__version__} (transformers {transformers.__version__})", "case": case,
            "steps_averaged": f"{skip + 1}-{len(records)}", "step_s": round(mean("total"), 4),
            "phases_s": {"generate": round(mean("generate"), 4), "score": round(mean("score"), 4),
                         "forward_pass (policy + values + reference)": round(mean("forward_pass"), 4),
                         "optimize": round(mean("optimize"), 4),
                         "trl step, other": round(mean("step") - mean("forward_pass") - mean("optimize"), 4)},
            "generate_tokens_per_s": round(sum(r["generated_tokens"] for r in kept) / sum(r["generate"] for r in kept), 1),
            "response_length": round(mean("response_length"), 2), "torch_threads": torch.get_num_threads(),
            **({"clip_calls_parameters": clip_calls} if unpatched_clip else {})}


# ---- the comparison -------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="python of the trl 0.11.4 environment")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--cases", default="full,lora")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole comparison this many times (timings on a shared machine vary by 10-20 %%)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "speed_vs_trl.json")
    parser.add_argument("--trl-worker", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--unpatched-clip", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-clip-check", action="store_true",
                        help="only run trl's full case unpatched, count the parameters each of its clip_grad_norm_ "
                             "calls receives, and add that to the --out record")
    args = parser.parse_args(argv)
    if args.trl_worker:  # inside trl's environment
        print(json.dumps(trl_worker(args.trl_worker, args.case, args.skip, args.unpatched_clip)))
        return None
    if not args.trl_python:
        parser.error("--trl-python is required (see the docstring for the environment)")
    if args.trl_clip_check:
        return trl_clip_check(args.trl_python, args.steps, args.out)

    # here, not at the top: the trl worker above runs this file in trl's environment, without marlhf_edu
    from marlhf_edu.records import machine, measured_on

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        prepare(workdir, args.steps)
        for repeat in range(1, args.repeats + 1):
            for case in args.cases.split(","):
                trl = run_trl(args.trl_python, workdir, case, args.skip)
                print(json.dumps(trl))
                for label, command, extra in OURS[case]:
                    ours = run_ours(label, command, extra, args.steps, args.skip)
                    print(json.dumps({k: ours[k] for k in ("label", "step_s", "phases_s", "response_length")}))
                    results.append({"case": case, "repeat": repeat, "ours": ours, "trl": trl,
                                    "trl_s_over_ours_s": round(trl["step_s"] / ours["step_s"], 3)})
    out = {"what": "seconds per PPO step, mean of steps 3-N, same models, prompts and batch shape; "
                   "trl_s_over_ours_s > 1 means this engine is faster",
           "measured_on": measured_on(),
           "config": CONFIG, "steps": args.steps, "repeats": args.repeats, "results": results,
           "summary": summarise_repeats(results), "machine": machine()}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in out["summary"]:
        ratios = ", ".join(f"{x:.2f}" for x in r["trl_s_over_ours_s"])
        print(f"{r['case']:5s} {r['label']:78s} trl/ours median {r['median_trl_s_over_ours_s']:.2f} ({ratios})")
    return out


def trl_clip_check(trl_python: str, steps: int, out: pathlib.Path) -> dict:
    """trl 0.11.4's full case as MA-RLHF would run it (no list): the number of parameters each clip_grad_norm_ call
    received, stored in `out` (an existing record) as `trl_unpatched_clipping`."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        prepare(workdir, steps)
        calls = run_trl(trl_python, workdir, "full", 0, unpatched_clip=True)["clip_calls_parameters"]
    check = {"case": "full", "steps": steps, "max_grad_norm": 1.0, "calls": len(calls),
             "calls_with_parameters": sum(1 for n in calls if n), "parameters_per_call": calls,
             "command": f"python tools/compare_trl.py --trl-python trl011/bin/python --trl-clip-check --steps {steps} "
                        f"--out {out}"}
    record = json.loads(out.read_text()) if out.exists() else {}
    record["trl_unpatched_clipping"] = check
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"trl 0.11.4 unpatched: {check['calls_with_parameters']} of {check['calls']} clip_grad_norm_ calls received "
          f"parameters ({calls[:3]}...)")
    return check


def summarise_repeats(results: list[dict]) -> list[dict]:
    """Per case and label: every repeat's trl ÷ ours, their median, and the repeat whose ratio is the median
    (`median_repeat`: its phases are a typical run's)."""
    import statistics

    out = []
    for key in dict.fromkeys((r["case"], r["ours"]["label"]) for r in results):
        runs = [r for r in results if (r["case"], r["ours"]["label"]) == key]
        ratios = [r["trl_s_over_ours_s"] for r in runs]
        median = statistics.median(ratios)
        typical = min(runs, key=lambda r: abs(r["trl_s_over_ours_s"] - median))
        out.append({"case": key[0], "label": key[1], "trl_s_over_ours_s": ratios, "median_trl_s_over_ours_s": median,
                    "ours_step_s": [r["ours"]["step_s"] for r in runs], "trl_step_s": [r["trl"]["step_s"] for r in runs],
                    "median_repeat": typical["repeat"]})
    return out


if __name__ == "__main__":
    main()
