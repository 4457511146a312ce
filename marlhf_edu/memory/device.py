"""What one GPU needs for each stage of a run, beyond the tensors chapter 10's planner counts.

`MemoryPlan` (chapter 10) counts tensors: the model state plus the larger of two working sets, sampling
(KV cache *plus* logits) or one update micro-batch. A GPU needs something else, stage by stage::

    allocated  what stays allocated through the stage (weights, adapters, AdamW's moments, the library
               workspaces that PyTorch's allocator holds) plus the largest working set of the phases, which
               never overlap:
                 sampling   the KV cache of one forward batch, growing to P + R tokens, and one layer's
                            cache again while it grows (each step concatenates the old with the new);
                 log-probs  the reference forward at `forward_batch_size` rows: MA-PPO's response logits in
                            fp32 and their copy divided by the temperature (`lm_head(h).float() / T`, the
                            16-bit logits freed before the division), plus the final hidden states;
                 scoring    the reward model's forward without a cache: one decoder layer's values at a time;
                 update     the gradients (freed between updates: `zero_grad(set_to_none=True)`), AdamW's
                            temporaries, the activations, the layer recomputed and the log-softmax's gradient;
               with an NF4 base, scoring, update and sampling through the adapter add the weight bitsandbytes
               dequantizes for the matrix product in hand (one at a time, the largest linear layer's);
    reserved   allocated plus the caching allocator's slack (`cache_slack`, a constant);
    device     reserved plus what a process holds outside PyTorch's allocator (CUDA context, library handles).

The assumptions (`DeviceAssumptions`) come from one H100 80GB (torch 2.11, CUDA 13.0, a random model of
Llama-2-7B's shape, benchmarks/gpu_check.json). Outside the allocator: 0.67 GiB after loading, 0.78 GiB at the
peak. Library workspaces inside the allocator: between phases 63 MiB more stayed allocated than the weights,
adapters and AdamW's moments planned (both runs with expandable segments), taken to be cuBLAS's and cuBLASLt's
workspaces (32 MiB each on Hopper; inferred, not itemized). Reserved beyond allocated at the peak: 0.72 GiB
(MA-PPO with merged_rollout) and 1.31 GiB (without)
under `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, 0.77 and 1.00 GiB for SFT and RM (run without
setting it): about a constant, not a share of the peak (4 % of the merged run's, 18 % of the other's). Without
expandable segments MA-PPO reserved 2.52 GiB beyond its peak, and a merged-rollout run 21.1 GiB (40.7 reserved
for 19.6 allocated), since the dense copy rebuilt after every update fragments the cache: the launch lines set
expandable segments, and the plan assumes them. Another card, driver or PyTorch moves these by tens to hundreds
of MiB; say so when quoting a plan.

SFT and the reward model are planned the same way from their trl configs (`plan_sft_stage`, `plan_rm_stage`):
what stays allocated (NF4 base, LoRA and heads in fp32, AdamW's two moments) plus the training micro-batch's
working set (gradients and AdamW's temporaries, checkpointed layer inputs, one layer recomputed, the
dequantized weight; trl 1.x's SFT scores the answer tokens through a fused, tiled LM head, so no logits tensor of
the whole batch) or, for the reward model, its held-out scoring at `per_device_eval_batch_size` rows. On the H100
both stages' whole-process peaks were 4.72 GiB, the same to the MiB, which suggests the peak was set while
loading, not training: their training working sets are planned, not yet measured apart. Disk (`run_disk`)
counts the base checkpoint, the SFT adapter merged into a copy of it (the model cache), and each stage's output
with the checkpoints it keeps, plus the one being written. Taught in chapter 15.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.errors import ConfigError
from marlhf_edu.memory.plan import (ALL_LINEAR, DTYPE_BYTES, MemoryPlan, MemorySettings, ModelShape, _fmt,
                                    base_weight_bytes, layer_activation_values, lora_params, optimizer_bytes)

GIB = 2**30


@dataclass(frozen=True)
class DeviceAssumptions:
    """The overheads a plan adds to its tensors, each with where its number comes from."""

    outside_allocator: int = int(0.8 * GIB)
    #: why `outside_allocator` is what it is
    outside_allocator_basis: str = ("CUDA context and library handles: 0.67 GiB after loading, 0.78 at the peak, "
                                    "on one H100 (torch 2.11, CUDA 13.0)")
    workspaces: int = 64 * 2**20
    workspaces_basis: str = ("cuBLAS and cuBLASLt workspaces inside the allocator, 32 MiB each on Hopper: between "
                             "phases the H100 held 63 MiB more than the weights, adapters and AdamW's moments")
    cache_slack: int = int(1.4 * GIB)
    cache_slack_basis: str = ("reserved beyond allocated at the peak: 0.72-1.31 GiB measured on one H100 for "
                              "MA-PPO with expandable segments, 0.77-1.00 GiB for SFT and RM")


#: The fast sampler's overheads (`preflight.FAST_SAMPLER`): measured under PyTorch's default allocator only, where
#: the cache reserves more beyond the allocated peak (its CUDA graphs' own memory pool is part of it, not isolated).
COMPILED_SAMPLER = DeviceAssumptions(
    cache_slack=int(2.7 * GIB),
    cache_slack_basis=("reserved beyond allocated at the peak with the compiled static-cache sampler: 2.61 GiB on one "
                       "H100 and 2.63 on one H200 (19.69 allocated), default allocator (the recipe's run under it: "
                       "2.5); with expandable segments not measured"))


@dataclass
class StageNeed:
    """One stage's planned GPU memory: what PyTorch allocates at the peak, what its cache reserves, what the
    device then has in use. `state` stays allocated through the stage; `working` names each phase's working set
    (bytes above the state)."""

    stage: str
    state: int
    working: dict[str, int]
    assumptions: DeviceAssumptions = field(default_factory=DeviceAssumptions)

    @property
    def allocated(self) -> int:
        return self.state + max(self.working.values(), default=0)

    @property
    def peak_phase(self) -> str:
        return max(self.working, key=self.working.get) if self.working else "state"

    @property
    def reserved(self) -> int:
        return self.allocated + self.assumptions.cache_slack

    @property
    def device(self) -> int:
        return self.reserved + self.assumptions.outside_allocator


def dequant_buffer_bytes(shape: ModelShape, s: MemorySettings) -> int:
    """NF4: the weight bitsandbytes dequantizes for one matrix product, in the compute dtype (the largest linear
    layer's: 11008 x 4096 at Llama-2-7B, 86 MiB in bf16); 0 for an unquantized model."""
    if not s.load_in_4bit:
        return 0
    return max(a * b for a, b in shape.linear_shapes().values()) * DTYPE_BYTES[s.weight_dtype]


def logprob_forward_bytes(shape: ModelShape, s: MemorySettings, rows: int, multi_adapter: bool = True) -> int:
    """The response log-prob forward at `rows` rows, at its peak (the division by the temperature): MA-PPO's
    fp32 logits (rows, R, V) and their divided copy, 8 bytes a value (the 16-bit logits they came from are freed
    before the division); the four-model engine's logits stay in the compute dtype, R + 1 positions, and their
    divided copy too. Plus the final hidden states (rows, P + R, h). H100, MA-PPO at 16 rows x 256 tokens x
    32,000: 1.015 GiB measured for the reference forward; this gives 1.016."""
    tokens = s.prompt_length + s.response_length
    wb = DTYPE_BYTES[s.weight_dtype]
    logits = (rows * s.response_length * shape.vocab_size * 8 if multi_adapter
              else rows * (s.response_length + 1) * shape.vocab_size * 2 * wb)
    return logits + rows * tokens * shape.hidden_size * wb


def layer_forward_bytes(shape: ModelShape, s: MemorySettings, rows: int, tokens: int) -> int:
    """A no-grad forward without a KV cache (the reward model's scoring): one decoder layer's values at a time,
    counted as what that layer would save for a backward (`layer_activation_values`, frozen) plus its mask."""
    frozen = layer_activation_values(shape, 1, ())  # a layer with no LoRA: 7h + 3i + heads + 2 values a token
    return rows * tokens * (frozen + tokens) * DTYPE_BYTES[s.weight_dtype]


def adamw_temporary_bytes(trainable_bytes: int) -> int:
    """AdamW's step (PyTorch's foreach implementation, the default on CUDA) makes a temporary the size of the
    trainable parameters (the second moment's square root, before it is divided in)."""
    return trainable_bytes


def ppo_need(plan: MemoryPlan, assumptions: DeviceAssumptions = DeviceAssumptions(), stage: str = "") -> StageNeed:
    """The PPO stage's need from its tensor plan (`plan_multi_adapter` or `plan_four_model`): the plan's weights,
    adapters and AdamW moments stay allocated (the gradients only exist inside the update); each phase's working
    set as in the module docstring. Measured on one H100 at 7B (above their start): sampling 2.50-2.55 GiB,
    log-probs 1.02, scoring 0.54, the first update 1.0 (its gradients and AdamW's moments created). Taught in
    chapter 15."""
    shape, s = plan.shape, plan.settings
    tokens = s.prompt_length + s.response_length
    dq = dequant_buffer_bytes(shape, s)
    multi_adapter = plan.architecture.startswith("MA-PPO")
    backward = s.micro_batch_size * s.response_length * shape.vocab_size * 4
    resident = plan.parts["weights"] + plan.parts["adapters"] + plan.parts["optimizer"] + assumptions.workspaces
    gradients = plan.parts["gradients"]
    kv = plan.parts["kv_cache"]
    working = {"sampling": kv + kv // shape.num_layers + (0 if s.merged_rollout else dq),  # a dense copy samples
               "log-probs": logprob_forward_bytes(shape, s, s.forward_batch_size, multi_adapter),
               "scoring": layer_forward_bytes(shape, s, s.forward_batch_size, tokens) + dq,
               "update": (gradients + adamw_temporary_bytes(gradients) + plan.parts["activations"] + plan.recompute
                          + backward + dq)}
    name = stage or ("ma-ppo" if multi_adapter else "ppo")
    return StageNeed(name + (" (merged)" if s.merged_rollout else ""), resident, working, assumptions)


@dataclass(frozen=True)
class TrlStage:
    """What memory and disk need of an SFT or reward-model stage's trl configuration."""

    lora_r: int
    lora_targets: tuple[str, ...]
    batch_size: int                  # per_device_train_batch_size
    max_length: int
    gradient_checkpointing: bool
    load_in_4bit: bool
    double_quant: bool
    eval_batch_size: int = 0         # reward model: per_device_eval_batch_size (its held-out scoring)
    save_total_limit: int | None = None
    weight_dtype: str = "bfloat16"

    @classmethod
    def from_parsed(cls, training_args, model_args) -> "TrlStage":
        """From a stage's parsed `SFTConfig` / `RewardConfig` and trl `ModelConfig`."""
        dtype = model_args.dtype if model_args.dtype in DTYPE_BYTES else "bfloat16"
        targets = model_args.lora_target_modules
        if targets in ("all-linear", ["all-linear"]):
            targets = ALL_LINEAR
        elif not targets:  # peft's default for Llama-style models
            targets = ("q_proj", "v_proj")
        if training_args.max_length is None:
            raise ConfigError("the stage's max_length is unset: set it (the 7B recipe uses 320) so its memory can be "
                              "planned")
        return cls(lora_r=model_args.lora_r if model_args.use_peft else 0,
                   lora_targets=tuple(m for m in ALL_LINEAR if m in targets),
                   batch_size=training_args.per_device_train_batch_size, max_length=training_args.max_length,
                   gradient_checkpointing=bool(training_args.gradient_checkpointing),
                   load_in_4bit=bool(model_args.load_in_4bit), double_quant=bool(model_args.use_bnb_nested_quant),
                   eval_batch_size=getattr(training_args, "per_device_eval_batch_size", 0),
                   save_total_limit=training_args.save_total_limit, weight_dtype=dtype)

    def settings(self) -> MemorySettings:
        return MemorySettings(weight_dtype=self.weight_dtype, load_in_4bit=self.load_in_4bit,
                              double_quant=self.double_quant, micro_batch_size=self.batch_size,
                              prompt_length=self.max_length, response_length=0,
                              gradient_checkpointing=self.gradient_checkpointing)


def trl_trainable_bytes(shape: ModelShape, t: TrlStage, head_bytes: int) -> int:
    """Bytes of a trl LoRA stage's trainables: the LoRA matrices (fp32) and a head's trainable copy."""
    if t.lora_r <= 0:
        raise ConfigError("the stage plans cover LoRA stages (use_peft: true), as the 7B recipe trains them")
    return shape.num_layers * lora_params(shape, t.lora_r, t.lora_targets) * 4 + head_bytes


def _trl_resident(shape: ModelShape, t: TrlStage, lm_head: bool, trainable: int, frozen_head: int,
                  a: DeviceAssumptions) -> int:
    """What stays allocated: the base, its trainables and a frozen head, AdamW's two moments, the workspaces."""
    s = t.settings()
    return (base_weight_bytes(shape, s, lm_head=lm_head) + frozen_head + trainable
            + optimizer_bytes(trainable, 0, "adamw") + a.workspaces)


def _train_working(shape: ModelShape, t: TrlStage, rows: int, trainable: int) -> int:
    """One training micro-batch of `rows` rows of `max_length` tokens: its gradients and AdamW's temporary; with
    checkpointing the layer inputs and one layer recomputed, else every layer's saved values; the final hidden
    states; the dequantized weight of an NF4 base."""
    s, T, ab = t.settings(), t.max_length, DTYPE_BYTES[t.weight_dtype]
    layer = layer_activation_values(shape, t.lora_r, t.lora_targets) + T
    if t.gradient_checkpointing:
        saved = rows * T * (shape.num_layers * shape.hidden_size + shape.hidden_size + 1) * ab + rows * T * layer * ab
    else:
        saved = rows * T * shape.num_layers * layer * ab
    return trainable + adamw_temporary_bytes(trainable) + saved + rows * T * shape.hidden_size * ab + \
        dequant_buffer_bytes(shape, s)


def plan_sft_stage(shape: ModelShape, t: TrlStage, assumptions: DeviceAssumptions = DeviceAssumptions()) -> StageNeed:
    """SFT: the causal LM with its LoRA. trl 1.x scores the answer tokens through a fused LM head, a tile of
    positions at a time, so no (rows, T, V) logits tensor exists (a tile is left out)."""
    trainable = trl_trainable_bytes(shape, t, 0)
    return StageNeed("sft", _trl_resident(shape, t, True, trainable, 0, assumptions),
                     {"update": _train_working(shape, t, t.batch_size, trainable)}, assumptions)


def plan_rm_stage(shape: ModelShape, t: TrlStage, assumptions: DeviceAssumptions = DeviceAssumptions()) -> StageNeed:
    """The reward model: backbone, LoRA and a scalar score head (peft's trainable copy in fp32, the frozen
    original in the compute dtype); chosen and rejected answers in one forward (2 x batch rows); its held-out
    scoring at `eval_batch_size` rows."""
    s = t.settings()
    trainable = trl_trainable_bytes(shape, t, shape.hidden_size * 4)
    frozen_head = shape.hidden_size * DTYPE_BYTES[t.weight_dtype]
    working = {"update": _train_working(shape, t, 2 * t.batch_size, trainable)}
    if t.eval_batch_size:
        working["eval"] = layer_forward_bytes(shape, s, t.eval_batch_size, t.max_length) + dequant_buffer_bytes(shape, s)
    return StageNeed("rm", _trl_resident(shape, t, False, trainable, frozen_head, assumptions), working, assumptions)


def trl_output_bytes(trainable: int, checkpoints: int, exported: int = 0) -> int:
    """A LoRA stage's output folder (trl's, or the PPO engine's) holding `checkpoints` checkpoints: the final
    adapter, and in each checkpoint the adapter and AdamW's two moments (3 x the trainable bytes) and `exported`
    bytes more (the PPO engine's copy of the policy adapter in each checkpoint)."""
    return trainable + checkpoints * (3 * trainable + exported)


def held_checkpoints(save_total_limit: int | None) -> int:
    """Checkpoints on disk at the fullest: the limit, and the one being written before the oldest is deleted. An
    unset limit keeps every checkpoint; it is counted as one, so the total is then a floor."""
    return (save_total_limit or 1) + 1


def run_disk(shape: ModelShape, checkpoint_dtype: str = "float16", sft: TrlStage | None = None,
             rm: TrlStage | None = None, ppo_trainable: int = 0) -> dict[str, int]:
    """Bytes on disk of a run at its fullest: the base checkpoint as downloaded, the SFT adapter merged into a copy
    of it (the model cache, read by the reward and PPO stages), each stage's output folder (PPO keeps its newest
    two checkpoints, trainables, AdamW state and the policy adapter, writes a third before deleting the oldest,
    and exports the policy adapter; the policy adapter is counted as all the trainable bytes, which with a value
    adapter over-plans it by that adapter). H100, one step per stage: the base and the merged copy 12.55 GiB each, the SFT and RM folders with
    one checkpoint each 1.50 GiB together."""
    params = shape.n_params * DTYPE_BYTES[checkpoint_dtype]
    disk = {"base checkpoint": params}
    if sft is not None:
        disk["SFT merged into a copy of the base"] = params
        disk["sft output"] = trl_output_bytes(trl_trainable_bytes(shape, sft, 0), held_checkpoints(sft.save_total_limit))
    if rm is not None:
        disk["rm output"] = trl_output_bytes(trl_trainable_bytes(shape, rm, shape.hidden_size * 4),
                                             held_checkpoints(rm.save_total_limit))
    if ppo_trainable:
        disk["ppo output"] = trl_output_bytes(ppo_trainable, held_checkpoints(2), exported=ppo_trainable)
    disk["total"] = sum(disk.values())
    return disk


def need_table(needs: list[StageNeed], marked=()) -> str:
    """One row a stage: allocated peak (and the phase that sets it), reserved, device; an asterisk marks the stages
    in `marked`."""
    a = needs[0].assumptions if needs else DeviceAssumptions()
    rows = [f"  {'stage':25s} {'allocated':>10s} {'reserved':>10s} {'device':>10s}  peak in"]
    for n in needs:
        star = "*" if any(n is m for m in marked) else " "
        rows.append(f"  {star}{n.stage:24s} {_fmt(n.allocated):>10s} {_fmt(n.reserved):>10s} {_fmt(n.device):>10s}  "
                    f"{n.peak_phase}")
    rows.append(f"  reserved = allocated + {a.cache_slack / GIB:.1f} GiB of cache slack (H100: 0.72-1.31)")
    rows.append(f"  device = reserved + {a.outside_allocator / GIB:.1f} GiB outside the allocator (H100: 0.67-0.78)")
    return "\n".join(rows)
