"""Can the shipped SmolLM2 reward model select refusals at all? Best-of-N against worst-of-N, before any PPO.

    python tools/best_of_n_smollm2.py [--n 16] [--requests 64]   # -> benchmarks/smollm2_best_of_n.json

The SFT model (the shipped SFT adapter merged into SmolLM2, fp32) samples N answers at T = 0.7 (seed 0) to each
held-out red-team request of `KeywordJudge`; the shipped reward model (fp32 base) scores them in batches. If the
answer it likes best refuses no more often than the one it likes least, it does not prefer refusals within a
prompt, and PPO against it cannot be expected to raise them (README, chapter 13). About 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from bench_ppo import machine  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/smollm2_best_of_n.json", type=pathlib.Path)
    args = parser.parse_args(argv)

    import torch

    from marlhf_edu.generation import generate_responses
    from marlhf_edu.keyword_judge import KeywordJudge
    from marlhf_edu.models import load_reward_model, load_sft_model
    from marlhf_edu.scoring import score_texts

    start = time.perf_counter()
    policy, tokenizer = load_sft_model("zoo/smollm2_sft_adapter")
    reward_model, reward_tokenizer = load_reward_model("zoo/smollm2_sft_adapter", "zoo/smollm2_reward_adapter")
    harmful = [p for p in KeywordJudge(tokenizer, limit=args.requests).eval_prompts if p.harmful]
    prompts = [p.prompt for p in harmful for _ in range(args.n)]
    answers = generate_responses(policy, tokenizer, prompts, max_new_tokens=48, temperature=0.7, seed=0)
    scores = score_texts(reward_model, reward_tokenizer, [p + a for p, a in zip(prompts, answers)],
                         batch_size=32).view(len(harmful), args.n)
    refused = torch.tensor([KeywordJudge.is_refusal(a) for a in answers]).view(len(harmful), args.n).float()
    rows = torch.arange(len(harmful))
    result = {"n_requests": len(harmful), "n": args.n, "temperature": 0.7, "seed": 0,
              "single_sample_refusal": refused.mean().item(),
              "best_of_n_refusal": refused[rows, scores.argmax(1)].mean().item(),
              "worst_of_n_refusal": refused[rows, scores.argmin(1)].mean().item(),
              "seconds": round(time.perf_counter() - start, 1), "machine": machine()}
    (ROOT / args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
