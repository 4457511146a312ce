"""Chapter 13's sentiment experiment on SmolLM2-135M: the SFT model's answers, VADER's pairs, the reward model's
best-of-N gate.

    python tools/experiments/smollm2_sentiment/sentiment_smollm2.py sample --split train --n 8
        # -> benchmarks/smollm2_sentiment/sft_train.jsonl.gz
    python tools/experiments/smollm2_sentiment/sentiment_smollm2.py sample --split held_out --n 16
        # -> benchmarks/smollm2_sentiment/sft_held_out.jsonl.gz
    python tools/experiments/smollm2_sentiment/sentiment_smollm2.py pairs [--margin 0.3]
        # -> benchmarks/smollm2_sentiment/pairs_{train,held_out}.jsonl
    marlhf-edu rm --config configs/smollm2/sentiment_rm.yaml
        # -> runs/smollm2/sentiment_rm
    python tools/experiments/smollm2_sentiment/sentiment_smollm2.py gate --reward runs/smollm2/sentiment_rm \
        --out benchmarks/smollm2_sentiment/gate.json

`sample`: the SFT model (the shipped SFT adapter merged into SmolLM2-135M-Instruct, fp32, as PPO's policy starts)
answers each everyday question of one split (`marlhf_edu.data.everyday`, rendered with the model's chat
template) `n` times at T = 0.7 (PPO's sampling temperature), seed `--seed`, at most 48 new tokens; each answer
is stored with whether it ended with EOS (read from the sampled ids) and its VADER compound score.

`pairs`: `sentiment_judge.sentiment_pairs` of those answers, per question every two whose VADER scores differ by
at least `--margin`, the higher as chosen: the train split's pairs train the reward model, the held-out split's
measure it on questions of topics it never saw.

`gate`: before any PPO, does the reward model (on the NF4 base it was trained on, as PPO reads it) pick, among
the `n` held-out answers to a question, one VADER likes? VADER's mean score of the reward model's pick, against a random pick (the mean of all answers), against VADER's
own pick (the ceiling), and against the worst pick of the reward model; with the pick's EOS rate and length.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import pathlib
import time

from marlhf_edu.records import machine

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tools/experiments/<experiment>/<script>.py

SFT = "zoo/smollm2_sft_adapter"
MAX_NEW_TOKENS = 48
TEMPERATURE = 0.7
FOLDER = pathlib.Path("benchmarks/smollm2_sentiment")


def samples_path(split: str) -> pathlib.Path:
    return FOLDER / f"sft_{split}.jsonl.gz"


def read_samples(path: pathlib.Path) -> list[dict]:
    with gzip.open(ROOT / path, "rt") as f:
        return [json.loads(line) for line in f]


def sample(args) -> None:
    from marlhf_edu.data.everyday import everyday_rows
    from marlhf_edu.data.sentiment_judge import vader_compound
    from marlhf_edu.data.template import template_for
    from marlhf_edu.loading.generation import generate_responses
    from marlhf_edu.loading.models import load_sft_model

    out = args.out or samples_path(args.split)
    if (ROOT / out).exists():
        raise SystemExit(f"{out} exists: move it away first (nothing is overwritten)")
    start = time.perf_counter()
    policy, tokenizer = load_sft_model(SFT)
    template = template_for(tokenizer)
    rows = [r for r in everyday_rows() if r["split"] == args.split][:args.prompts or None]
    asked = [r for r in rows for _ in range(args.n)]
    prompts = [template.dialogue([(r["prompt"], None)]) for r in asked]
    print(f"sampling {args.n} answers to each of {len(rows)} {args.split} questions ({len(prompts)} answers)",
          flush=True)
    answers, finished = [], []
    for chunk in range(0, len(prompts), 256):  # progress; one seeded stream, as one call would draw
        a, f = generate_responses(policy, tokenizer, prompts[chunk:chunk + 256], max_new_tokens=MAX_NEW_TOKENS,
                                  temperature=TEMPERATURE, seed=args.seed if chunk == 0 else None, with_finished=True)
        answers += a
        finished += f
        print(f"  {len(answers)} of {len(prompts)} answers, {time.perf_counter() - start:.0f} s", flush=True)
    records = [{"question_index": i // args.n, "question": r["prompt"], "topic": r["topic"], "prompt": p,
                "response": a, "finished": f, "vader": round(vader_compound(a), 4)}
               for i, (r, p, a, f) in enumerate(zip(asked, prompts, answers, finished))]
    (ROOT / out).parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(ROOT / out, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    vader = [r["vader"] for r in records]
    summary = {"split": args.split, "questions": len(rows), "answers_per_question": args.n, "answers": len(records),
               "seed": args.seed, "temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS,
               "eos_rate": round(sum(finished) / len(finished), 4), "vader_mean": round(sum(vader) / len(vader), 4),
               "seconds": round(time.perf_counter() - start, 1), "machine": machine(), "file": str(out)}
    (ROOT / str(out).replace(".jsonl.gz", ".json")).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def pairs(args) -> None:
    from marlhf_edu.data.sentiment_judge import sentiment_pairs

    summary = {"margin": args.margin, "machine": machine()}
    summary["train_pairs_without_the_cap"] = len(sentiment_pairs(read_samples(samples_path("train")), margin=args.margin))
    for split, per_prompt in (("train", args.per_prompt or None), ("held_out", args.held_out_per_prompt)):
        out = FOLDER / f"pairs_{split}.jsonl"
        if (ROOT / out).exists():
            raise SystemExit(f"{out} exists: move it away first (nothing is overwritten)")
        samples = read_samples(samples_path(split))
        made = sentiment_pairs(samples, margin=args.margin, per_prompt=per_prompt)
        finished = {(s["prompt"], s["response"].strip()): s["finished"] for s in samples}
        (ROOT / out).write_text("".join(json.dumps(p) + "\n" for p in made))
        summary[split] = {"answers": len(samples), "questions": len({s["prompt"] for s in samples}),
                          "pairs": len(made), "per_prompt": per_prompt,
                          "questions_with_a_pair": len({p["prompt"] for p in made}),
                          "chosen_finished": round(sum(finished[p["prompt"], p["chosen"]] for p in made) / len(made), 4),
                          "rejected_finished": round(sum(finished[p["prompt"], p["rejected"]] for p in made) / len(made), 4),
                          "file": str(out)}
    (ROOT / FOLDER / "pairs.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def gate(args) -> None:
    import statistics

    from marlhf_edu.data.sentiment_judge import mean_tokens, repeated_trigram_share
    from marlhf_edu.data.template import template_for
    from marlhf_edu.loading.models import load_reward_model
    from marlhf_edu.loading.quantization import nf4_loading_kwargs
    from marlhf_edu.math.evaluation import best_of_n_picks, best_of_n_table
    from marlhf_edu.math.scoring import score_texts

    if (ROOT / args.out).exists():
        raise SystemExit(f"{args.out} exists: move it away first (nothing is overwritten)")
    start = time.perf_counter()
    samples = read_samples(samples_path("held_out"))
    n = sum(s["question_index"] == 0 for s in samples)
    questions = len(samples) // n
    if len(samples) != questions * n:
        raise SystemExit(f"{samples_path('held_out')}: {len(samples)} answers are not {n} to each question")
    # on the NF4 base it was trained on, as PPO reads it (the fp32 base shifts every score: chapter 10's NF4 trap)
    reward_model, tokenizer = load_reward_model(SFT, args.reward, **nf4_loading_kwargs("cpu"))
    template = template_for(tokenizer)
    # scored as the reward model was trained and as PPO scores: the bare answer after the prompt, EOS appended
    scores = score_texts(reward_model, tokenizer, [s["prompt"] + template.completion(s["response"]) for s in samples],
                         batch_size=32).view(questions, n)
    vader = [[s["vader"] for s in samples[q * n:(q + 1) * n]] for q in range(questions)]
    rows = [samples[q * n:(q + 1) * n] for q in range(questions)]
    table = best_of_n_table(scores.tolist(), vader, ns=[k for k in (1, 2, 4, 8, 16) if k <= n])
    for entry in table:  # the guards VADER cannot see, of the reward model's picks
        k = entry["n"]
        picked = [r[i] for r, i in zip(rows, best_of_n_picks(scores.tolist(), k))]
        entry.update(pick_eos_rate=sum(p["finished"] for p in picked) / questions,
                     pick_mean_tokens=mean_tokens([p["response"] for p in picked], tokenizer),
                     pick_repeated_trigram_share=repeated_trigram_share([p["response"] for p in picked]))
    table = [{k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()} for entry in table]
    result = {"reward_model": str(args.reward), "base": "NF4 (double quant, fp32 compute), as trained",
              "samples": str(samples_path("held_out")), "questions": questions,
              "answers_per_question": n, "table": table,
              "within_question_rank_correlation": round(statistics.fmean(
                  _spearman(scores[q].tolist(), vader[q]) for q in range(questions)), 4),
              "scores": [round(x, 4) for x in scores.flatten().tolist()],
              "seconds": round(time.perf_counter() - start, 1), "machine": machine()}
    (ROOT / args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "scores"}, indent=1))


def _interval(xs: list[float]) -> dict:
    """Mean of `xs` with its 95 % t-interval (`evaluation.mean_interval`)."""
    from marlhf_edu.math.evaluation import mean_interval

    mean, low, high = mean_interval(xs)
    return {"mean": round(mean, 4), "low": round(low, 4), "high": round(high, 4), "n": len(xs)}


def run_report(folder: pathlib.Path, sft_model=None, tokenizer=None) -> dict:
    """What one PPO run's record folder shows: VADER on the held-out questions after against before, paired by
    question (each question's mean over its answers), the guards before and after, the last step's KL and the
    reward model's score; with `sft_model`, the answers' mean log-probability under the SFT model."""
    from marlhf_edu.data.sentiment_judge import gold_change, sentiment_report

    samples = [json.loads(line) for line in (ROOT / folder / "eval_samples.jsonl").read_text().splitlines()]
    run = json.loads((ROOT / folder / "run.json").read_text())
    records = [json.loads(line) for line in (ROOT / folder / "metrics.jsonl").read_text().splitlines()]
    change, low, high = gold_change([samples])
    out = {"folder": str(folder), "seed": run["seed"], "reward": run["reward"], "kl_coef": run["kl_coef"],
           "steps": run["steps"], "vader_change": {"mean": round(change, 4), "low": round(low, 4),
                                                    "high": round(high, 4)}, "samples": samples}
    for when in ("before", "after"):
        chosen = [s for s in samples if s["when"] == when]
        prompts = None
        if sft_model is not None:
            from marlhf_edu.data.template import template_for

            template = template_for(tokenizer)
            prompts = [template.dialogue([(s["question"], None)]) for s in chosen]
        report = sentiment_report([{"response": s["response"], "finished": s["finished"],
                                    **({"prompt": p} if prompts else {})}
                                   for s, p in zip(chosen, prompts or [None] * len(chosen))],
                                  model=sft_model, tokenizer=tokenizer)
        report["reward_model_score"] = sum(s["reward_model_score"] for s in chosen) / len(chosen)
        out[when] = {k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}
    last = records[-1]
    out["last_step"] = {k: round(last[k], 4) for k in ("kl/k1", "kl/k3", "score/mean", "response/length",
                                                        "response/no_eos_rate") if k in last}
    out["kl_k1_last5"] = round(sum(r["kl/k1"] for r in records[-5:]) / len(records[-5:]), 4)
    out["train_s"] = run.get("train_s")
    out["measured_on"] = run.get("measured_on")
    return out


def report(args) -> None:
    """Each run folder's `run_report`, and the pooled change over the folders given (paired by question)."""
    from marlhf_edu.data.sentiment_judge import gold_change

    sft_model = tokenizer = None
    if args.logprob:
        from marlhf_edu.loading.models import load_sft_model

        sft_model, tokenizer = load_sft_model(SFT)
    runs = [run_report(folder, sft_model, tokenizer) for folder in args.folders]
    # the chapter's pooling (gold_change): each question's answers over every run, questions resampled
    try:
        change, low, high = gold_change([r.pop("samples") for r in runs])
    except ValueError as error:
        raise SystemExit(f"{error} ({', '.join(str(f) for f in args.folders)})") from None
    result = {"runs": runs, "pooled_over_runs_paired_by_question": {"mean": round(change, 4), "low": round(low, 4),
                                                                    "high": round(high, 4)},
              "t_interval_over_runs": _interval([r["vader_change"]["mean"] for r in runs]) if len(runs) > 1 else None}
    text = json.dumps(result, indent=1)
    if args.out:
        if (ROOT / args.out).exists():
            raise SystemExit(f"{args.out} exists: move it away first (nothing is overwritten)")
        (ROOT / args.out).write_text(text + "\n")
    print(text)


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two lists (ties given their mean rank)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(x):
            j = i
            while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 0.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample", help="the SFT model's answers to the everyday questions of one split")
    p.add_argument("--split", choices=("train", "held_out"), required=True)
    p.add_argument("--n", type=int, default=8, help="answers per question")
    p.add_argument("--prompts", type=int, default=0, help="the first N questions of the split; 0 = all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=None)
    p = sub.add_parser("pairs", help="VADER's preference pairs from the stored answers of both splits")
    p.add_argument("--margin", type=float, default=0.3, help="least VADER gap between chosen and rejected")
    p.add_argument("--per-prompt", type=int, default=4,
                   help="at most this many training pairs a question, largest VADER gaps first; 0 = every pair")
    p.add_argument("--held-out-per-prompt", type=int, default=4, help="at most this many held-out pairs a question")
    p = sub.add_parser("gate", help="best-of-N on the held-out answers: does the reward model pick what VADER likes?")
    p.add_argument("--reward", type=pathlib.Path, required=True, help="the reward adapter's folder")
    p.add_argument("--out", type=pathlib.Path, default=FOLDER / "gate.json")
    p = sub.add_parser("report", help="VADER and the guards before and after, per PPO run folder and pooled")
    p.add_argument("folders", nargs="+", type=pathlib.Path, help="record folders of tools/bench_smollm2.py")
    p.add_argument("--logprob", action="store_true", help="also the answers' mean log-prob under the SFT model")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    {"sample": sample, "pairs": pairs, "gate": gate, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
