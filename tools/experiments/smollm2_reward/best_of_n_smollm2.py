"""Can a SmolLM2 reward model select refusals at all? Best-of-N against worst-of-N, before any PPO.

    python tools/experiments/smollm2_reward/best_of_n_smollm2.py [--reward zoo/smollm2_reward_adapter] [--n 16] \
        [--requests 64]
        # -> benchmarks/smollm2_best_of_n.json (+ the samples, benchmarks/smollm2_best_of_n_samples.jsonl.gz
        #    and smollm2_best_of_n_benign_samples.jsonl.gz); the record of the reward model shipped before the
        #    written pairs is benchmarks/smollm2_rm_probed_head.json

The SFT model (the shipped SFT adapter merged into SmolLM2, fp32) samples N answers at T = 0.7 (seed 0) to each
held-out red-team request of `KeywordJudge`, once: the samples are stored and reused, so every reward model is
judged on the same answers. The reward model (fp32 base) scores them in batches, and
`keyword_judge.best_of_n_rates` says whether the answer it likes best refuses more often than one sample does.
If not, PPO against it cannot be expected to raise refusals (site/benchmarks.md, chapter 13). Drawing and scoring took
375 s on 2 cores (AMD EPYC, commit 5f64dd1); scoring the stored samples alone takes about 100 s.

The same gate for helpfulness (`benign` in the output): N answers to each benign question of the judge, stored
beside the others (`--benign-samples`), and whether the answer the reward model likes best is right more often
than one sample. A reward model that fails it pays for evasions, and PPO against it trades right answers for
them (chapter 13).

The stored samples were drawn from the SFT adapter as shipped at commit 5f64dd1; `zoo rebuild` on another CPU
then rewrote it with every weight within 3e-5 of the old one (fp16 rounding of the same training run). Delete
the file to draw them again from the adapter shipped now.
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


def sample(n: int, requests: int, path: pathlib.Path, kind: str = "harmful") -> list[dict]:
    """`n` answers of the SFT model to each harmful request (`kind="harmful"`, the first `requests`) or to each
    benign question (`kind="benign"`), judged by the keywords, stored in `path`."""
    from marlhf_edu.data.keyword_judge import KeywordJudge
    from marlhf_edu.loading.generation import generate_responses
    from marlhf_edu.loading.models import load_sft_model

    policy, tokenizer = load_sft_model(SFT)
    judge = KeywordJudge(tokenizer, limit=requests)
    asked = [p for p in judge.eval_prompts if p.kind == kind]
    prompts = [p for p in asked for _ in range(n)]
    answers = generate_responses(policy, tokenizer, [p.prompt for p in prompts], max_new_tokens=48,
                                 temperature=0.7, seed=0)
    rows = [{"request": i // n, "prompt": p.prompt, "response": a, "refused": KeywordJudge.is_refusal(a)}
            for i, (p, a) in enumerate(zip(prompts, answers))]
    if kind == "benign":
        for row, p in zip(rows, prompts):
            row["correct"] = judge.judge(p, row["response"]) == "correct"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def load_samples(path: pathlib.Path, n: int, requests: int, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in gzip.open(path, "rt")] if path.exists() else sample(n, requests, path, kind)
    n_requests = rows[-1]["request"] + 1
    if len(rows) != n_requests * n:
        raise SystemExit(f"{path} holds {len(rows)} samples, not {n} for each of {n_requests} requests: "
                         f"delete it to sample again")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", default="zoo/smollm2_reward_adapter")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--samples", default="benchmarks/smollm2_best_of_n_samples.jsonl.gz", type=pathlib.Path)
    parser.add_argument("--benign-samples", default="benchmarks/smollm2_best_of_n_benign_samples.jsonl.gz",
                        type=pathlib.Path)
    parser.add_argument("--out", default="benchmarks/smollm2_best_of_n.json", type=pathlib.Path)
    args = parser.parse_args(argv)

    import torch

    from marlhf_edu.data.keyword_judge import best_of_n_rates
    from marlhf_edu.loading.models import load_reward_model
    from marlhf_edu.math.scoring import score_texts

    start = time.perf_counter()
    rows = load_samples(ROOT / args.samples, args.n, args.requests, "harmful")
    benign = load_samples(ROOT / args.benign_samples, args.n, args.requests, "benign")
    sampled = time.perf_counter() - start
    reward_model, reward_tokenizer = load_reward_model(SFT, args.reward)

    def best_of_n(rows, flag):
        scores = score_texts(reward_model, reward_tokenizer, [r["prompt"] + r["response"] for r in rows], batch_size=32)
        p = rows[-1]["request"] + 1
        return best_of_n_rates(scores.view(p, args.n), torch.tensor([r[flag] for r in rows]).view(p, args.n)), scores

    rates, scores = best_of_n(rows, "refused")
    benign_rates, benign_scores = best_of_n(benign, "correct")
    result = {"reward_model": args.reward, "temperature": 0.7, "seed": 0, "samples": str(args.samples), **rates,
              "scores": [round(s, 4) for s in scores.tolist()],
              "benign": {"what": "the same on the benign questions, 'correct' in place of 'refused': does the "
                                 "reward model pick the right answer to a harmless question?",
                         "samples": str(args.benign_samples), **benign_rates,
                         "scores": [round(s, 4) for s in benign_scores.tolist()]},
              "seconds": {"sampling": round(sampled, 1), "scoring": round(time.perf_counter() - start - sampled, 1)},
              "machine": machine()}
    (ROOT / args.out).write_text(json.dumps(result, indent=1) + "\n")
    shown = {k: v for k, v in result.items() if k != "scores"}
    shown["benign"] = benign_rates
    print(json.dumps(shown, indent=2))


if __name__ == "__main__":
    main()
