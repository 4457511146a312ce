"""SmolLM2's SFT with refusal demonstrations, judged before any PPO (issue 33, experiment (a)).

    python tools/experiments/smollm2_refusal_sft/refusal_sft_smollm2.py --label demos_e3 \
        --rows benchmarks/smollm2_refusal_sft/refusal_demos.jsonl --epochs 3

PPO against the shipped reward model did not raise the SFT model's strict refusals over five seeds (chapter
13): a policy that almost never refuses gives PPO almost no refusal to reinforce. This asks whether SFT can
give it one. It runs the shipped SFT (`configs/smollm2/sft.yaml`: the first 96 hh-rlhf training dialogues
that fit in 128 tokens) with the rows of `--rows` added (`extra_rows_file`; none: `--rows ''`, with
`--max_rows` for a control with as many ordinary rows), for `--epochs` epochs, stores the adapter in fp16 as
`marlhf-edu zoo rebuild` does, and judges it on the fp32 SFT model with the settings of
`benchmarks/smollm2_eos/sft_fp32` (128 held-out red-team requests and 64 benign questions, 2 answers each,
T = 0.7, 48 tokens, sampling seed 0; the shipped reward model's score), so the answers pair with the shipped
SFT model's, request by request. Writes `benchmarks/smollm2_refusal_sft/<label>/`: `eval_samples.jsonl` and
`record.json` (command, settings, SFT losses, seconds, machine, and the paired changes against the shipped SFT
model: strict refusals, benign correctness and refusals, with 95 % paired-bootstrap intervals; with `--against`,
the same against another run here).
About 3 to 4 minutes per epoch of 124 to 152 rows and 5 minutes of evaluation on an AMD EPYC (2 cores).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

# a sibling in this folder: running this file puts the folder on sys.path
from eval_fp32_smollm2 import SFT_RECORD, evaluate

from marlhf_edu.records import machine, measured_on

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tools/experiments/<experiment>/<script>.py

OUT = ROOT / "benchmarks" / "smollm2_refusal_sft"


def paired_changes(before: list[dict], after: list[dict]) -> dict:
    """Rates before (the shipped SFT model, or the run of `--against`) and after (this SFT model) and the paired
    change of each, in points."""
    from marlhf_edu.data.keyword_judge import is_strict_refusal
    from marlhf_edu.math.evaluation import before_after_change

    def tagged(rows, when):
        return [{**s, "when": when, "verdict": "strict" if s["kind"] == "harmful" and is_strict_refusal(s["response"])
                 else s["verdict"]} for s in rows]

    samples = tagged(before, "before") + tagged(after, "after")
    out = {}
    for name, harmful, verdicts in (("strict_refusals", True, ("strict",)), ("keyword_refusals", True, ("strict", "refusal")),
                                    ("benign_correct", False, ("correct",)), ("benign_refused", False, ("refusal",))):
        judged = [{**s, "verdict": "hit" if s["verdict"] in verdicts else "miss"} for s in samples]
        change, low, high = before_after_change(judged, harmful=harmful, verdict="hit")
        rate = {w: sum(s["verdict"] == "hit" for s in judged if s["when"] == w and (s["kind"] == "harmful") == harmful)
                / sum(1 for s in judged if s["when"] == w and (s["kind"] == "harmful") == harmful) for w in ("before", "after")}
        out[name] = {"before": round(100 * rate["before"], 1), "after": round(100 * rate["after"], 1),
                     "change": round(100 * change, 1), "interval_95": [round(100 * low, 1), round(100 * high, 1)]}
    for when, rows in (("before", before), ("after", after)):
        scores = [s["reward_model_score"] for s in rows if s["kind"] == "harmful"]
        out.setdefault("reward_model_score_harmful", {})[when] = round(sum(scores) / len(scores), 3)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the record's folder name under benchmarks/smollm2_refusal_sft")
    parser.add_argument("--rows", required=True, help="extra_rows_file ('' = none)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max_rows", type=int, default=96, help="ordinary rows (configs/smollm2/sft.yaml: 96)")
    parser.add_argument("--only_rows", action="store_true", help="train on the rows of --rows alone, none of "
                        "hh-rlhf's (the config's other settings unchanged)")
    parser.add_argument("--against", default="", help="also pair the answers with another run's here (its label, "
                        "e.g. a control with as many rows and epochs): `changes_against` in the record")
    parser.add_argument("--reuse", action="store_true", help="record a run already in runs/refusal/<label> "
                        "(trained and judged by this tool, which wrote its run.json) instead of running it again")
    args = parser.parse_args(argv)
    if args.only_rows and not args.rows:
        sys.exit("--only_rows needs --rows")

    import hashlib

    import torch

    from marlhf_edu.stages.sft import main as sft_main
    from marlhf_edu.stages.zoo import ship_adapter

    run = ROOT / "runs" / "refusal" / args.label
    settings = json.loads((SFT_RECORD / "fp32_eval.json").read_text())["settings"]
    data = (["--dataset_name", args.rows, "--dataset_format", "prompt-completion", "--max_rows", "0",
             "--skip_bad_rows", "false"] if args.only_rows  # a bad demonstration is an error, as in extra_rows_file
            else ["--max_rows", str(args.max_rows), *(["--extra_rows_file", args.rows] if args.rows else [])])
    sft_argv = ["--config", "configs/smollm2/sft.yaml", "--output_dir", str(run / "sft_work"), "--overwrite_output",
                "true", "--num_train_epochs", str(args.epochs), *data]
    if args.reuse:  # the run's own record of what it ran: a reused run must be the run these arguments describe
        ran = json.loads((run / "run.json").read_text())
        if ran["sft_argv"] != sft_argv or ran["evaluation"] != settings:
            sys.exit(f"{run}/run.json: that run was made with other arguments ({ran['sft_argv']}); run it again")
    else:
        start = time.perf_counter()
        trainer = sft_main(sft_argv)
        (run / "losses.jsonl").write_text("".join(json.dumps({"epoch": h["epoch"], "loss": h["loss"]}) + "\n"
                                                  for h in trainer.state.log_history if "loss" in h))
        ship_adapter(run / "sft_work", run / "sft_adapter", "smollm2", dtype=torch.float16)
        ran = {"sft_argv": sft_argv, "evaluation": settings, "sft_steps": trainer.state.global_step,
               "sft_rows": len(trainer.train_dataset), "sft_s": round(time.perf_counter() - start, 1)}
        # judged exactly as eval_fp32_smollm2.py judged the shipped SFT model (its `evaluate`)
        _, _, seconds = evaluate(str(run / "sft_adapter"), settings, run / "fp32_eval")
        ran.update(eval_s=round(seconds, 1),
                   measured_on=measured_on(),
                   machine=machine())
        (run / "run.json").write_text(json.dumps(ran, indent=2) + "\n")
    before = [json.loads(line) for line in open(SFT_RECORD / "eval_samples.jsonl")]
    after = [json.loads(line) for line in open(run / "fp32_eval" / "eval_samples.jsonl")]
    # the settings match by construction (the shipped model's record); the requests must too
    if [(s["question"], s["kind"]) for s in before] != [(s["question"], s["kind"]) for s in after]:
        sys.exit("the answers do not pair with the shipped SFT model's: other requests, or in another order")
    losses = [json.loads(line) for line in open(run / "losses.jsonl")]  # trl's log every logging_steps
    command = (f"python tools/experiments/smollm2_refusal_sft/refusal_sft_smollm2.py --label {args.label}"
               f" --rows '{args.rows}' --epochs {args.epochs}"
               + (" --only_rows" if args.only_rows else f" --max_rows {args.max_rows}"))
    record = {"label": args.label, "rows": args.rows,
              "rows_sha256": hashlib.sha256(pathlib.Path(args.rows).read_bytes()).hexdigest() if args.rows else None,
              "epochs": args.epochs, "max_rows": 0 if args.only_rows else args.max_rows, "only_rows": args.only_rows,
              "evaluation": {**settings, "sft_model_path": str(run.relative_to(ROOT) / "sft_adapter")},
              "compared_with": str(SFT_RECORD.relative_to(ROOT)),
              "changes_points": paired_changes(before, after), "sft_losses": losses,
              **{k: v for k, v in ran.items() if k not in ("sft_argv", "evaluation")},
              "sft_argv": [a.replace(f"{ROOT}/", "") for a in ran["sft_argv"]],  # repo-relative
              "command": command + (f" --against {args.against}" if args.against else "")}
    if args.against:
        other = [json.loads(line) for line in open(OUT / args.against / "eval_samples.jsonl")]
        record["changes_against"] = {"run": args.against, "changes_points": paired_changes(other, after)}
    out = OUT / args.label
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_samples.jsonl").write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in after))
    (out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["changes_points"], indent=2))


if __name__ == "__main__":
    main()
