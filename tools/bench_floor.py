"""The floor of a PPO step on `compare_trl.py`'s work: what the model passes that no engine can skip cost alone.

    python tools/bench_floor.py [--steps 10] [--skip 2] [--compare benchmarks/speed_vs_trl.json] \
        [--out benchmarks/step_floor.json]
    python tools/bench_floor.py --work smollm2 [--steps 10] [--skip 2] [--out benchmarks/step_floor_smollm2.json]

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

`--work smollm2` times the same passes for `configs/smollm2/ma_ppo.yaml`'s MA-PPO step (`smollm2_floor_steps`:
which passes, and why that is a reference rather than a strict floor for this engine); `tools/speed_targets.py
--smollm2-floor` runs it in rounds beside the engine at 7b49006 and the shipped config.
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
SMOLLM2_CONFIG = "configs/smollm2/ma_ppo.yaml"

TARGETS = {"full": 1.2, "lora": 1.5}  # issue 15: trl's step ÷ ours, on the shared-value-head cases


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def minibatch_updates(model, value_head, optim, ids, mask, R: int, mini_batch_size: int, max_grad_norm,
                      contiguous: bool = False) -> None:
    """One PPO epoch's updates without PPO's arithmetic: per shuffled minibatch, a forward with the graph (the response
    logits and a value head on the hidden states), a stand-in loss, the backward, clipping at `max_grad_norm` (as
    the configs clip, and compare_trl.py has trl clip the same) and the optimizer's step. `contiguous` copies the
    response positions together before the LM head (the engine's `head_logits`)."""
    import torch

    from marlhf_edu.math.logprobs import logprobs_from_logits
    from marlhf_edu.math.scoring import position_ids_from_mask
    from marlhf_edu.ppo.backends import head_logits, split_causal_lm

    backbone, lm_head = split_causal_lm(model)
    for rows in torch.randperm(ids.shape[0]).split(mini_batch_size):
        hidden = backbone(input_ids=ids[rows], attention_mask=mask[rows],
                          position_ids=position_ids_from_mask(mask[rows]), use_cache=False).last_hidden_state
        response = hidden[:, -R - 1:-1]
        logits = head_logits(lm_head, hidden, R) if contiguous else lm_head(response)
        logprobs = logprobs_from_logits(logits, ids[rows, -R:])
        values = value_head(response).squeeze(-1)
        loss = -(logprobs * mask[rows, -R:]).mean() + 0.1 * values.pow(2).mean()
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for g in optim.param_groups for p in g["params"]], max_grad_norm)
        optim.step()
        optim.zero_grad(set_to_none=True)


def sample_batch(sampler, tokenizer, prompts: list[str], config, draw: str = "multinomial"):
    """`(ids, mask, R, shape, seconds)`: the prompts left-padded and sampled at the config's temperature, the
    (B, P + R) attention mask with every token after a row's EOS masked, and `shape`: the prompt width P, the
    prompts' tokens, the answer width R and the answer tokens (EOS included).

    `draw` "multinomial": transformers' own sampling (trl's way); "inverse_cdf": the engine's draw
    (`PPOConfig.token_draw`: `SampledLogprobs` draws each token from log softmax(z / T), `generate` runs greedy)."""
    import torch
    from transformers import LogitsProcessorList

    from marlhf_edu.ppo.merged_rollout import SampledLogprobs
    from marlhf_edu.ppo.trainer import response_mask_from_ids

    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    mode = (dict(do_sample=False, logits_processor=LogitsProcessorList([SampledLogprobs(config.temperature,
                                                                                       draw=True)]))
            if draw == "inverse_cdf" else dict(do_sample=True, temperature=config.temperature, top_k=0, top_p=1.0))
    with torch.no_grad():
        ids, seconds = timed(lambda: sampler.generate(
            **enc, **mode, max_new_tokens=config.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id))
    P = enc["input_ids"].shape[1]
    keep = response_mask_from_ids(ids[:, P:], tokenizer.eos_token_id)
    mask = torch.cat([enc["attention_mask"].bool(), keep], 1).long()
    shape = {"prompt_width": P, "prompt_tokens": int(enc["attention_mask"].sum()), "answer_width": ids.shape[1] - P,
             "answer_tokens": int(keep.sum())}
    return ids, mask, ids.shape[1] - P, shape, seconds


def floor_steps(steps: int) -> tuple[list[dict], dict]:
    """Per step: seconds of generate, one no-grad forward, and the update of each kind (full, lora)."""
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.math.scoring import position_ids_from_mask
    from marlhf_edu.ppo import PPOConfig, PPOTrainer
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
        minibatch_updates(trained[kind], heads[kind], optims[kind], ids, mask, R, config.mini_batch_size,
                          config.max_grad_norm)

    records = []
    for step in range(steps):
        ids, mask, R, shape, generate_s = sample_batch(sampler, tokenizer, PPOTrainer.batch_prompts(view, step),
                                                       config)
        with torch.no_grad():
            _, forward_s = timed(lambda: sampler(input_ids=ids, attention_mask=mask,
                                                 position_ids=position_ids_from_mask(mask),
                                                 logits_to_keep=R + 1, use_cache=False).logits)
        record = {"generate": generate_s, "forward": forward_s, "generated_tokens": shape["answer_tokens"]}
        for kind in trained:
            _, record[f"update_{kind}"] = timed(lambda: update(kind, ids, mask, R))
        records.append(record)
    return records, {"config": CONFIG, "batch_size": config.batch_size, "mini_batch_size": config.mini_batch_size,
                     "max_new_tokens": config.max_new_tokens}


def smollm2_floor_steps(steps: int) -> tuple[list[dict], dict]:
    """The floor of `configs/smollm2/ma_ppo.yaml`'s MA-PPO step, per step: seconds of each pass it cannot skip.

    With `old_logprobs: sampler` the step needs: generate (from dense fp32 weights, as `merged_rollout` samples,
    drawing as the config's `token_draw` says), two no-grad forwards over the sampled batch (the reward model: the
    backbone and a head at the last token, a merged reward LoRA's cost; the reference: the backbone and the LM head
    at the R + 1 last positions) and the update: per minibatch of `mini_batch_size` rows, one forward with the graph
    through a rank-`actor_lora_r` LoRA on every linear layer of the dense base, the backward, clipping and AdamW.
    Bare transformers/peft calls on the SFT model the config names, merged and dense in fp32, with MKL's products
    (no NF4, no oneDNN, no statistics): what these passes cost with transformers' eager model over the padded batch
    on this machine. Not a strict lower bound for the engine, which packs its forwards (fewer padded positions) and
    can multiply by oneDNN."""
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.loading.sources import load_tokenizer, resolve_model
    from marlhf_edu.math.scoring import last_token_hidden, position_ids_from_mask
    from marlhf_edu.ppo import PPOConfig, PPOTrainer
    from marlhf_edu.training.args import parse_stage_args

    (config,) = parse_stage_args((PPOConfig,), ["--config", str(ROOT / SMOLLM2_CONFIG)])
    path = resolve_model(config.sft_model_path)
    tokenizer = load_tokenizer(path)
    view = SimpleNamespace(prompts=load_prompts(config, tokenizer), config=config)  # the trainer's prompt order
    torch.manual_seed(config.seed)
    sampler = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    policy = get_peft_model(copy.deepcopy(sampler), LoraConfig(
        r=config.actor_lora_r, lora_alpha=config.actor_lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=list(config.lora_target_modules))).eval()
    value_head = torch.nn.Linear(sampler.config.hidden_size, 1)
    reward_head = torch.nn.Linear(sampler.config.hidden_size, 1)
    optim = torch.optim.AdamW([p for p in [*policy.parameters(), *value_head.parameters()] if p.requires_grad],
                              lr=config.learning_rate)

    records = []
    for step in range(steps):
        ids, mask, R, shape, generate_s = sample_batch(sampler, tokenizer, PPOTrainer.batch_prompts(view, step),
                                                       config, draw=config.token_draw)
        with torch.no_grad():
            positions = position_ids_from_mask(mask)
            # the reward model's forward at a merged adapter's cost: the backbone, its head at each row's last token
            _, reward_s = timed(lambda: reward_head(last_token_hidden(sampler, ids, mask)))
            _, reference_s = timed(lambda: sampler(input_ids=ids, attention_mask=mask, position_ids=positions,
                                                   logits_to_keep=R + 1, use_cache=False).logits)
        record = {"generate": generate_s, "reward_forward": reward_s, "reference_forward": reference_s,
                  "generated_tokens": shape["answer_tokens"], **shape}
        _, record["update_lora"] = timed(lambda: minibatch_updates(
            policy, value_head, optim, ids, mask, R, config.mini_batch_size, config.max_grad_norm, contiguous=True))
        records.append(record)
    return records, {"config": SMOLLM2_CONFIG, "batch_size": config.batch_size,
                     "mini_batch_size": config.mini_batch_size, "max_new_tokens": config.max_new_tokens}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--compare", type=pathlib.Path, default=None, help="compare_trl.py's output, same machine")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="default benchmarks/step_floor.json (tiny), benchmarks/step_floor_smollm2.json (smollm2)")
    parser.add_argument("--work", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny: compare_trl.py's work; smollm2: configs/smollm2/ma_ppo.yaml's MA-PPO step")
    args = parser.parse_args(argv)
    if args.work == "smollm2":
        if args.compare:
            parser.error("--compare reads compare_trl.py's output: the tiny work only")
        return smollm2_main(args)
    args.out = args.out or ROOT / "benchmarks" / "step_floor.json"

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


def smollm2_main(args) -> dict:
    """`--work smollm2`: the floor of the SmolLM2 MA-PPO step (`smollm2_floor_steps`), written to `args.out`."""
    records, shape = smollm2_floor_steps(args.steps)
    kept = records[args.skip:] or records
    phases = {k: round(sum(r[k] for r in kept) / len(kept), 4)
              for k in ("generate", "reward_forward", "reference_forward", "update_lora")}
    summary = {"what": "seconds per MA-PPO step of configs/smollm2/ma_ppo.yaml that its model passes alone take over "
                       "the padded batch (generate from dense fp32 weights with the config's token draw + the reward "
                       "and reference no-grad forwards + the LoRA update), bare transformers/peft calls on the merged "
                       f"SFT model, MKL's products, mean of steps {args.skip + 1}-{args.steps}",
               **shape, "phases_s": phases, "floor_step_s": round(sum(phases.values()), 4),
               "generate_tokens_per_s": round(sum(r["generated_tokens"] for r in kept) / sum(r["generate"] for r in kept), 1),
               "per_step": records, "measured_on": measured_on(), "machine": machine()}
    print(json.dumps({k: v for k, v in summary.items() if k != "per_step"}, indent=1))
    write_result(args.out or ROOT / "benchmarks" / "step_floor_smollm2.json", summary)
    return summary


if __name__ == "__main__":
    main()
