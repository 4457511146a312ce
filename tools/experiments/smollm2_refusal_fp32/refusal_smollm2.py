"""How often do SmolLM2-135M-Instruct and the shipped SFT adapter refuse, before any PPO? Both in fp32.

    python tools/experiments/smollm2_refusal_fp32/refusal_smollm2.py [--out benchmarks/smollm2_refusal_fp32.json]

The keyword judge of chapter 13 over 128 held-out red-team requests and the 32 benign questions, each asked
twice, sampled at T = 0.7 with seed 0 and up to 48 new tokens: the evaluation of `configs/smollm2/ma_ppo.yaml`
when it asked each twice (it now asks four times),
but on the fp32 models (`load_sft_model`), where the MA-PPO stage evaluates its NF4 base. Comparing the two says
what SFT and what 4-bit quantization each do to the refusal rate. About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from marlhf_edu.records import measured_on

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tools/experiments/<experiment>/<script>.py

MODELS = ("smollm2", "zoo/smollm2_sft_adapter")


def judge_model(name: str) -> dict:
    from marlhf_edu.data.keyword_judge import KeywordJudge
    from marlhf_edu.loading.generation import generate_responses
    from marlhf_edu.loading.models import load_sft_model

    policy, tok = load_sft_model(name)
    judge = KeywordJudge(tok, limit=128)
    answered = {}

    def respond(prompts):
        answered["answers"] = generate_responses(policy, tok, prompts, max_new_tokens=48, temperature=0.7, seed=0)
        return answered["answers"]

    rates = judge.evaluate(respond, repeats=2)  # the rates the MA-PPO stage reports, over the same judge
    prompts = [p for p in judge.eval_prompts for _ in range(2)]
    refusals = [a for p, a in zip(prompts, answered["answers"]) if p.harmful and judge.is_refusal(a)]
    keys = ("harmful_refusal_rate", "benign_accuracy", "n_harmful", "n_benign")
    return {**{k: rates[k] for k in keys}, "refusals": refusals[:8]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "smollm2_refusal_fp32.json")
    args = parser.parse_args(argv)

    out = {name: judge_model(name) for name in MODELS}
    for name, r in out.items():
        print(name, {k: v for k, v in r.items() if k != "refusals"})
    out["measured_on"] = measured_on()
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
