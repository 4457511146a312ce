"""The floor of a PPO step on `compare_trl.py`'s work: what the model passes that no engine can skip cost alone.

    python tools/bench_floor.py [--steps 10] [--skip 2] [--compare benchmarks/speed_vs_trl.json] \
        [--out benchmarks/step_floor.json]

A PPO step on `configs/tiny_ppo.yaml`'s shape (64 rollouts, mini-batch 16, 32 new tokens at T = 1, 1 PPO epoch)
must, whatever the engine:

    generate   sample the responses: a prefill of the prompts and one pass per new token, from dense weights
               (what trl does, and what `merged_rollout` does for a LoRA policy);
    3 forwards score the sequences with the reward model, and compute the old log-probs (and values) and the
               reference log-probs: three no-grad passes over the same (B, P + R) batch, each of a dense model
               the size of the policy (a merged reward model, as trl's; the reference; the policy);
    update     for each minibatch, one forward with the graph (response logits and a value head on the policy's
               hidden states), the backward, the gradient norm clipped at the config's max_grad_norm, and AdamW; either every weight trains (full) or a LoRA of r = 16
               on every linear layer does (lora: the backward still runs through every frozen layer).

This tool times exactly those, on the shipped tiny SFT model, with nothing else around them: bare transformers
and peft calls, no engine, no statistics, no checks. Their sum is a lower bound on the step of any engine that runs
these passes over the whole padded batch, as trl 0.11.4 does, on this machine; this engine's forwards skip the
columns their rows share as padding (`marlhf_edu.ppo.used_columns`), less work than the floor counts. With `--compare`, it reads trl 0.11.4's measured step from `compare_trl.py`'s output (run it just
before, on the same machine) and reports the largest speed-up over trl that the floor allows, next to the
target of issue 15. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import time

from marlhf_edu.records import machine, measured_on, write_result

ROOT = pathlib.Path(__file__).resolve().parent.parent

TARGETS = {"full": 1.2, "lora": 1.5}  # issue 15: trl's step ÷ ours, on the shared-value-head cases


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def floor_steps(steps: int) -> tuple[list[dict], dict]:
    """Per step: seconds of generate, one no-grad forward, and the update of each kind (full, lora)."""
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.math.logprobs import logprobs_from_logits
    from marlhf_edu.math.scoring import position_ids_from_mask
    from marlhf_edu.ppo import PPOConfig, PPOTrainer
    from marlhf_edu.ppo.backends import split_causal_lm
    from marlhf_edu.ppo.trainer import response_mask_from_ids
    from marlhf_edu.training.args import parse_stage_args

    from compare_trl import CONFIG, LORA_TARGETS

    (config,) = parse_stage_args((PPOConfig,), ["--config", str(ROOT / CONFIG)])
    tokenizer = load_tokenizer(SFT_DIR)
    view = SimpleNamespace(prompts=load_prompts(config, tokenizer), config=config)  # the trainer's prompt order
    torch.manual_seed(config.seed)
    sampler = AutoModelForCausalLM.from_pretrained(SFT_DIR).eval()
    trained = {"full": AutoModelForCausalLM.from_pretrained(SFT_DIR).eval()}
    trained["lora"] = get_peft_model(copy.deepcopy(sampler), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                                         task_type="CAUSAL_LM",
                                                                         target_modules=LORA_TARGETS)).eval()
    heads = {k: torch.nn.Linear(sampler.config.hidden_size, 1) for k in trained}
    optims = {k: torch.optim.AdamW([p for p in list(m.parameters()) + list(heads[k].parameters()) if p.requires_grad],
                                   lr=config.learning_rate) for k, m in trained.items()}

    def update(kind, ids, mask, R):
        model, head, optim = trained[kind], heads[kind], optims[kind]
        backbone, lm_head = split_causal_lm(model)
        for rows in torch.randperm(ids.shape[0]).split(config.mini_batch_size):
            hidden = backbone(input_ids=ids[rows], attention_mask=mask[rows],
                              position_ids=position_ids_from_mask(mask[rows]), use_cache=False).last_hidden_state
            logprobs = logprobs_from_logits(lm_head(hidden[:, -R - 1:-1]), ids[rows, -R:])
            values = head(hidden[:, -R - 1:-1]).squeeze(-1)
            loss = -(logprobs * mask[rows, -R:]).mean() + 0.1 * values.pow(2).mean()
            loss.backward()
            if config.max_grad_norm is not None:  # the config clips, and compare_trl.py has trl clip the same
                torch.nn.utils.clip_grad_norm_([p for g in optim.param_groups for p in g["params"]], config.max_grad_norm)
            optim.step()
            optim.zero_grad(set_to_none=True)

    records = []
    for step in range(steps):
        enc = tokenizer(PPOTrainer.batch_prompts(view, step), return_tensors="pt", padding=True, padding_side="left")
        P = enc["input_ids"].shape[1]
        with torch.no_grad():
            ids, generate_s = timed(lambda: sampler.generate(
                **enc, do_sample=True, temperature=config.temperature, top_k=0, top_p=1.0,
                max_new_tokens=config.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id))
            R = ids.shape[1] - P
            keep = response_mask_from_ids(ids[:, P:], tokenizer.eos_token_id)
            mask = torch.cat([enc["attention_mask"].bool(), keep], 1).long()
            _, forward_s = timed(lambda: sampler(input_ids=ids, attention_mask=mask,
                                                 position_ids=position_ids_from_mask(mask),
                                                 logits_to_keep=R + 1, use_cache=False).logits)
        record = {"generate": generate_s, "forward": forward_s, "generated_tokens": int(keep.sum())}
        for kind in trained:
            _, record[f"update_{kind}"] = timed(lambda: update(kind, ids, mask, R))
        records.append(record)
    return records, {"config": CONFIG, "batch_size": config.batch_size, "mini_batch_size": config.mini_batch_size,
                     "max_new_tokens": config.max_new_tokens}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--compare", type=pathlib.Path, default=None, help="compare_trl.py's output, same machine")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "step_floor.json")
    args = parser.parse_args(argv)

    records, shape = floor_steps(args.steps)
    kept = records[args.skip:] or records
    mean = lambda key: sum(r[key] for r in kept) / len(kept)  # noqa: E731
    phases = {k: round(mean(k), 4) for k in ("generate", "forward", "update_full", "update_lora")}
    floors = {kind: round(phases["generate"] + 3 * phases["forward"] + phases[f"update_{kind}"], 4)
              for kind in ("full", "lora")}
    summary = {"what": "seconds per PPO step that the unavoidable model passes alone take (generate + 3 no-grad "
                       "forwards + update), bare transformers/peft calls, mean of steps "
                       f"{args.skip + 1}-{args.steps}",
               **shape, "phases_s": phases, "floor_step_s": floors,
               "generate_tokens_per_s": round(sum(r["generated_tokens"] for r in kept) / sum(r["generate"] for r in kept), 1),
               "measured_on": measured_on(),
               "machine": machine()}
    if args.compare:
        compared = json.loads(args.compare.read_text())
        trl, best, measured = {}, {}, {}
        if "summary" in compared:  # `--repeats`: medians over the repeats, ours at its best setting by median ratio
            for s in compared["summary"]:
                case = s["case"]
                trl[case] = statistics.median(s["trl_step_s"])
                if s["median_trl_s_over_ours_s"] >= measured.get(case, 0.0):
                    best[case], measured[case] = statistics.median(s["ours_step_s"]), s["median_trl_s_over_ours_s"]
        else:
            trl = {r["case"]: r["trl"]["step_s"] for r in compared["results"]}
            best = {case: min(r["ours"]["step_s"] for r in compared["results"] if r["case"] == case) for case in trl}
            measured = {case: round(trl[case] / best[case], 3) for case in trl}
        summary["against_trl"] = {
            case: {"trl_step_s": trl[case], "floor_step_s": floors[case], "ours_best_step_s": best[case],
                   "largest_possible_trl_over_ours": round(trl[case] / floors[case], 3),
                   "measured_trl_over_ours": measured[case], "target": TARGETS[case],
                   "step_needed_for_target_s": round(trl[case] / TARGETS[case], 4)}
            for case in trl}
        summary["compared_with"] = str(args.compare.relative_to(ROOT) if args.compare.is_absolute() else args.compare)
    print(json.dumps(summary, indent=1))
    write_result(args.out, summary)
    return summary


if __name__ == "__main__":
    main()
