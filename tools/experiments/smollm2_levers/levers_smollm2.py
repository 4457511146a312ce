"""What fused kernels (torch.compile) or a bf16 model could still cut from the SmolLM2 MA-PPO step on this CPU.

    python tools/experiments/smollm2_levers/levers_smollm2.py [--rounds 3] [--out benchmarks/smollm2_levers_<cpu>.json]

First the shipped step itself, in a fresh process (`tools/bench_step.py --command ma-ppo --config
configs/smollm2/ma_ppo.yaml --steps 3 --skip 1`: the mean of steps 2 and 3), for its phases on this machine. Then,
on the shipped SFT policy as one dense fp32 model (`load_sft_model`: SmolLM2-135M-Instruct with the SFT adapter
merged; the engine samples from the same weights dequantized from NF4 and multiplies them with oneDNN, this script
with torch's default `F.linear`) and on 16 training red-team requests of the config's dataset in its chat template
(first turns only, so shorter than the engine's prompts of up to 64 tokens), a stand-in for each of the three
kinds of pass a step is made of, eager in fp32 against a lever, in turn in every round:

    sample    `generate`, 16 answers of exactly 48 new tokens at T = 0.7 (no EOS token, so every row runs to 48
              and every case does the same work), each token drawn and its log-prob and entropy recorded as the
              engine's sampler does (`SampledLogprobs`, the inverse-CDF draw): fp32 with transformers' dynamic
              cache; fp32 with a static cache, eager (the control for the next); fp32 with a static cache and the
              decoder stack compiled; the model cast to bf16 (weights, activations and the LM head's output; the
              RoPE frequencies kept in fp32, as transformers computes the angles)
    forward   one no-grad forward over the 16 sampled rows (prompt + answer), the answers' log-probs at T = 0.7
              with the engine's position ids and LM head on the answer positions only (`head_logits`): the step's
              reference pass (the reward model's is the same size): fp32; fp32 compiled; the model cast to bf16
    update    a LoRA (r = 16, alpha 32, every projection, as the config) forward and backward over 8 of the rows
              with a stand-in loss (minus the answers' mean log-prob), and AdamW: one of the step's two
              minibatches: fp32; fp32 compiled for fixed shapes; fp32 compiled for dynamic shapes

"Compiled" compiles the decoder stack (`torch.compile`, inductor: the elementwise work around the products fused;
the LM head, the draw and the loss stay eager), with Dynamo's recompile limit raised so that no case falls back
to eager unseen; the record keeps Dynamo's graph and graph-break counts. The compiles run in the order above in one
inductor cache folder, empty at the start (a fresh temporary one unless `--inductor-cache` names one); their
seconds are reported apart. Each compiled update is then called on the other 8 rows cut 8 tokens shorter, timing
what a minibatch of another shape costs. Every case runs once more, untimed, before the rounds.

What a bf16 model costs in precision, on the same rows, each answer up to its first EOS: the answers' per-token
log-probs (T = 0.7) of the model cast to bf16 against fp32 (what a bf16 reference pass would add to k1 at a step
where the policy still equals the reference), and the shipped reward model's scores of the 16 (prompt, answer,
EOS appended where the answer drew none, read at the last token as the engine reads them) cast to bf16 against
fp32, next to the spread of the fp32 scores. About 16 minutes on 2 cores (Intel Xeon), about half of it compiling the
update for dynamic shapes. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tools/experiments/<experiment>/<script>.py
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from marlhf_edu.records import cpu_kind, machine, measured_on  # noqa: E402

CONFIG = "configs/smollm2/ma_ppo.yaml"
ROWS, NEW_TOKENS, MAX_PROMPT, TEMPERATURE, MINIBATCH = 16, 48, 64, 0.7, 8
SFT, REWARD = "zoo/smollm2_sft_adapter", "zoo/smollm2_reward_adapter"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def shipped_step() -> dict:
    """The shipped config's step on this machine: tools/bench_step.py in a fresh process, its JSON summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "step.json"
        command = [sys.executable, "tools/bench_step.py", "--command", "ma-ppo", "--config", CONFIG,
                   "--steps", "3", "--skip", "1", "--out", str(out)]
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench_step.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
        record = json.loads(out.read_text())
    keep = ("steps_averaged", "step_s", "phases_s", "generate_tokens_per_s", "response_length", "measured_on")
    return {"command": "python tools/bench_step.py --command ma-ppo --config " + CONFIG + " --steps 3 --skip 1",
            **{k: record[k] for k in keep}}


def prompts(tokenizer) -> dict:
    """16 training red-team requests of the config's dataset in the chat template, left-padded (at most 64 tokens)."""
    from marlhf_edu.data.keyword_judge import red_team_requests, template_for

    template = template_for(tokenizer, None)
    rendered = [template.dialogue([(r, None)]) for r in red_team_requests("train")]
    fits = [t for t in rendered if len(tokenizer(t)["input_ids"]) <= MAX_PROMPT][:ROWS]
    return tokenizer(fits, return_tensors="pt", padding=True, padding_side="left")


def sampler(model, enc, tokenizer, cache: str | None = None):
    """`generate` as the engine's sampler runs it (`backends.sample` with `token_draw: inverse_cdf` and the
    sampler's log-probs and entropy recorded), with no EOS token, so that every row takes exactly 48 new tokens and
    no step's scores are masked (the rows run on past an EOS they draw; `response_mask_from_ids` drops those tokens)."""
    from transformers import LogitsProcessorList

    from marlhf_edu.ppo.merged_rollout import SampledLogprobs

    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=None, pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=NEW_TOKENS,
                  cache_implementation=cache)

    def run():
        torch.manual_seed(0)
        recorder = SampledLogprobs(TEMPERATURE, entropy=True, draw=True)
        with torch.no_grad():
            ids = model.generate(**enc, generation_config=config, logits_processor=LogitsProcessorList([recorder]))
        recorder.finish(ids)
        return ids
    return run


def cast_bf16(model):
    """A copy of `model` in bf16 (weights, activations, the LM head's output), RoPE's frequencies kept in fp32:
    a bf16 model as transformers runs one, which computes the rotary angles in fp32 from fp32 frequencies."""
    out = copy.deepcopy(model).to(torch.bfloat16)
    fp32 = dict(model.named_buffers())
    for name, _ in list(out.named_buffers()):
        if name.endswith("inv_freq"):
            module, _, attr = name.rpartition(".")
            setattr(out.get_submodule(module), attr, fp32[name].clone())
    return out


def trunk(model):
    """The decoder stack (`LlamaModel`) of a causal LM, under a peft wrapper or not: what the engine runs before
    it applies the LM head to the answer positions only."""
    return model.base_model.model.model if hasattr(model, "peft_config") else model.model


def answer_logprobs(model, ids, mask, n_answer: int):
    """(B, R) fp32 log-probs at T = 0.7 of the last `n_answer` tokens of each row, as the engine's policy computes
    them (`multi_adapter`: the decoder stack with position ids from the mask, the LM head on the R positions made
    contiguous, the logits in fp32 divided by T)."""
    from marlhf_edu.math.scoring import position_ids_from_mask
    from marlhf_edu.ppo.backends import head_logits, response_logprobs

    hidden = trunk(model)(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                          use_cache=False).last_hidden_state
    logits = head_logits(model.get_output_embeddings(), hidden, n_answer).float().div_(TEMPERATURE)
    return response_logprobs(logits, ids)[0]


def forward(model, ids, mask, n_answer: int):
    """The step's no-grad pass over the rows (the reference's; the reward model's is the same size)."""
    def run():
        with torch.no_grad():
            return answer_logprobs(model, ids, mask, n_answer)
    return run


def update(model, optim, ids, mask, n_answer: int):
    """One LoRA forward and backward of a stand-in loss (minus the answers' mean log-prob) and an optimizer step."""
    def run():
        (-answer_logprobs(model, ids, mask, n_answer).mean()).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return run


def compile_trunk(model, dynamic: bool = False):
    """`model` with its decoder stack's forward compiled by inductor, for fixed shapes (a graph per shape) or with
    `dynamic` (meant to serve other shapes too; in the record a second shape compiled a new graph)."""
    stack = trunk(model)
    stack.forward = torch.compile(stack.forward, dynamic=dynamic)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inductor-cache", type=pathlib.Path, default=None,
                        help="inductor's cache folder (default: a fresh temporary one, so every compile is timed cold)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="default benchmarks/smollm2_levers_<cpu kind>.json; an existing record is not overwritten")
    args = parser.parse_args(argv)
    kind = cpu_kind(pathlib.Path("/proc/cpuinfo").read_text())
    out = args.out or ROOT / "benchmarks" / f"smollm2_levers_{kind}.json"
    if out.exists():
        raise SystemExit(f"{out} exists: give another --out")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")

    from peft import LoraConfig, get_peft_model

    from torch._dynamo.utils import counters

    from marlhf_edu.loading.models import load_reward_model, load_sft_model
    from marlhf_edu.math.scoring import append_missing_eos, sequence_scores
    from marlhf_edu.ppo.config import PPOConfig
    from marlhf_edu.ppo.trainer import response_mask_from_ids

    cache = args.inductor_cache or pathlib.Path(tempfile.mkdtemp(prefix="levers_inductor_"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # read when inductor first compiles, below
    torch._dynamo.config.recompile_limit = 64  # past the limit (8) Dynamo runs a frame eagerly, with one logged warning
    print("the shipped step (bench_step.py, a fresh process) ...", flush=True)
    step = shipped_step()
    print(f"  {step['step_s']:.2f} s: {step['phases_s']}", flush=True)

    policy, tok = load_sft_model(SFT)
    enc = prompts(tok)
    P = enc["input_ids"].shape[1]
    bf16 = cast_bf16(policy)
    compiled = compile_trunk(copy.deepcopy(policy))

    ids = sampler(policy, enc, tok)()  # the rows every forward and update case reads
    mask = torch.cat([enc["attention_mask"], torch.ones(ROWS, NEW_TOKENS, dtype=torch.long)], 1)
    assert ids.shape == (ROWS, P + NEW_TOKENS), ids.shape

    targets = list(PPOConfig().lora_target_modules)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    learner = get_peft_model(copy.deepcopy(policy).train(), lora)
    learner_c = compile_trunk(get_peft_model(copy.deepcopy(policy).train(), lora))
    learner_d = compile_trunk(get_peft_model(copy.deepcopy(policy).train(), lora), dynamic=True)
    opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-6)
            for name, m in (("eager", learner), ("compiled", learner_c), ("dynamic", learner_d))}
    mb, mb_mask = ids[:MINIBATCH], mask[:MINIBATCH]

    cases = {
        "sample fp32 (dynamic cache)": sampler(policy, enc, tok),
        "sample fp32 (static cache)": sampler(policy, enc, tok, "static"),
        "sample fp32 compiled (static cache)": sampler(compiled, enc, tok, "static"),
        "sample bf16 (dynamic cache)": sampler(bf16, enc, tok),
        "forward fp32": forward(policy, ids, mask, NEW_TOKENS),
        "forward fp32 compiled": forward(compiled, ids, mask, NEW_TOKENS),
        "forward bf16": forward(bf16, ids, mask, NEW_TOKENS),
        "update fp32": update(learner, opts["eager"], mb, mb_mask, NEW_TOKENS),
        "update fp32 compiled": update(learner_c, opts["compiled"], mb, mb_mask, NEW_TOKENS),
        "update fp32 compiled dynamic": update(learner_d, opts["dynamic"], mb, mb_mask, NEW_TOKENS),
    }
    baseline = {name: ("sample fp32 (dynamic cache)" if name.startswith("sample") else
                       name.split(" ")[0] + " fp32") for name in cases}
    compile_s, dynamo = {}, {}

    def compile_case(name, fn):
        counters.clear()
        compile_s[name] = round(timed(fn)[1], 2)
        dynamo[name] = {"graphs": counters["stats"]["unique_graphs"],
                        "graph_breaks": sum(counters["graph_break"].values())}
        print(f"  {name}: {compile_s[name]} s, {dynamo[name]}", flush=True)

    print("compiling, in this order, in one inductor cache folder, empty at the start ...", flush=True)
    for name in [n for n in cases if "compiled" in n]:
        compile_case(name, cases[name])
    # the other 8 rows, 8 tokens shorter: what a minibatch of another shape costs each compiled update
    cut = P + NEW_TOKENS - 8
    for name, model, optim in (("update fp32 compiled", learner_c, opts["compiled"]),
                               ("update fp32 compiled dynamic", learner_d, opts["dynamic"])):
        # contiguous, as the first rows are: a strided input alone would recompile a graph compiled for shapes
        other = update(model, optim, ids[MINIBATCH:, :cut].contiguous(), mask[MINIBATCH:, :cut].contiguous(),
                       NEW_TOKENS - 8)
        compile_case(f"{name}, a second shape", other)
    for fn in cases.values():  # every case once, untimed: first-call costs (AdamW's state, caches) out of round 1
        fn()

    seconds = {name: [] for name in cases}
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            seconds[name].append(round(timed(cases[name])[1], 4))
        print(f"round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1]:.2f}" for n in cases), flush=True)
    median = {name: round(statistics.median(s), 4) for name, s in seconds.items()}
    ratios = {name: [round(a / b, 3) for a, b in zip(seconds[name], seconds[baseline[name]])] for name in cases}
    median_ratio = {name: statistics.median(r) for name, r in ratios.items()}

    # precision: the model cast to bf16 against fp32, on the same rows
    keep = response_mask_from_ids(ids[:, -NEW_TOKENS:], tok.eos_token_id)  # up to each answer's first EOS
    diff = (cases["forward bf16"]() - cases["forward fp32"]()) * keep
    k1 = (-diff).sum(1)  # an answer's Σ (log π_fp32 − log π_bf16): k1 against a bf16 reference, policy = reference
    reward32, rtok = load_reward_model(SFT, REWARD)
    reward16 = cast_bf16(reward32)
    # each answer up to its first EOS, with EOS appended where it drew none (`truncated_scoring: append_eos`),
    # scored as the engine scores: the head on the last real token's hidden state (`sequence_scores`)
    ended = (ids[:, -NEW_TOKENS:] == rtok.eos_token_id).any(1)
    scored, scored_mask = append_missing_eos(ids, torch.cat([mask[:, :-NEW_TOKENS], keep.long()], 1), ended,
                                             rtok.eos_token_id, rtok.pad_token_id)
    with torch.no_grad():
        s32 = sequence_scores(reward32, scored, scored_mask)
        s16 = sequence_scores(reward16, scored, scored_mask)
    precision = {
        "answer_tokens": int(keep.sum()),  # up to and including each answer's first EOS
        "logprob_abs_diff_mean": round((diff.abs().sum() / keep.sum()).item(), 5),
        "logprob_abs_diff_max": round(diff.abs().max().item(), 4),
        "k1_per_answer_from_bf16_reference": {"mean": round(k1.mean().item(), 4), "sd": round(k1.std().item(), 4),
                                              "sd_of_a_16_answer_mean": round(k1.std().item() / ROWS ** 0.5, 4)},
        "reward_score_abs_diff_mean": round((s16 - s32).abs().mean().item(), 4),
        "reward_score_abs_diff_max": round((s16 - s32).abs().max().item(), 4),
        "reward_score_fp32_sd": round(s32.std().item(), 4),
    }

    phases = step["phases_s"]
    frozen = phases["reference"] + phases["score"]
    saved = {  # a lever's seconds a step: the phase it acts on times (1 − the median of its per-round ratios)
        "compiled sampler": phases["generate"] * (1 - median_ratio["sample fp32 compiled (static cache)"]),
        "compiled reference and score passes": frozen * (1 - median_ratio["forward fp32 compiled"]),
        "compiled update": phases["update"] * (1 - median_ratio["update fp32 compiled"]),
        "compiled update, dynamic shapes": phases["update"] * (1 - median_ratio["update fp32 compiled dynamic"]),
        "bf16 sampler": phases["generate"] * (1 - median_ratio["sample bf16 (dynamic cache)"]),
        # old_logprobs: sampler cannot take a bf16 sampler's numbers: one fp32 forward back (the reference's
        # seconds; the policy's own forward runs through its adapter and takes longer)
        "bf16 sampler, less a recompute forward": phases["generate"] * (1 - median_ratio["sample bf16 (dynamic cache)"])
        - phases["reference"],
        "bf16 reference and score passes": frozen * (1 - median_ratio["forward bf16"]),
    }
    record = {
        "what": __doc__.split("\n\n")[0],
        "command": f"python tools/experiments/smollm2_levers/levers_smollm2.py --rounds {args.rounds}",
        "measured_on": measured_on(), "machine": machine(), "cpu_kind": kind,
        "date": time.strftime("%Y-%m-%d"),
        "shape": {"rows": ROWS, "prompt_tokens_padded": P, "new_tokens": NEW_TOKENS, "minibatch_rows": MINIBATCH,
                  "temperature": TEMPERATURE, "lora": {"r": 16, "alpha": 32, "target_modules": targets}},
        "shipped_step": step,
        "seconds": seconds, "median_s": median,
        "ratio_to_fp32": {"per_round": ratios, "median": median_ratio, "against": baseline},
        "compile_s": compile_s, "dynamo": dynamo,
        "inductor_cache": ("given (--inductor-cache)" if args.inductor_cache else
                           "one fresh temporary folder, the compiles in the order of compile_s"),
        "precision_bf16": precision,
        "projected_seconds_saved_a_step": {k: round(v, 2) for k, v in saved.items()},
        "projection": "the shipped step's phase a lever acts on times (1 − the median of the lever's per-round "
                      "ratios), the other phases as they are; compile time not counted: arithmetic on stand-in "
                      "passes, not a measured engine step",
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("ratio_to_fp32", "compile_s", "dynamo", "precision_bf16",
                                             "projected_seconds_saved_a_step")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
