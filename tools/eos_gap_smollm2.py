"""How differently does the shipped SmolLM2 reward model score an answer with and without its EOS?

    python tools/eos_gap_smollm2.py [--out benchmarks/smollm2_eos/eos_gap.json]

The fp32 SFT model (`zoo/smollm2_sft_adapter`) answers 128 held-out red-team requests twice (256 answers,
T = 0.7, seed 0, up to 48 new tokens: the evaluation of `configs/smollm2/ma_ppo.yaml` when it asked
each request twice; it now asks four times). The shipped reward model
(fp32) reads every answer both ways, on the same token ids: with EOS after the answer's last token (as it was
trained, and as the engine now reads a cut-off answer, `append_missing_eos`) and without (an answer that ended
with EOS loses it). Reported per group (answers that ended, answers cut off at the limit) and over all: the mean
of each reading, the mean and spread of the paired gap, and the spread between answers. Chapter 13 reads it.
About 3 minutes on 2 cores.
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

SFT, REWARD = "zoo/smollm2_sft_adapter", "zoo/smollm2_reward_adapter"


def summary(with_eos, without) -> dict:
    gap = with_eos - without
    return {"n": int(len(gap)), "mean_with_eos": float(with_eos.mean()), "mean_without_eos": float(without.mean()),
            "mean_gap": float(gap.mean()), "gap_std": float(gap.std()) if len(gap) > 1 else 0.0,
            "share_higher_with_eos": float((gap > 0).float().mean()),
            "between_answers_std_with_eos": float(with_eos.std()) if len(gap) > 1 else 0.0}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "smollm2_eos" / "eos_gap.json")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    args = parser.parse_args(argv)

    import torch

    from marlhf_edu.data.keyword_judge import KeywordJudge
    from marlhf_edu.loading.device import cpu_name as _cpu_name
    from marlhf_edu.loading.models import load_reward_model, load_sft_model
    from marlhf_edu.math.scoring import append_missing_eos, sequence_scores
    from marlhf_edu.ppo.backends import sample
    from marlhf_edu.ppo.trainer import response_mask_from_ids

    start = time.perf_counter()
    policy, tok = load_sft_model(SFT)
    reward, _ = load_reward_model(SFT, REWARD)
    judge = KeywordJudge(tok, limit=args.requests)
    prompts = [p.prompt for p in judge.eval_prompts if p.harmful for _ in range(args.repeats)]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    with_eos, without, ended = [], [], []
    torch.manual_seed(0)
    with torch.no_grad():
        for i in range(0, len(prompts), 32):
            enc = tok(prompts[i:i + 32], return_tensors="pt", padding=True, padding_side="left")
            P = enc["input_ids"].shape[1]
            out = sample(policy, tok, enc["input_ids"], enc["attention_mask"], max_new_tokens=args.max_new_tokens,
                         temperature=0.7)
            response = out[:, P:]
            mask = response_mask_from_ids(response, eos)
            has_eos = ((response == eos) & mask).any(1)
            response = torch.where(mask, response, pad)
            # the answer's tokens without its EOS: the cut-off reading; then EOS after the last token: as trained
            bare = mask & (response != eos)
            ids = torch.cat([enc["input_ids"], torch.where(bare, response, pad)], 1)
            attn = torch.cat([enc["attention_mask"].bool(), bare], 1).long()
            without.append(sequence_scores(reward, ids, attn))
            with_eos.append(sequence_scores(reward, *append_missing_eos(ids, attn, torch.zeros_like(has_eos), eos, pad)))
            ended.append(has_eos)
    with_eos, without, ended = torch.cat(with_eos), torch.cat(without), torch.cat(ended)
    record = {
        "what": "shipped SmolLM2 reward model (fp32) on the fp32 SFT model's answers to held-out red-team requests, "
                "each answer read with EOS after its last token and without",
        "command": "python tools/eos_gap_smollm2.py", "requests": args.requests, "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens, "temperature": 0.7, "seed": 0,
        "all": summary(with_eos, without),
        "ended_with_eos": summary(with_eos[ended], without[ended]) if ended.any() else None,
        "cut_off": summary(with_eos[~ended], without[~ended]) if (~ended).any() else None,
        "seconds": round(time.perf_counter() - start, 1),
        "measured_on": f"{_cpu_name()}, {machine()['torch_threads']} threads, torch {machine()['torch']}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
