"""The check to run on a new GPU before spending hours on the 7B recipe (issue 34). Not part of `make test`.

    python tools/gpu_check.py ppo          # (a) 3 MA-PPO steps of configs/llama2_7b/ma_ppo.yaml at full shape,
                                           #     sampled through the adapter at micro-batch 1 (MA-RLHF's way)
    python tools/gpu_check.py ppo_merged   # (a) the same sampled from a merged copy (dynamic KV cache, no TIS)
    python tools/gpu_check.py sampling     # (b) the merged sampler against the training path; speed; micro-batch
    python tools/gpu_check.py stages       # (c) SFT, the merge, RM, MA-PPO at full shape, each in its own process
    python tools/gpu_check.py pipeline     # (d) the same stages in one process, as `marlhf-edu pipeline` runs them
    python tools/gpu_check.py ppo_fast     # (e) the fast launch preflight prints: merged copy, static KV cache,
                                           #     compiled decode, TIS, the micro-batch that fits; the 10 s target
    python tools/gpu_check.py ppo ppo_merged sampling stages pipeline --out my_gpu.json

Offline: the model is a random Llama with Llama-2-7B's full shape (32 layers, 4096 wide, 32,000 tokens), saved
in float16 as the real checkpoint is, with a random reward adapter of the recipe's shape (LoRA r = 32 on q/k/v/o
and a score head) and rows in PKU-SafeRLHF's schema written in its synthetic tokenizer's words; the stage configs
are the recipe's own (`configs/llama2_7b/*.yaml`), only paths, data and step counts changed. What a random model
says means nothing; its memory, time and dtypes are those of the real one, while its numerics are likely more
sensitive (near-uniform outputs, 32 random layers). Each part takes under 10 minutes on one 80 GB GPU (the model is
built once per --work folder) and adds its section to `--out` (default benchmarks/gpu_check.json, the book's
record; a record from another machine is started afresh, not merged), each measurement next to its pass line:

(a) `ppo` (and `ppo_merged`, sampling from a dense merged copy): peak allocated memory within 15 % of the
    planner's peak; what the device has in use as the driver sees it and how much of it is outside PyTorch's
    allocator (CUDA context, library handles); each phase's working set (generate, score, policy, reference,
    update: allocated at its start and its peak); the residual stream (embeddings, norms, LM head, a decoder
    layer's output) in bf16; the first minibatch's ratio within 1e-2 of 1 and its approxkl; the share of policy
    LoRA gradient entries that are exactly zero; seconds per phase; sampled tokens/s. Run under
    `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` to measure what the launch lines run.
(b) `sampling`: after a LoRA perturbation (RMS of s·B·A = 1e-4 per weight), the log-prob gap
    |log π_sampler − log π_train| per response token and the KL per response for a bf16 and an fp32 merged copy,
    each computed in the same rows per forward as the rollout's old log-probs, the update's error in each copy's
    weights, and the regression slope of the copy's shift from the reference on the policy's (1 = it moved as
    the policy did; noise in either biases it below 1); the gap between the rollout's old log-probs and the
    update's; merged vs adapter tokens/s; one update at micro-batch 1 and 4 (seconds, peak).
(c) `stages`: each stage in its own process through `marlhf-edu pipeline --stages NAME` (the SFT adapter merged
    once in its own process first), then `marlhf-edu evaluate` and `marlhf-edu merge` on the trained policy:
    per-stage peak GPU memory, what each process holds outside the allocator, seconds, peak host RAM, the
    dtypes of the SFT and RM adapters as saved, the merge's seconds, RAM and disk, and the run's disk
    (`--stages` runs some of them).
(d) `pipeline`: the same stages in one process: GPU memory still allocated when each stage starts.
(e) `ppo_fast`: (a)'s measurements for the fast launch `marlhf-edu preflight` prints when it fits (merged copy,
    `rollout_cache: static`, `tis_cap: 2`, the largest micro-batch that fits the GPU); per step the sampler's
    log-prob gap and mean TIS weight; the compiled decode step's log-probs against an eager forward of the same
    copy on the same tokens; the median step after the first (the first compiles) against 10 s.

`--reduced` runs the same code on a tiny model of the same family (2 layers, width 128) so that the test suite
runs all four parts on CPU (tests/test_gpu_check.py); its numbers check the tool, not a GPU. Documented in
chapter 15 and site/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import replace

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REDUCED = dict(name="llama-2-7b family, reduced", vocab_size=2048, hidden_size=128, intermediate_size=344,
               num_layers=2, num_heads=4)
#: the pass lines (issue 34)
PEAK_TOLERANCE = 0.15
RATIO_TOLERANCE = 1e-2
PERTURBATION_RMS = 1e-4


def gib(n):
    return None if n is None else round(n / 2**30, 3)


def shape_for(args):
    from marlhf_edu.memory.plan import LLAMA_2_7B

    return replace(LLAMA_2_7B, **REDUCED) if args.reduced else LLAMA_2_7B


def cuda(device: str) -> bool:
    import torch

    return device.startswith("cuda") and torch.cuda.is_available()


def sync(device):
    import torch

    if cuda(device):
        torch.cuda.synchronize()


def reset_peak(device):
    import torch

    if cuda(device):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def memory(device) -> dict:
    """PyTorch's allocator now and at its peak, and the device as the driver sees it: `device_used_gib` (total −
    free, every process) and `outside_allocator_gib`, what this process holds outside PyTorch's cache (the CUDA
    context, library handles and workspaces that do not come from the cache), used minus reserved now."""
    import torch

    if not cuda(device):
        return {"allocated_gib": None, "max_allocated_gib": None, "max_reserved_gib": None, "device_used_gib": None,
                "outside_allocator_gib": None}
    free_bytes, total = torch.cuda.mem_get_info()
    used = total - free_bytes
    return {"allocated_gib": gib(torch.cuda.memory_allocated()), "max_allocated_gib": gib(torch.cuda.max_memory_allocated()),
            "max_reserved_gib": gib(torch.cuda.max_memory_reserved()), "device_used_gib": gib(used),
            "outside_allocator_gib": gib(used - torch.cuda.memory_reserved())}


class PhasePeaks:
    """Wraps a trainer's `PhaseTimer`: for each phase (generate, score, policy, reference, update) the GPU memory
    allocated when it starts and the peak inside it, the largest over the steps; the peak outside phases is kept
    too, so `overall()` is the run's peak although each phase resets PyTorch's counters. No-op off CUDA."""

    def __init__(self, timer, device):
        self.timer, self.on = timer, cuda(device)
        self.phases: dict = {}
        self.allocated_peak = self.reserved_peak = 0

    def __getattr__(self, name):  # seconds, sync: the timer's own
        return getattr(self.timer, name)

    def _fold(self):
        import torch

        self.allocated_peak = max(self.allocated_peak, torch.cuda.max_memory_allocated())
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved())

    def __call__(self, phase):
        import contextlib

        import torch

        @contextlib.contextmanager
        def timed():
            if not self.on:
                with self.timer(phase):
                    yield
                return
            torch.cuda.synchronize()
            self._fold()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            with self.timer(phase):
                yield
            torch.cuda.synchronize()
            peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            self._fold()
            row = self.phases.setdefault(phase, {"allocated_at_start_gib": 0.0, "max_allocated_gib": 0.0,
                                                 "above_start_gib": 0.0, "max_reserved_gib": 0.0})
            for key, value in (("allocated_at_start_gib", start), ("max_allocated_gib", peak),
                               ("above_start_gib", peak - start), ("max_reserved_gib", reserved)):
                row[key] = max(row[key], gib(value))
        return timed()

    def overall(self) -> dict:
        if not self.on:
            return {}
        import torch

        torch.cuda.synchronize()
        self._fold()
        return {"max_allocated_gib": gib(self.allocated_peak), "max_reserved_gib": gib(self.reserved_peak)}


# ---- the model, the reward adapter and the data -----------------------------------------------------------------

def build(args) -> dict:
    """A random model of the shape, saved in float16 like Llama-2-7b-hf, its tokenizer, a random reward adapter
    (LoRA r = 32 on q/k/v/o + score head, SEQ_CLS) and PKU-SafeRLHF-schema rows; reused when already in --work."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, LlamaForCausalLM

    from marlhf_edu.memory.check import random_llama_config, synthetic_tokenizer
    from marlhf_edu.training.smoke import pku_schema_rows

    work = pathlib.Path(args.work)
    paths = {"model": work / "model", "reward": work / "reward", "data": work / "pku_saferlhf.jsonl"}
    done = work / "built.json"
    if done.exists():
        return {**paths, **json.loads(done.read_text())}
    shape = shape_for(args)
    start = time.perf_counter()
    tokenizer = synthetic_tokenizer(shape.vocab_size)
    config = random_llama_config(shape, tokenizer)
    torch.manual_seed(0)
    # initialised on the GPU when there is one (a 7B random init on CPU takes minutes), saved in float16
    with torch.device("cuda" if cuda(args.device) else "cpu"):
        model = LlamaForCausalLM(config)
    model.to(torch.float16).save_pretrained(str(paths["model"]))
    tokenizer.save_pretrained(str(paths["model"]))
    del model
    if cuda(args.device):
        torch.cuda.empty_cache()
    # the reward adapter: built on a meta-device model (no 13 GB copy), its trainable tensors made real
    with torch.device("meta"):
        seq = AutoModelForSequenceClassification.from_config(replace_config(config, num_labels=1), dtype=torch.float16)
    peft = get_peft_model(seq, LoraConfig(task_type="SEQ_CLS", r=32, lora_alpha=8, lora_dropout=0.0,
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft.named_parameters():
        if param.requires_grad:
            fan_in = param.shape[-1]
            owner, attr = name.rsplit(".", 1)
            module = peft.get_submodule(owner)
            value = torch.randn(param.shape, generator=gen, dtype=torch.float32) / fan_in**0.5
            if ".lora_B." in name:
                value = value * 0.1
            module._parameters[attr] = torch.nn.Parameter(value, requires_grad=True)
    peft.peft_config["default"].base_model_name_or_path = str(paths["model"])
    peft.save_pretrained(str(paths["reward"]))
    # rows in PKU-SafeRLHF's schema: prompts of 20-50 words, answers of 100-240 (the recipe's 64 + 256 tokens)
    lengths = dict(prompt_words=(5, 15), answer_words=(10, 40)) if args.reduced else dict(prompt_words=(20, 50),
                                                                                         answer_words=(100, 240))
    rows = pku_schema_rows(args.rows, vocab_size=shape.vocab_size, **lengths)
    paths["data"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"build_s": round(time.perf_counter() - start, 1), "shape": vars(shape),
            "checkpoint_dtype": json.loads((paths["model"] / "config.json").read_text()).get("dtype")
            or json.loads((paths["model"] / "config.json").read_text()).get("torch_dtype")}
    done.write_text(json.dumps(meta))
    return {**paths, **meta}


def replace_config(config, **changes):
    import copy

    config = copy.deepcopy(config)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


def ppo_config(args, built, name: str, extra=()):
    """configs/llama2_7b/ma_ppo.yaml with the check's paths, data and steps (and `--reduced` lengths)."""
    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.training.args import parse_stage_args

    argv = ["--config", str(ROOT / "configs/llama2_7b/ma_ppo.yaml"), "--sft_model_path", str(built["model"]),
            "--reward_adapter_path", str(built["reward"]), "--dataset_name", str(built["data"]),
            "--output_dir", str(pathlib.Path(args.work) / name), "--device", args.device, "--save_steps", "1000"]
    if args.reduced:
        argv += ["--batch_size", "4", "--mini_batch_size", "2", "--forward_batch_size", "4", "--max_new_tokens", "8"]
    (config,) = parse_stage_args((PPOConfig,), argv + list(extra))
    return config


def new_trainer(config):
    import torch

    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.ppo import PPOTrainer
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
    from marlhf_edu.teaching.book import quietly

    torch.manual_seed(config.seed)
    with quietly():
        backend = MultiAdapterBackend.from_config(config)
    return PPOTrainer(backend, config, load_prompts(config, backend.tokenizer))


# ---- (a) three MA-PPO steps ------------------------------------------------------------------------------------

def part_ppo(args, built, merged_rollout: bool = False, fast: bool = False) -> dict:
    import torch

    from marlhf_edu.memory.check import plan_for
    from marlhf_edu.stages.preflight import FAST_SAMPLER

    shape = shape_for(args)
    name = "ppo_fast" if fast else "ppo_merged" if merged_rollout else "ppo"
    extra = ["--total_steps", str(args.steps)]
    micro = None
    FAST = list(FAST_SAMPLER)
    if fast:  # the fast launch preflight prints: the fast sampler, at the micro-batch that fits this device
        micro = planned_micro_batch(args, built, ppo_config(args, built, name, extra + FAST))
        extra += FAST + ["--micro_batch_size", str(micro)]
    else:  # the config's micro-batch of 1 (MA-RLHF's), sampling through the adapter or from a plain merged copy
        extra += MERGED if merged_rollout else ADAPTER
    config = ppo_config(args, built, name, extra)
    reset_peak(args.device)
    start = time.perf_counter()
    trainer = new_trainer(config)
    sync(args.device)
    load_s = time.perf_counter() - start
    loaded = memory(args.device)
    trainer.timer = PhasePeaks(trainer.timer, args.device)
    base = trainer.backend.model.get_base_model()
    seen = {}

    def record_dtype(module, inputs, output):  # returns None: the output is left as it is
        seen.setdefault("layer_output", str((output[0] if isinstance(output, tuple) else output).dtype))

    hook = base.model.layers[0].register_forward_hook(record_dtype)
    named = dict(trainer.backend.model.named_parameters())
    # lora_A's gradient is exactly 0 while lora_B is still all zeros (peft's init): counted apart from lora_B's
    kinds = {id(p): ("lora_A" if ".lora_A." in n else "lora_B") for n, p in named.items()
             if id(p) in {id(q) for q in trainer.backend.parameter_groups()["policy"]}}
    zero_shares = []
    real_step = trainer.optimizer.step

    def counting_step(*a, **k):
        zeros, total = {"lora_A": 0, "lora_B": 0}, {"lora_A": 0, "lora_B": 0}
        for group in trainer.optimizer.param_groups:
            for p in group["params"]:
                if id(p) in kinds and p.grad is not None:
                    zeros[kinds[id(p)]] += int((p.grad == 0).sum())
                    total[kinds[id(p)]] += p.grad.numel()
        zero_shares.append({k: round(zeros[k] / max(total[k], 1), 6) for k in zeros})
        return real_step(*a, **k)

    trainer.optimizer.step = counting_step
    records, first = [], None
    for _ in range(config.total_steps):
        records.append(trainer.step())
        if first is None:
            first = dict(trainer.minibatch_stats[0])
    hook.remove()
    peak = {**memory(args.device), **trainer.timer.overall()}
    plan = plan_for(trainer, shape, built["reward"])
    dtypes = {"checkpoint": built.get("checkpoint_dtype"), "embed_tokens": str(base.model.embed_tokens.weight.dtype),
              "final_norm": str(base.model.norm.weight.dtype), "lm_head": str(base.lm_head.weight.dtype),
              "decoder_layer_output": seen.get("layer_output"),
              "trainable": sorted({str(p.dtype) for g in trainer.optimizer.param_groups for p in g["params"]})}
    phases = {k: [round(r[k], 2) for r in records] for k in records[0] if k.startswith("time/")}
    out = {"config": "configs/llama2_7b/ma_ppo.yaml", "merged_rollout": config.merged_rollout,
           "rollout_cache": config.rollout_cache, "steps": config.total_steps,
           "load_s": round(load_s, 1), "memory_after_load": loaded, "memory_peak": peak,
           "phase_memory": trainer.timer.phases,
           "planned": {"model_state_gib": gib(plan.model_state), "peak_gib": gib(plan.peak),
                       "parts_gib": {k: gib(v) for k, v in plan.parts.items()}},
           "dtypes": dtypes, "first_minibatch": {k: first[k] for k in first if k.startswith("policy/")},
           "policy_lora_grad_zero_share": zero_shares, "seconds": phases,
           "response_length": [r["response/length"] for r in records],
           "kl_k1": [round(r["kl/k1"], 4) for r in records]}
    checks = {"residual stream in bf16": all(dtypes[k] == "torch.bfloat16" for k in
                                              ("embed_tokens", "final_norm", "lm_head", "decoder_layer_output"))
              if cuda(args.device) else None,
              "trainables in fp32": dtypes["trainable"] == ["torch.float32"],
              "first ratio within 1e-2 of 1": abs(first["policy/ratio_mean"] - 1) <= RATIO_TOLERANCE
              and abs(first["policy/ratio_max"] - 1) <= 10 * RATIO_TOLERANCE}
    if peak["max_allocated_gib"] is not None:
        checks[f"peak allocated within {PEAK_TOLERANCE:.0%} of plan"] = (
            abs(peak["max_allocated_gib"] - out["planned"]["peak_gib"]) <= PEAK_TOLERANCE * out["planned"]["peak_gib"])
    if fast:
        steps = out["seconds"]["time/step_s"]
        later = sorted(steps[1:]) or steps
        out["overrides"] = FAST + ["--micro_batch_size", str(micro)]
        out["micro_batch_size"] = micro
        out["median_step_after_first_s"] = later[len(later) // 2] if len(later) % 2 else (
            (later[len(later) // 2 - 1] + later[len(later) // 2]) / 2)
        out["logprob_gap"] = [round(r.get("rollout/logprob_gap", float("nan")), 4) for r in records]
        out["tis_weight_mean"] = [round(r.get("rollout/tis_weight_mean", float("nan")), 4) for r in records]
        out["compiled_vs_eager"] = compiled_vs_eager(trainer, args)
        checks[f"step <= {STEP_TARGET_S:.0f} s (median after the first)"] = (
            out["median_step_after_first_s"] <= STEP_TARGET_S if cuda(args.device) else None)
    out["checks"] = checks
    trainer.optimizer.step = real_step  # counting_step's closure and the backend's hooks make reference cycles:
    del trainer, base, named, kinds, counting_step  # main() collects them before the next part measures anything
    return out


def free(device):
    import gc

    import torch

    gc.collect()
    if cuda(device):
        torch.cuda.empty_cache()


# ---- (b) sampling precision and speed --------------------------------------------------------------------------

def perturb_policy(model, rms: float, seed: int = 0) -> float:
    """Set every policy lora_B so that the LoRA update s·B·A has RMS `rms` per weight; returns the RMS reached."""
    import torch
    from peft.tuners.lora import LoraLayer

    gen = torch.Generator().manual_seed(seed)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and "policy" in m.lora_B]
    with torch.no_grad():
        for m in layers:
            b = m.lora_B["policy"].weight
            b.copy_(torch.randn(b.shape, generator=gen).to(b))
        sq = n = 0
        for m in layers:
            delta = m.get_delta_weight("policy").float()
            sq, n = sq + float((delta**2).sum()), n + delta.numel()
        scale = rms / (sq / n) ** 0.5
        for m in layers:
            m.lora_B["policy"].weight.mul_(scale)
        sq = sum(float((m.get_delta_weight("policy").float() ** 2).sum()) for m in layers)
    return (sq / n) ** 0.5


def logprob_gap(a, b, mask) -> float:
    """Mean |a − b| over response tokens: `rollout/logprob_gap` when a is the sampler's, b the trainer's."""
    return float(((a - b).abs() * mask).sum() / mask.sum())


def part_sampling(args, built) -> dict:
    import torch

    from marlhf_edu.ppo.backends import sequence_logprobs
    from marlhf_edu.ppo.merged_rollout import MergedPolicy

    config = ppo_config(args, built, "sampling", ["--total_steps", "1", *ADAPTER])
    trainer = new_trainer(config)
    backend = trainer.backend
    reached = perturb_policy(backend.model, PERTURBATION_RMS)
    prompts = trainer.batch_prompts(0)
    torch.manual_seed(0)
    r = trainer.rollout(prompts)  # sampled from the training path (adapter on the NF4 base)
    m = r.response_mask.float()
    ids, mask, n = r.input_ids, r.attention_mask, r.n_response

    # copy against training path in the same rows per forward, each over the batch's width (the kernels round by
    # shape): micro_batch_size consecutive rows
    rows_old = torch.arange(len(ids), device=ids.device).split(config.micro_batch_size)

    def train_logprobs(rows_per_forward, update_path=False):
        """The training path's log-probs: under no_grad (as the rollout computes old log-probs), or as the update
        computes them (grad on, inside `training_forward`: checkpointed layers), each through the trainer's
        `_policy_forward` (cut to the rows' columns where the trainer cuts them)."""
        out = []
        for rows in torch.arange(len(ids), device=ids.device).split(rows_per_forward):
            if update_path:
                with torch.enable_grad(), backend.training_forward():
                    lp = trainer._policy_forward(ids[rows], mask[rows], n, with_entropy=False)[0]
                out.append(lp.detach().float())
            else:
                with torch.no_grad():
                    out.append(trainer._policy_forward(ids[rows], mask[rows], n, with_entropy=False)[0].float())
        return torch.cat(out)

    old = r.logprobs.float()                # the rollout's old log-probs (rows of forward_batch_size, no grad)
    update_1 = train_logprobs(config.micro_batch_size, update_path=True)  # what the update computes
    nograd_1 = train_logprobs(1)
    with torch.no_grad():
        train_same_rows = torch.cat([backend.policy_forward(ids[rows], mask[rows], n, config.temperature)[0].float()
                                     for rows in rows_old])
    ref = r.ref_logprobs.float()
    moved = ((old - ref) ** 2 * m).sum()
    result = {"perturbation_rms": reached, "rollout_rows": len(ids), "response_tokens": int(m.sum()),
              "policy_vs_reference_gap": logprob_gap(old, ref, m),
              # the first minibatch's ratio is exp(update − old): 1 exactly only if these agree bit for bit
              "old_vs_update_gap": logprob_gap(old, update_1, m),
              "old_vs_update_max_abs": float(((old - update_1).abs() * m).max()),
              "old_vs_nograd_micro_batch_1_gap": logprob_gap(old, nograd_1, m)}
    from peft.tuners.lora import LoraLayer

    from marlhf_edu.ppo.merged_rollout import dense_weight
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        # weight level: how much of s·B·A survives in the merged copy's weights (first 8 LoRA layers)
        errs = []
        with torch.no_grad():
            for mod in [x for x in backend.model.modules() if isinstance(x, LoraLayer) and "policy" in x.lora_B][:8]:
                base_w = dense_weight(mod.get_base_layer(), dtype)
                delta = mod.get_delta_weight("policy").float()
                kept = (base_w + delta.to(dtype)).float() - base_w.float()
                errs.append(float((kept - delta).norm() / delta.norm()))
        merged = MergedPolicy(backend.model, "policy", dtype=dtype)
        with torch.no_grad():
            lp = torch.cat([sequence_logprobs(merged.model, ids[rows], mask[rows], n, config.temperature)[0].float()
                            for rows in rows_old])
        # log π_sampler − log π_train, the same rows per forward, tokens sampled by the training path
        delta = lp - train_same_rows
        result[f"merged_{label}"] = {
            "delta_relative_error_in_weights": round(sum(errs) / len(errs), 4),
            "logprob_gap": logprob_gap(lp, train_same_rows, m),
            "kl_per_response_k3": float(((torch.exp(delta) - 1 - delta) * m).sum(1).mean()),
            "share_of_policy_move_kept": float(((lp - ref) * (old - ref) * m).sum() / moved),
            "copy_gib": gib(merged.nbytes())}
        del merged
        free(args.device)
    # speed: the same prompts sampled from the adapter path and from a bf16 (CUDA) merged copy
    speed = {}
    pids = backend.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(backend.device)
    for label in ("adapter", "merged"):
        if label == "merged":
            backend.use_merged_rollout()
        sync(args.device)
        t = time.perf_counter()
        with torch.no_grad():
            out = backend.generate(pids["input_ids"], pids["attention_mask"], max_new_tokens=config.max_new_tokens,
                                   temperature=config.temperature)
        sync(args.device)
        new = out[:, pids["input_ids"].shape[1]:]
        tokens = int((new != backend.tokenizer.pad_token_id).sum())
        speed[label] = {"tokens": tokens, "seconds": round(time.perf_counter() - t, 2),
                        "tokens_per_s": round(tokens / (time.perf_counter() - t), 1)}
    backend._merged = None
    free(args.device)
    result["generate"] = speed
    # one update at micro-batch 1 (the recipe) and at 4
    updates = {}
    for micro in (1, min(4, config.mini_batch_size)):
        trainer.config.micro_batch_size = micro
        reset_peak(args.device)
        t = time.perf_counter()
        trainer.update(r)
        sync(args.device)
        updates[f"micro_batch_{micro}"] = {"seconds": round(time.perf_counter() - t, 2), **memory(args.device)}
    result["update"] = updates
    result["checks"] = {"bf16 merged copy keeps >= 90 % of the policy's move":
                        result["merged_bf16"]["share_of_policy_move_kept"] >= 0.9,
                        "fp32 merged copy keeps >= 90 % of the policy's move":
                        result["merged_fp32"]["share_of_policy_move_kept"] >= 0.9,
                        "old log-probs equal the update's within 1e-2 (mean)":
                        result["old_vs_update_gap"] <= RATIO_TOLERANCE}
    del trainer, backend
    free(args.device)
    return result


# ---- (c) the pipeline's stages ---------------------------------------------------------------------------------

STAGE_RUNNER = """
import json, resource, sys, time, torch
import transformers
sys.path.insert(0, {root!r})
from marlhf_edu.cli import main
cuda = torch.cuda.is_available()
phases, peaks = {{}}, {{"allocated": [], "reserved": []}}
def fold():  # the peaks so far, kept across a reset of PyTorch's counters
    peaks["allocated"].append(torch.cuda.max_memory_allocated()); peaks["reserved"].append(torch.cuda.max_memory_reserved())
real_train = transformers.Trainer.train
def train(self, *a, **k):  # a trl stage's peak before training (loading) apart from its training's
    if cuda:
        torch.cuda.synchronize(); fold(); phases["before_train_gib"] = round(peaks["allocated"][-1] / 2**30, 3)
        torch.cuda.reset_peak_memory_stats(); phases["train_start_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    out = real_train(self, *a, **k)
    if cuda:
        torch.cuda.synchronize(); phases["train_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return out
transformers.Trainer.train = train
t = time.perf_counter()
code = main({argv!r})
if cuda:
    fold()
used = (lambda f, t: t - f)(*torch.cuda.mem_get_info()) if cuda else None
print("GPU_CHECK " + json.dumps({{"code": code, "seconds": round(time.perf_counter() - t, 1),
      "max_allocated_gib": round(max(peaks["allocated"]) / 2**30, 3) if cuda else None,
      "max_reserved_gib": round(max(peaks["reserved"]) / 2**30, 3) if cuda else None,
      "allocated_phases": phases or None,
      "outside_allocator_at_end_gib": round((used - torch.cuda.memory_reserved()) / 2**30, 3) if cuda else None,
      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}}))
"""

MERGE_RUNNER = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from marlhf_edu.loading.sources import materialize_adapter
t = time.perf_counter()
path = materialize_adapter({adapter!r})
print("GPU_CHECK " + json.dumps({{"seconds": round(time.perf_counter() - t, 1), "path": str(path),
      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}}))
"""


def run_child(code: str, env: dict, log: pathlib.Path) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(done.stdout + "\n---- stderr\n" + done.stderr)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("GPU_CHECK ")]
    got = json.loads(lines[-1].removeprefix("GPU_CHECK ")) if lines else {}
    if done.returncode != 0 or not lines or got.get("code") not in (0, None):
        raise RuntimeError(f"a child failed (exit {done.returncode}, code {got.get('code')}); its log: {log}\n"
                           f"{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
    return got


def saved_dtypes(folder: pathlib.Path) -> list[str]:
    """The dtypes of the tensors in a saved adapter (adapter_model.safetensors: LoRA matrices and heads)."""
    from safetensors import safe_open

    with safe_open(str(pathlib.Path(folder) / "adapter_model.safetensors"), "pt") as f:
        return sorted({f.get_slice(k).get_dtype() for k in f.keys()})


def disk_gib(path: pathlib.Path) -> float:
    return gib(sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file()))


def stage_pipeline(args, built, out: pathlib.Path, path: pathlib.Path):
    """The 7B pipeline file with the check's model, data, step counts (and `--reduced` shapes), and the env."""
    from marlhf_edu.training.smoke import write_pipeline

    work = pathlib.Path(args.work)
    gpu = cuda(args.device)
    train = dict(dataset_name=str(built["data"]), max_steps=args.steps, save_steps=args.steps, logging_steps=1)
    if not gpu:
        train["use_cpu"] = True
    if args.reduced:
        train.update(per_device_train_batch_size=2, gradient_accumulation_steps=1, max_length=64, max_tokens=64)
    overrides = {"sft": dict(model_name_or_path=str(built["model"]), output_dir=str(out / "sft"), **train),
                 "rm": dict(output_dir=str(out / "rm"), eval_pairs=args.eval_pairs, **train),
                 "ma-ppo": dict(dataset_name=str(built["data"]), device=args.device, total_steps=min(args.steps, 2),
                                output_dir=str(out / "ma_ppo"), save_steps=1000)}
    if args.reduced:
        overrides["rm"]["per_device_eval_batch_size"] = 4
        overrides["ma-ppo"].update(batch_size=4, mini_batch_size=2, forward_batch_size=4, max_new_tokens=8)
    pipeline = write_pipeline(path, overrides, ROOT)
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "MARLHF_EDU_CACHE": str(work / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return pipeline, env


def part_stages(args, built) -> dict:
    work = pathlib.Path(args.work)
    out = work / "stages_run"
    cache = work / "cache"
    pipeline, env = stage_pipeline(args, built, out, work / "stages.yaml")
    overrides = json.loads(json.dumps(__import__("yaml").safe_load(pipeline.read_text())["overrides"]))
    result = {"overrides": overrides, "stages": {}}
    # after training, the commands a user runs on the result: `evaluate` (both models on the GPU, bf16) and `merge`
    # (the exported policy into its fp32 base on the GPU). The merge is saved in fp32 here: its check is then exact
    # (log-probs within 1e-3), while in bf16 a random model's near-uniform next-token choice flips at about one
    # position in ten (H100: 88.9 % agreement, below the 95 % asked of a trained model), which says nothing about
    # the merge. To fit a 64 GiB disk, the policy merged for `evaluate` leaves the cache before the export writes.
    after = {"evaluate": ["evaluate", "--model", str(out / "ma_ppo" / "policy"), "--reward_adapter", str(out / "rm"),
                          "--judge", "keyword", "--prompts", "4" if args.reduced else "16", "--repeats", "1",
                          "--max_new_tokens", "8" if args.reduced else "64", "--device", args.device],
             "export_merge": ["merge", "--adapter", str(out / "ma_ppo" / "policy"), "--output_dir",
                              str(work / "merged_policy"), "--overwrite", "true", "--device", args.device,
                              "--dtype", "float32"]}
    for stage in ("sft", "merge", "rm", "ma-ppo", *after):
        if args.stages and stage not in args.stages:
            continue
        print(f"gpu_check stages: {stage}", flush=True)
        try:
            if stage == "merge":  # the SFT adapter merged into its base once, as rm and ma-ppo then read it
                got = run_child(MERGE_RUNNER.format(root=str(ROOT), adapter=str(out / "sft")), env, work / "merge.log")
                got["disk_gib"] = disk_gib(pathlib.Path(got.pop("path")))
            else:
                argv = after.get(stage) or ["pipeline", "--config", str(pipeline), "--stages", stage]
                got = run_child(STAGE_RUNNER.format(root=str(ROOT), argv=argv), env, work / f"{stage}.log")
        except RuntimeError as failed:  # keep what the other stages measured
            got = {"code": "failed", "error": str(failed)[-2000:]}
        if stage == "evaluate":
            for entry in (cache / "merged").glob("policy-*"):
                shutil.rmtree(entry, ignore_errors=True)
        if stage == "export_merge":
            check = re.search(r"same most likely next token at ([\d.]+)%, largest \|log-prob difference\| (\S+)",
                              (work / "export_merge.log").read_text())
            if check:
                got.update(agreement=float(check[1]) / 100, max_logprob_gap=float(check[2]))
            shutil.rmtree(work / "merged_policy", ignore_errors=True)
        if stage in ("sft", "rm") and got.get("code") == 0:  # item 5: the adapters trained (and saved) in fp32
            got["saved_trainable_dtypes"] = saved_dtypes(out / stage)
        result["stages"][stage] = got
    result["disk_gib"] = {"run": disk_gib(out), "merge_cache": disk_gib(cache), "model": disk_gib(built["model"])}
    result["checks"] = {"every stage finished": all(s.get("code", 0) in (0, None) for s in result["stages"].values())}
    return result


PIPELINE_RUNNER = """
import importlib, json, sys, time, torch
sys.path.insert(0, {root!r})
from marlhf_edu.training.pipeline_file import STAGES
seen = []
for name, (module_name, kind) in [(k, v) for k, v in STAGES.items() if k != "ppo"]:  # the 7B pipeline: sft, rm, ma-ppo
    module = importlib.import_module(module_name)
    def wrapped(*a, _main=module.main, _name=name, **k):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        row = {{"stage": _name, "allocated_at_start_gib": round(torch.cuda.memory_allocated() / 2**30, 3) if cuda else None}}
        t = time.perf_counter()
        out = _main(*a, **k)
        row.update(seconds=round(time.perf_counter() - t, 1),
                   max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
                   allocated_at_end_gib=round(torch.cuda.memory_allocated() / 2**30, 3) if cuda else None)
        seen.append(row)
        return out
    module.main = wrapped
from marlhf_edu.cli import main
code = main({argv!r})
print("GPU_CHECK " + json.dumps({{"code": code, "stages": seen}}))
"""


def part_pipeline(args, built) -> dict:
    """The whole pipeline in one process, as `marlhf-edu pipeline` runs it: GPU memory still allocated when each
    stage starts (what the previous stages left behind) and each stage's peak."""
    work = pathlib.Path(args.work)
    pipeline, env = stage_pipeline(args, built, work / "pipeline_run", work / "pipeline.yaml")
    got = run_child(PIPELINE_RUNNER.format(root=str(ROOT), argv=["pipeline", "--config", str(pipeline)]), env,
                    work / "pipeline.log")
    leftover = [s["allocated_at_start_gib"] for s in got["stages"][1:]]
    return {"stages": got["stages"], "checks": {
        "every stage finished": got["code"] in (0, None) and len(got["stages"]) == 3,
        "each stage starts with < 0.5 GiB left by the ones before": all(x < 0.5 for x in leftover)
        if cuda(args.device) else None}}


# ---- driver -----------------------------------------------------------------------------------------------------

def part_ppo_merged(args, built) -> dict:
    """(a) with `merged_rollout: true`: the same steps sampled from a dense bf16 copy of the policy."""
    return part_ppo(args, built, merged_rollout=True)


#: how each part samples, whatever the config file says: through the adapter on the NF4 base (`ppo`, `sampling`) and
#: from a merged copy with a dynamic KV cache and no TIS (`ppo_merged`); `ppo_fast` samples as the fast launch that
#: `marlhf-edu preflight` prints (`FAST_SAMPLER` there)
ADAPTER = ["--merged_rollout", "false", "--rollout_cache", "dynamic", "--tis_cap", "0"]
MERGED = ["--merged_rollout", "true", "--rollout_cache", "dynamic", "--tis_cap", "0"]
#: issue 61's target for the 7B config's step on one H100 (median after the first step)
STEP_TARGET_S = 10.0


def planned_micro_batch(args, built, config) -> int:
    """The micro-batch `marlhf-edu preflight` picks for this device (`largest_micro_batch`): the largest that
    divides the minibatch and whose planned PPO stage fits in the GPU's memory with preflight's 5 % headroom (on a
    CPU, a nominal 80 GiB)."""
    import torch

    from marlhf_edu.memory.device import ppo_need
    from marlhf_edu.memory.plan import MemorySettings, multi_adapter_settings, plan_multi_adapter, saved_lora_recipe
    from marlhf_edu.stages.preflight import PreflightArguments, largest_micro_batch

    reward_r, reward_targets = saved_lora_recipe(built["reward"])
    s = MemorySettings.from_ppo_config(config, reward_lora_r=reward_r, reward_targets=reward_targets,
                                       weight_dtype="bfloat16" if cuda(args.device) else "float32")
    total = torch.cuda.get_device_properties(0).total_memory if cuda(args.device) else 80 * 2**30
    usable = total * (1 - PreflightArguments.headroom)
    micro, _ = largest_micro_batch(lambda m: ppo_need(plan_multi_adapter(shape_for(args), multi_adapter_settings(
        replace(s, micro_batch_size=m)))), config.mini_batch_size, usable)
    return micro


def compiled_vs_eager(trainer, args) -> dict:
    """How far the compiled static-cache decode step's log-probs are from the same copy's eager forward: the
    copy samples a batch with its logits returned (the compiled graphs on CUDA), and the same tokens are scored by
    one plain forward of the same weights. Mean and max |difference| per response token (before EOS)."""
    import torch

    from marlhf_edu.ppo.backends import sequence_logprobs
    from marlhf_edu.ppo.trainer import response_mask_from_ids

    cfg, tok = trainer.config, trainer.tokenizer
    model = trainer.backend.sampling_model()
    enc = tok(trainer.batch_prompts(0), return_tensors="pt", padding="max_length", max_length=cfg.max_prompt_length,
              padding_side="left").to(trainer.backend.device)
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0,
                             max_new_tokens=cfg.max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, return_dict_in_generate=True, output_logits=True)
        ids = out.sequences
        R = ids.shape[1] - enc["input_ids"].shape[1]
        response = ids[:, -R:]
        mask = response_mask_from_ids(response, tok.eos_token_id)
        compiled = torch.log_softmax(torch.stack(out.logits, 1).float() / cfg.temperature, -1)
        compiled = compiled.gather(-1, response[..., None])[..., 0]
        attention = torch.cat([enc["attention_mask"], mask.long()], 1)
        eager = sequence_logprobs(model, ids, attention, R, cfg.temperature)[0].float()
    gap = (compiled - eager).abs()[mask]
    return {"tokens": int(mask.sum()), "mean_abs": round(float(gap.mean()), 5), "max_abs": round(float(gap.max()), 5)}


def part_ppo_fast(args, built) -> dict:
    """(e) the fast launch: the steps of (a) sampled from the merged copy with a static KV cache (on CUDA a
    compiled decode step), TIS on, at the micro-batch preflight picks for this GPU; the median step after the
    first against the 10 s target, and the compiled sampler's log-probs against an eager forward."""
    return part_ppo(args, built, fast=True)


PARTS = {"ppo": part_ppo, "ppo_merged": part_ppo_merged, "ppo_fast": part_ppo_fast, "sampling": part_sampling,
         "stages": part_stages, "pipeline": part_pipeline}


def machine(device) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    for name in ("transformers", "peft", "bitsandbytes", "trl"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            info[name] = f"unavailable: {e.__class__.__name__}"
    if cuda(device):
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=gib(p.total_memory), cuda=torch.version.cuda)
    return info


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", choices=sorted(PARTS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu_check.json"))
    parser.add_argument("--work", default="/tmp/gpu_check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--eval_pairs", type=int, default=64)
    parser.add_argument("--reduced", action="store_true", help="a tiny model of the same family (the CPU test)")
    parser.add_argument("--stages", nargs="+", default=None, metavar="STAGE",
                        help="the stages part runs only these (sft merge rm ma-ppo evaluate export_merge)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not cuda(args.device):
        raise SystemExit("gpu_check: no CUDA device here; pass --device cpu --reduced to check the tool itself")
    out = pathlib.Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {}
    t = time.perf_counter()
    built = build(args)
    here = machine(args.device)
    if record.get("machine") != here:  # parts measured elsewhere are not mixed with this machine's
        record = {}
    record.pop("about", None)  # a hand-written note on how an earlier record was assembled no longer holds
    record["machine"] = here
    record["model"] = {"shape": built["shape"], "checkpoint_dtype": built.get("checkpoint_dtype"),
                       "build_s": built.get("build_s"), "reduced": args.reduced}
    for part in args.parts:
        print(f"gpu_check: {part}", flush=True)
        start = time.perf_counter()
        try:
            section = PARTS[part](args, built)
        except Exception as e:  # a part that fails is recorded as failed; the others still run
            import traceback

            section = {"error": f"{e.__class__.__name__}: {e}", "traceback": traceback.format_exc()[-4000:],
                       "checks": {"ran": False}}
        # the part's models are garbage now, but reference cycles (hooks, closures) keep them allocated until a
        # collection: without this, ppo after ppo_merged started with the merged run's 17 GiB still allocated (H100)
        free(args.device)
        section["wall_s"] = round(time.perf_counter() - start, 1)
        section["command"] = "python tools/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
        section["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")  # the slack depends on it
        section["date"] = time.strftime("%Y-%m-%d")
        record[part] = section
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")  # after every part: a later failure loses nothing
        for name, ok in section["checks"].items():
            print(f"  {'PASS' if ok else 'n/a ' if ok is None else 'FAIL'}  {part}: {name}", flush=True)
    print(f"gpu_check: done in {time.perf_counter() - t:.0f} s, record in {out}")
    return record


if __name__ == "__main__":
    main()
