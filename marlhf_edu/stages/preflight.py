r"""`marlhf-edu preflight --config FILE`: check a PPO launch before it spends GPU hours. Runs in seconds on a CPU::

    marlhf-edu preflight --config configs/llama2_7b/ma_ppo.yaml --model_shape llama-2-7b \
        --weight_dtype bfloat16 --reward_lora_r 32 --reward_target_modules q_proj k_proj v_proj o_proj \
        --gpu_memory_gib 24 [--num_gpus 1] [--tokens_per_s 900]

1. builds the model from its shape on the meta device (no weights, no download) and checks that its parameter
   count is the planner's: the plan below is about the real architecture, not a typo in a shape; when the
   checkpoint the run loads (`sft_model_path`) can be read here, checks its own `config.json` against that
   shape and its tokenizer (a pad token distinct from EOS, every token id within the embedding);
2. plans the memory of one GPU for the config's engine (`ma-ppo` or four-model `ppo`, from `--command`): weights,
   adapters, gradients, optimizer, KV cache, logits and activations (chapter 10's tensor plan), with each rank's
   share of the batch; then what the GPU needs per stage (`memory.device`): the largest phase's working set
   (sampling, log-probs, scoring, update, with bitsandbytes' dequantized weight), the allocator's cache slack and
   what a process holds outside the allocator, for the PPO stage with and without `merged_rollout` and, given
   `--pipeline`, for its SFT and reward-model stages too; and the disk the run needs;
3. compares the largest stage's need with the GPU's memory (`--gpu_memory_gib`, else the smallest visible GPU) and
   fails, naming the stage and what to change, when it does not fit with `--headroom` to spare;
4. prints the launch command (with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, which the cache slack
   assumes) and a time estimate with its basis: tokens per step, and a measured or stated throughput
   (`--tokens_per_s`); without one it says which measurement to make.

With `--num_gpus` > 1 the plan is per rank (each holds its own base and samples batch_size / N rollouts) and the
launch is `accelerate launch` of data-parallel PPO (chapter 15); the config's global batch shapes must split over
the ranks. Taught in chapter 15.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.sources import load_tokenizer, readable_checkpoint
from marlhf_edu.memory.device import (COMPILED_SAMPLER, TrlStage, need_table, plan_rm_stage, plan_sft_stage, ppo_need,
                                      run_disk)
from marlhf_edu.memory.plan import ModelShape, _fmt, multi_adapter_settings, plan_four_model, plan_multi_adapter
from marlhf_edu.memory.settings import MemoryArguments, settings_and_shape
from marlhf_edu.ppo.config import PPOConfig
from marlhf_edu.training.args import parse_stage_args
from marlhf_edu.training.pipeline_file import load_pipeline


@dataclass
class PreflightArguments(MemoryArguments):
    command: str = field(default="ma-ppo", metadata={"help": "'ma-ppo' or 'ppo' (four models)"})
    num_gpus: int = field(default=1, metadata={"help": "data-parallel ranks; each holds its own base"})
    gpu_memory_gib: float = field(default=0.0, metadata={"help": "memory of one GPU; 0 = the smallest visible GPU"})
    headroom: float = field(default=0.05, metadata={"help": "fraction of the GPU kept free beyond the planned "
                                                            "overheads (cache slack, CUDA context)"})
    pipeline: str = field(default="", metadata={"help": "a pipeline file (configs/llama2_7b/pipeline.yaml): plan "
                                                        "its SFT and reward-model stages and the run's disk too"})
    tokens_per_s: float = field(default=0.0, metadata={"help": "measured or stated throughput of one GPU, in "
                                                                "prompt + response tokens per second of a whole step"})


def meta_parameter_count(shape) -> int:
    """Parameters of a Llama model of `shape`, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.dim_head, tie_word_embeddings=shape.tie_word_embeddings)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def checkpoint_problems(ref, shape) -> tuple[list[str], str]:
    """`(problems, what was checked)` between the plan and the checkpoint the run will load: the
    planner's shape against the checkpoint's own `config.json` (the meta-device build only checks the planner
    against itself), a pad token distinct from EOS, and embedding rows for every token id of the tokenizer."""
    folder = readable_checkpoint(ref)
    if folder is None or not (folder / "config.json").exists():
        return [], f"{ref} cannot be read here (not written or downloaded yet): the plan uses the given shape"
    real = ModelShape.from_config(json.loads((folder / "config.json").read_text()))
    problems = [f"{key}: the checkpoint's config.json says {getattr(real, key)}, the plan {getattr(shape, key)}"
                for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "kv_heads")
                if getattr(real, key) != getattr(shape, key)]
    try:
        tokenizer = load_tokenizer(folder)
    except ConfigError as error:  # no pad token distinct from EOS
        return problems + [str(error)], f"{folder}"
    except (OSError, ValueError):
        return problems, f"{folder} (no tokenizer there to check)"
    if len(tokenizer) > real.vocab_size:
        problems.append(f"the tokenizer has {len(tokenizer)} tokens but the model embeds {real.vocab_size}: ids past "
                        "the embedding would fail or read another row")
    return problems, (f"{folder}: shape as planned, pad token {tokenizer.pad_token!r} (not EOS), {len(tokenizer)} "
                      f"tokenizer ids within {real.vocab_size} embedding rows" if not problems else str(folder))


def gpu_memory_bytes(args: PreflightArguments) -> tuple[int, str]:
    """`(bytes, where the number comes from)` of one GPU."""
    import torch


    if args.gpu_memory_gib > 0:
        return int(args.gpu_memory_gib * 2**30), "--gpu_memory_gib"
    if torch.cuda.is_available():
        sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        return min(sizes), f"the smallest of {len(sizes)} visible GPU(s)"
    raise ConfigError("no GPU is visible here: pass --gpu_memory_gib (for example 24 or 80) to check against one")


def run_overrides(argv: list[str], config_class) -> list[str]:
    """The options of `argv` that set a field of `config_class` (`--name value ...` or `--name=value`, values up to
    the next option), quoted for a shell: what the launch line must repeat so that the run is the one planned."""
    import dataclasses
    import shlex

    names = {f.name for f in dataclasses.fields(config_class)} - {"config"}
    out, keep = [], False
    for token in argv:
        if token.startswith("--"):
            keep = token[2:].split("=", 1)[0] in names
        if keep:
            out.append(shlex.quote(token))
    return out


def preflight(config, args: PreflightArguments, config_path: str = "<config>", overrides: list[str] = ()) -> dict:
    """The checks above; returns what it printed as numbers (`plan`, `gpu_bytes`, `fits`, `tokens_per_step`, ...)."""
    if args.command not in ("ma-ppo", "ppo"):
        raise ConfigError(f"--command must be 'ma-ppo' or 'ppo', got {args.command!r}")
    if args.num_gpus < 1 or config.batch_size % args.num_gpus:
        raise ConfigError(f"batch_size ({config.batch_size}) must split evenly over --num_gpus ({args.num_gpus})")
    config.validate_data_parallel(args.num_gpus)
    shape, s = settings_and_shape(config, args)
    n_meta = meta_parameter_count(shape)
    if n_meta != shape.n_params:
        raise ConfigError(f"model shape {shape.name}: the meta-device model has {n_meta:,} parameters, the planner "
                          f"counts {shape.n_params:,}; the plan would not describe this model")
    problems, checked = checkpoint_problems(config.sft_model_path, shape)
    if problems:
        raise ConfigError(f"{config_path}: the model {config.sft_model_path} does not match the plan or cannot train "
                          "as is:\n  " + "\n  ".join(problems))
    per_rank = config.batch_size // args.num_gpus
    s = replace(s, forward_batch_size=min(s.forward_batch_size, per_rank))

    def plan_with(merged: bool, micro: int | None = None):
        settings = replace(s, merged_rollout=merged, micro_batch_size=micro or s.micro_batch_size)
        return (plan_multi_adapter(shape, multi_adapter_settings(settings)) if args.command == "ma-ppo"
                else plan_four_model(shape, settings))

    plans = {merged: plan_with(merged) for merged in (False, True)}
    plan = plans[s.merged_rollout]
    trl_stages = pipeline_trl_stages(args.pipeline) if args.pipeline else {}
    needs = [plan_sft_stage(shape, trl_stages["sft"])] if "sft" in trl_stages else []
    needs += [plan_rm_stage(shape, trl_stages["rm"])] if "rm" in trl_stages else []
    ppo_needs = {merged: ppo_need(p) for merged, p in plans.items()}
    needs += [ppo_needs[False], ppo_needs[True]]
    run_needs = [n for n in needs if n.stage in ("sft", "rm")] + [ppo_needs[s.merged_rollout]]
    largest = max(run_needs, key=lambda n: n.device)
    gpu, source = gpu_memory_bytes(args)
    usable = gpu * (1 - args.headroom)
    fits = largest.device <= usable
    disk = run_disk(shape, sft=trl_stages.get("sft"), rm=trl_stages.get("rm"), ppo_trainable=plan.parts["gradients"])

    print(f"model: {shape.name}, {shape.n_params:,} parameters (meta-device build agrees), {shape.num_layers} layers")
    print(f"checkpoint: {checked}")
    print(f"engine: {plan.architecture}, {args.num_gpus} GPU(s), {per_rank} rollouts per rank per step, "
          f"{s.prompt_length} + {s.response_length} tokens, micro-batch {s.micro_batch_size}"
          + (", gradient checkpointing" if s.gradient_checkpointing else ""))
    print("tensors per GPU (chapter 10's plan):")
    for part, nbytes in plan.parts.items():
        print(f"  {part:12s} {_fmt(nbytes):>12s}")
    print(f"  {'= peak':12s} {_fmt(plan.peak):>12s}   (state + the larger of sampling and an update)")
    print("needed per GPU, stage by stage (the run's own stages marked *):")
    print(need_table(needs, marked=run_needs))
    print(f"disk: {_fmt(disk['total'])}" + ("" if args.pipeline else " (give --pipeline to count SFT and RM)"))
    for what, nbytes in disk.items():
        if what != "total":
            print(f"  {what:36s} {_fmt(nbytes):>10s}")
    print(f"GPU: {_fmt(gpu)} ({source}); usable with {args.headroom:.0%} headroom: {_fmt(usable)}")
    print(f"  the largest need, {largest.stage}'s: {_fmt(largest.device)} -> " + ("fits" if fits else "DOES NOT FIT"))
    per_rank_mini = config.mini_batch_size // args.num_gpus
    micro, micro_need = largest_micro_batch(lambda m: ppo_need(plan_with(s.merged_rollout, m)), per_rank_mini, usable)
    if micro_need.device > usable:
        print("  micro_batch_size: none fits (see below)")
    elif micro != s.micro_batch_size:
        print(f"  micro_batch_size: up to {micro} fits ({_fmt(micro_need.device)}), the config has "
              f"{s.micro_batch_size}: pass --micro_batch_size {micro}")
    else:
        print(f"  micro_batch_size: {micro}, the largest that divides the minibatch and fits")
    fast = None
    if args.command == "ma-ppo" and not (config.merged_rollout and config.rollout_cache == "static"):
        fast_micro, fast_need = largest_micro_batch(lambda m: ppo_need(plan_with(True, m), COMPILED_SAMPLER),
                                                    per_rank_mini, usable)
        if fast_need.device <= usable:  # the fast sampler and the largest micro-batch, when both fit this GPU
            fast = [*FAST_SAMPLER, "--micro_batch_size", str(fast_micro)]
            print(f"  the fast launch fits too ({fast_need.stage}: {_fmt(fast_need.device)}): a merged copy "
                  f"sampling with a compiled static cache, micro-batch {fast_micro} (chapter 15)")
    tokens = config.batch_size * (s.prompt_length + s.response_length)
    print(f"tokens per step: {tokens:,} ({config.batch_size} x ({s.prompt_length} + {s.response_length})), "
          f"{config.total_steps} steps")
    if args.tokens_per_s > 0:
        step_s = tokens / (args.tokens_per_s * args.num_gpus)
        print(f"time: about {step_s:.0f} s a step, {step_s * config.total_steps / 3600:.1f} h for the run, at "
              f"{args.tokens_per_s:,.0f} tokens/s per GPU (as given: an estimate, not a measurement of this run)")
    else:
        print("time: no throughput given. Measure one on the GPU (python tools/bench_step.py --command "
              f"{args.command} --config ... --steps 5) and pass --tokens_per_s")
    if not fits:
        raise ConfigError(f"stage {largest.stage} needs {_fmt(largest.device)}, over the {_fmt(usable)} usable on one "
                          f"GPU; its peak is in {largest.peak_phase}: {what_lowers(largest, s)}, or use a GPU with "
                          "more memory")
    extra = "".join(" " + o for o in overrides)  # the settings given here beside the config: the run planned
    if args.num_gpus == 1:
        launch = f"{ALLOCATOR_ENV} marlhf-edu {args.command} --config {config_path}{extra}"
    else:
        launch = (f"{ALLOCATOR_ENV} accelerate launch --config_file configs/accelerate/ddp_4gpu.yaml "
                  f"--num_processes {args.num_gpus} -m marlhf_edu.cli {args.command} --config {config_path}{extra}")
    print(f"launch: {launch}")
    if fast:  # measured under the default allocator only (device.COMPILED_SAMPLER): launched without the setting
        print(f"launch, fast: {launch.replace(ALLOCATOR_ENV + ' ', '')} {' '.join(fast)}")
    return {"plan": plan, "needs": needs, "largest": largest, "disk": disk, "gpu_bytes": gpu, "fits": fits,
            "tokens_per_step": tokens, "meta_params": n_meta, "micro_batch_size": micro, "fast_launch": fast}


def largest_micro_batch(plan_with_micro, mini_batch_per_rank: int, usable: int) -> tuple[int, object]:
    """The largest micro-batch that divides this rank's share of a minibatch and whose PPO stage still fits in
    `usable` bytes, with that stage's need: `plan_with_micro(m)` → the `StageNeed` of the run at micro-batch m.

    The update's working set grows with the rows per forward/backward (activations, the logits' backward); the
    rest of the step does not. Fewer, larger micro-batches cost fewer passes over the weights: on one H100 at 7B
    one update took 8.2 s at micro-batch 1 and 2.4 s at 4 (benchmarks/gpu_check.json, `sampling`). Returns
    `(1, need_at_1)` when even 1 does not fit: preflight's own check then reports it."""
    divisors = [m for m in range(mini_batch_per_rank, 0, -1) if mini_batch_per_rank % m == 0]
    for m in divisors:
        need = plan_with_micro(m)
        if need.device <= usable:
            return m, need
    return 1, plan_with_micro(1)


def what_lowers(need, s) -> str:
    """The settings that lower a stage's need, for the phase that sets its peak and as the run is configured."""
    if need.stage in ("sft", "rm"):
        if need.peak_phase == "eval":
            return "lower the reward stage's per_device_eval_batch_size or max_length"
        return f"lower the {need.stage} stage's per_device_train_batch_size or max_length"
    update = ([] if s.micro_batch_size == 1 else ["lower micro_batch_size"]) + (
        [] if s.gradient_checkpointing else ["turn on gradient_checkpointing"]) + [
        "shorten max_new_tokens (the sequences it trains on)"]
    advice = {"sampling": "lower forward_batch_size or max_new_tokens (the KV cache)",
              "log-probs": "lower forward_batch_size or max_new_tokens (the logits of a forward)",
              "scoring": "lower forward_batch_size",
              "update": ", ".join(update)}[need.peak_phase]
    merged = ("turn merged_rollout off (its dense copy of the model stays allocated; with it rollout_cache: "
              "dynamic), " if s.merged_rollout else "")
    return merged + advice


#: The fast sampler (chapter 15): a dense bf16 copy of the policy sampling with a static KV cache, whose decode step
#: transformers compiles into CUDA graphs on a GPU, with truncated importance sampling for the copy's rounding.
#: Preflight prints it as the fast launch, with the largest micro-batch that fits, when the card has the memory.
FAST_SAMPLER = ("--merged_rollout", "true", "--rollout_cache", "static", "--tis_cap", "2.0")
#: what the planned cache slack assumes (without it, a merged-rollout run on an H100 reserved 2.07x its peak)
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def pipeline_trl_stages(path: str) -> dict:
    """`{"sft": TrlStage, "rm": TrlStage}` of a pipeline file's SFT and reward-model stages, as the pipeline would
    parse them (the file's overrides in; bf16 switched off only for parsing, since transformers refuses it where no
    GPU is visible, which changes nothing planned: the model's dtype comes from its `dtype`)."""
    stages, _ = load_pipeline(path, [])
    out = {}
    for stage in stages:
        if stage.name in ("sft", "rm"):
            stage.argv += ["--bf16", "false", "--use_cpu", "true"]
            parsed = stage.parse()
            out[stage.name] = TrlStage.from_parsed(parsed[1], parsed[2])
    return out


def main(argv: list[str] | None = None):
    config, args = parse_stage_args((PPOConfig, PreflightArguments), argv)
    config.validate()
    path = argv[argv.index("--config") + 1] if argv and "--config" in argv else "<config>"
    return preflight(config, args, path, run_overrides(argv or [], PPOConfig))
