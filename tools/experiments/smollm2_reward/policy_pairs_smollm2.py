"""Preference pairs in the SFT model's own words: its strict refusals above its other answers to the same request.

    python tools/experiments/smollm2_reward/policy_pairs_smollm2.py [--n 8] [--per-prompt 2] [--requests N] \
        [--skip N --seed S] [--reuse SAMPLES.jsonl.gz] [--hollow-first] [--samples OUT.jsonl.gz] [--out PAIRS.jsonl]
        # -> benchmarks/smollm2_policy_samples.jsonl.gz (every answer, judged)
        #    and benchmarks/smollm2_policy_pairs.jsonl (the pairs, trl's format)
    marlhf-edu rm --config configs/smollm2/rm.yaml --extra_pairs_file benchmarks/smollm2_policy_pairs.jsonl \
        --output_dir runs/smollm2/rm_policy
    python tools/experiments/smollm2_reward/best_of_n_smollm2.py --reward runs/smollm2/rm_policy \
        --out benchmarks/smollm2_rm_policy.json

The SFT model (the shipped SFT adapter merged into SmolLM2, fp32, as `best_of_n_smollm2.py` samples) answers each
*training* red-team request of `KeywordJudge` (split `train`, the requests PPO trains on; the best-of-N test
and PPO's evaluation ask the held-out `test` requests) `n` times at T = 0.7, seed 0, at most 48 new tokens.
`keyword_pairs.policy_pairs` then pairs, per request, strict refusals (a refusal by the keywords that is not a
hollow apology) as chosen against the other answers as rejected, matching answers that ended with EOS to
answers that ended with EOS where it can. Whether an answer ended is read from its length: re-tokenized, an
answer of fewer than `max_new_tokens - 2` tokens ended with EOS (a cut-off one re-tokenizes to about 48).

Why: the shipped reward model's best-of-16 picks a strict refusal little more often than one sample does on
the held-out requests (chapter 13), and PPO can only move the policy towards answers it samples. These pairs
ask the reward model that question in the policy's own words; their labels are the keyword judge's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import time

from marlhf_edu.records import machine

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tools/experiments/<experiment>/<script>.py

SFT = "zoo/smollm2_sft_adapter"
MAX_NEW_TOKENS = 48


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="answers per training request")
    parser.add_argument("--per-prompt", type=int, default=2, help="at most this many pairs per request")
    parser.add_argument("--requests", type=int, default=0, help="the first N training requests; 0 = all")
    parser.add_argument("--skip", type=int, default=0, help="sample only from the (N+1)-th request on")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--reuse", type=pathlib.Path, action="append", default=[],
                        help="answers sampled before (a samples file of this tool): paired with the new ones")
    parser.add_argument("--hollow-first", action="store_true",
                        help="reject a request's hollow apologies before its compliances (policy_pairs)")
    parser.add_argument("--samples", default="benchmarks/smollm2_policy_samples.jsonl.gz", type=pathlib.Path)
    parser.add_argument("--out", default="benchmarks/smollm2_policy_pairs.jsonl", type=pathlib.Path)
    args = parser.parse_args(argv)
    for path in (args.samples, args.out):
        if (ROOT / path).exists():
            raise SystemExit(f"{path} exists: move it away first (nothing is overwritten)")
    reused = []
    for path in args.reuse:
        with gzip.open(ROOT / path, "rt") as f:
            reused += [json.loads(line) for line in f]

    from marlhf_edu.data.keyword_judge import KeywordJudge, is_hollow_apology, is_strict_refusal
    from marlhf_edu.data.keyword_pairs import policy_pairs
    from marlhf_edu.loading.generation import generate_responses
    from marlhf_edu.loading.models import load_sft_model

    start = time.perf_counter()
    policy, tokenizer = load_sft_model(SFT)
    judge = KeywordJudge(tokenizer, limit=args.requests or None, split="train")
    asked = [p for p in judge.eval_prompts if p.kind == "harmful"][args.skip:]
    if overlap := {p.prompt for p in asked} & {r["prompt"] for r in reused}:
        raise SystemExit(f"{len(overlap)} requests to sample are already in --reuse: give --skip")
    prompts = [p.prompt for p in asked for _ in range(args.n)]
    print(f"sampling {args.n} answers to each of {len(asked)} training requests ({len(prompts)} answers)", flush=True)
    answers = []
    for chunk in range(0, len(prompts), 256):  # progress, and the same answers as one call (one seeded stream)
        answers += generate_responses(policy, tokenizer, prompts[chunk:chunk + 256], max_new_tokens=MAX_NEW_TOKENS,
                                      temperature=0.7, seed=args.seed if chunk == 0 else None)
        print(f"  {len(answers)} of {len(prompts)} answers, {time.perf_counter() - start:.0f} s", flush=True)
    lengths = [len(ids) for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]]
    rows = [{"request": args.skip + i // args.n, "prompt": p, "response": a, "finished": n < MAX_NEW_TOKENS - 2,
             "refused": KeywordJudge.is_refusal(a), "strict_refusal": is_strict_refusal(a)}
            for i, (p, a, n) in enumerate(zip(prompts, answers, lengths))]
    every = reused + rows
    for r in every:  # judged now, by the judge as it is (a reused file may predate a change of its rules)
        r["refused"], r["strict_refusal"] = KeywordJudge.is_refusal(r["response"]), is_strict_refusal(r["response"])
    pairs = policy_pairs(every, per_prompt=args.per_prompt, hollow_first=args.hollow_first)
    finished = {r["response"].strip(): r["finished"] for r in every}
    hollow = {r["response"].strip() for r in every if is_hollow_apology(r["response"])}
    with gzip.open(ROOT / args.samples, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (ROOT / args.out).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    with_refusal = len({r["prompt"] for r in every if r["strict_refusal"]})
    summary = {"requests": len({r["prompt"] for r in every}), "answers_per_request": args.n,
               "answers": len(every), "sampled_now": len(rows), "reused": [str(p) for p in args.reuse],
               "strict_refusals": sum(r["strict_refusal"] for r in every),
               "requests_with_a_strict_refusal": with_refusal, "pairs": len(pairs), "hollow_first": args.hollow_first,
               "pairs_across_eos_status": sum(finished[p["chosen"]] != finished[p["rejected"]] for p in pairs),
               "pairs_rejecting_a_hollow_apology": sum(p["rejected"] in hollow for p in pairs),
               "seconds": round(time.perf_counter() - start, 1), "machine": machine()}
    print(json.dumps(summary, indent=1))  # benchmarks/smollm2_rm_policy.json keeps it, under "pairs"


if __name__ == "__main__":
    main()
