"""The exported policy of a SmolLM2 MA-PPO run, judged on the fp32 SFT model it is meant for (issue 33).

    python tools/experiments/smollm2_refusal_sft/eval_fp32_smollm2.py --run runs/smollm2/bench_seed1 \
        --out benchmarks/smollm2_eos/config_seed1

A run trains its LoRA on an NF4 copy of the SFT model and judges it there (`eval_samples.jsonl`). Its exported
adapter (`policy/`) is meant for the full-precision SFT model, and NF4 alone halves the SFT model's refusals
(chapter 13): part of a change measured on NF4 could be quantization damage being undone. This runs
`marlhf-edu evaluate` twice with the run's own evaluation settings (held-out requests, answers per request,
temperature, answer length, sampling seed 0) and `--load_in_4bit false`: the SFT model alone (once, stored in
`benchmarks/smollm2_eos/sft_fp32/` and reused by every run) and the exported adapter on it. It writes
`fp32_eval_samples.jsonl` into `--out`: the SFT model's answers tagged `when: before`, the adapter's `after`,
so chapter 13 reads them as it reads a run's own `eval_samples.jsonl`, plus `fp32_eval.json` (both
evaluations' rates, seconds, machine). About 4 minutes per evaluation on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from marlhf_edu.records import machine, measured_on

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tools/experiments/<experiment>/<script>.py

SFT_RECORD = ROOT / "benchmarks" / "smollm2_eos" / "sft_fp32"


def evaluate(model: str, settings: dict, out: pathlib.Path) -> tuple[dict, list[dict], float]:
    from marlhf_edu.stages.evaluate import main as evaluate_main

    start = time.perf_counter()
    result = evaluate_main(["--model", model, "--reward_adapter", settings["reward_adapter_path"],
                            "--judge", "keyword", "--prompts", str(settings["eval_prompts"]),
                            "--repeats", str(settings["eval_repeats"]),
                            "--max_new_tokens", str(settings["max_new_tokens"]),
                            "--temperature", str(settings["temperature"]), "--seed", "0", "--device", "cpu",
                            "--dtype", "float32", "--load_in_4bit", "false", "--output_dir", str(out)])
    seconds = time.perf_counter() - start
    samples = result.pop("samples")
    return result, samples, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, type=pathlib.Path, help="a run folder holding policy/ and run.json")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="the run's record folder in benchmarks/")
    args = parser.parse_args(argv)

    run, out = ROOT / args.run, ROOT / args.out
    here = measured_on()
    if not (run / "policy" / "adapter_config.json").exists():
        sys.exit(f"{run}/policy: no exported adapter (adapter_config.json) to evaluate")
    import yaml

    settings = json.loads((out / "run.json").read_text())  # what tools/bench_smollm2.py recorded of the run
    settings["sft_model_path"] = yaml.safe_load((ROOT / settings["config"]).read_text())["sft_model_path"]
    if any(o.startswith("--sft_model_path") for o in settings["overrides"]):
        sys.exit("a run with its own --sft_model_path: evaluate it by hand")
    key = {k: settings[k] for k in ("sft_model_path", "reward_adapter_path", "eval_prompts", "eval_repeats",
                                    "max_new_tokens", "temperature")}
    sft_json = SFT_RECORD / "fp32_eval.json"
    if sft_json.exists() and json.loads(sft_json.read_text())["settings"] == key:
        before = json.loads(sft_json.read_text())
        before_samples = [json.loads(line) for line in open(SFT_RECORD / "eval_samples.jsonl")]
        print(f"the SFT model's fp32 answers: reused from {SFT_RECORD}")
    else:
        metrics, before_samples, seconds = evaluate(settings["sft_model_path"], settings, SFT_RECORD)
        before = {"settings": key, "model": settings["sft_model_path"], "metrics": metrics, "seconds": round(seconds, 1),
                  "measured_on": here}
        sft_json.write_text(json.dumps(before, indent=2) + "\n")
        (SFT_RECORD / "eval_metrics.json").unlink(missing_ok=True)  # fp32_eval.json holds the same rates
    metrics, after_samples, seconds = evaluate(str(run / "policy"), settings, run / "fp32_eval")
    tagged = [{**s, "when": "before"} for s in before_samples] + [{**s, "when": "after"} for s in after_samples]
    (out / "fp32_eval_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in tagged))
    record = {"what": "the exported policy adapter and, before, the SFT model alone, both on the fp32 SFT model "
                      "(marlhf-edu evaluate --load_in_4bit false), with the run's evaluation settings",
              "settings": key, "before": before["metrics"], "after": metrics,
              "seconds_after": round(seconds, 1), "seconds_before": before["seconds"],
              "command": f"python tools/experiments/smollm2_refusal_sft/eval_fp32_smollm2.py --run {args.run}"
                         f" --out {args.out}",
              "measured_on": here,
              "machine": machine()}
    (out / "fp32_eval.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("before", "after", "seconds_after")}, indent=2))


if __name__ == "__main__":
    main()
