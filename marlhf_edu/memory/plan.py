"""Planning memory: the bytes PPO's models will hold, before anything is loaded.

For a model shape (`ModelShape`: tiny, Llama-2-7B, …) and a recipe
(`MemorySettings`: weight dtype or NF4 ± double quantization, LoRA rank and
target modules per adapter, value mode, optimizer, batch and sequence lengths),
`plan_four_model` and `plan_multi_adapter` return a `MemoryPlan`::

    weights    base weights: four copies (actor, critic backbone, reference, reward
               backbone) or one shared base
    adapters   LoRA matrices r·(d_in + d_out) per targeted linear layer, value and score heads
    gradients  one per trainable parameter, in its dtype
    optimizer  AdamW: two moments per trainable parameter, in its dtype (torch keeps them there)
    kv_cache   2 · L · B_fwd · (P + R) · n_kv · d_head values, while sampling
    logits     B · (R + 1) · V fp32 values: the largest logits tensor of a forward
               (only the last R + 1 positions reach the LM head)
    activations what autograd keeps for the backward of one micro-batch of the update
               (`forward_activation_bytes`), with or without gradient checkpointing

`MemoryPlan.peak` is the model state plus the larger of the two working sets, sampling or update.

NF4 stores two weights per byte, plus per block of 64 weights an absmax:
fp32 (4 B) plainly, or with double quantization one byte, itself quantized in
blocks of 256 with fp32 scales. Embeddings, the LM head and norms are never
quantized; they keep `weight_dtype`. Per block of 64 weights that is
32 + 4 = 36 B (0.5625 B/weight) or 32 + 1 + 4/256 ≈ 33.02 B (0.516 B/weight).

The four-model plan puts each role on its own copy of the base under the same
recipe (same weight format; the critic trains a LoRA when the actor does), so
the two columns differ only in architecture. `plan_lora_ppo` is the fairer
baseline: LoRA PPO as trl 0.11 and MA-RLHF run it, whose reference is already
the policy's base with the adapter disabled. `rank 0` means "train every weight"
(four-model only). `plan_grpo_lora` and `plan_dpo_lora` (chapter 12) plan the two critic-free contrasts on
the same footing. Taught in chapter 10; checked against `state_bytes_by_kind`
within 10 % on the tiny models and per layer at Llama-2-7B width.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field, replace

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.quantization import NF4_COMPUTE_DTYPES
from marlhf_edu.loading.assets import SFT_DIR
from marlhf_edu.loading.sources import readable_checkpoint, resolve_model, resolve_zoo
from marlhf_edu.ppo.config import DEFAULT_ADAPTER_RANK

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Optimizer state bytes per byte of trainable parameter.
OPTIMIZER_STATE_FACTOR = {"adamw": 2.0, "adamw_8bit": None, "sgd": 0.0}
NF4_CODE_BYTES = 16 * 4          # the 16-entry NF4 code table, fp32, per quantized weight
DOUBLE_QUANT_CODE_BYTES = 256 * 4  # the 8-bit code table of the nested quantization
DOUBLE_QUANT_BLOCK = 256


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that decide its memory."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int = 0            # 0 = num_heads (no grouped-query attention)
    head_dim: int = 0                # 0 = hidden_size // num_heads
    tie_word_embeddings: bool = False

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each linear layer in one decoder layer."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.dim_head, self.kv_heads * self.dim_head
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def n_params(self) -> int:
        """Parameters of the causal LM (embeddings, layers, final norm, LM head unless tied)."""
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * per_layer + self.hidden_size + head

    def with_layers(self, n: int) -> "ModelShape":
        return replace(self, name=f"{self.name} ({n} layers)", num_layers=n)

    @classmethod
    def from_config(cls, config, name: str = "") -> "ModelShape":
        """From a transformers config object or its dict (config.json)."""
        c = config if isinstance(config, dict) else config.to_dict()
        return cls(name=name or c.get("_name_or_path") or c.get("model_type", "model"), vocab_size=c["vocab_size"],
                   hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                   num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
                   num_kv_heads=c.get("num_key_value_heads") or 0, head_dim=c.get("head_dim") or 0,
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))

    @classmethod
    def resolve(cls, name_or_path: str) -> "ModelShape":
        """A preset name ('llama-2-7b', 'tiny', a known hub id) or a directory / config.json on disk."""
        if name_or_path == "tiny":  # the planner's name for the shipped tiny model
            name_or_path = "zoo"
        name_or_path = resolve_zoo(name_or_path)
        if name_or_path in PRESETS:
            return PRESETS[name_or_path]
        path = pathlib.Path(name_or_path)
        if not name_or_path.endswith(".json"):  # a model directory, GGUF file, adapter, hub id, ...
            # a folder, an adapter's recorded base or a cached hub model is read as it is: merging an adapter into
            # a 7B base (tens of seconds, 13.5 GB) only to read its shape is not what a planner should do
            readable = readable_checkpoint(name_or_path)
            if readable is not None and (readable / "config.json").exists():
                path = readable
            else:
                try:
                    path = pathlib.Path(resolve_model(name_or_path))
                except (OSError, ValueError):  # not a model reference either: the error below names the choices
                    pass
        path = path / "config.json" if path.is_dir() else path
        if path.name == "config.json" and path.exists():
            label = "tiny" if path.parent == SFT_DIR else path.parent.name
            return cls.from_config(json.loads(path.read_text()), name=label)
        raise ConfigError(f"model shape {name_or_path!r}: not a preset ({', '.join(sorted(PRESETS))}) and no "
                          f"config.json found there; pass --model_shape with one of those or a model directory")


LLAMA_2_7B = ModelShape("llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                        num_heads=32)
PRESETS = {"llama-2-7b": LLAMA_2_7B, "hf:meta-llama/Llama-2-7b-hf": LLAMA_2_7B, "meta-llama/Llama-2-7b-hf": LLAMA_2_7B}


@dataclass
class MemorySettings:
    """A PPO recipe, as far as memory is concerned."""

    weight_dtype: str = "float32"      # unquantized weights and compute (bfloat16 on GPU)
    load_in_4bit: bool = False         # NF4 linear layers in the decoder
    double_quant: bool = True
    quant_blocksize: int = 64
    policy_lora_r: int = 16            # 0 = train every weight of the actor (four-model only)
    value_lora_r: int = 16             # critic / value adapter; 0 = train the whole critic (four-model only)
    reward_lora_r: int = 16
    policy_targets: tuple[str, ...] = ALL_LINEAR
    value_targets: tuple[str, ...] = ALL_LINEAR
    reward_targets: tuple[str, ...] = ALL_LINEAR
    value_mode: str = "adapter"        # multi-adapter: 'shared' (head on the policy) or 'adapter' (own LoRA)
    adapter_dtype: str = "float32"     # peft keeps LoRA weights in fp32 under a 4-bit or bf16 base
    optimizer: str = "adamw"           # 'adamw', 'adamw_8bit' (bitsandbytes, 2 × 1 B + scales) or 'sgd'
    forward_batch_size: int = 64       # rows per sampling / no-grad forward (KV cache, logits)
    micro_batch_size: int = 16         # rows per training forward/backward
    prompt_length: int = 64
    response_length: int = 32
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward
    critic: str = "separate"           # four-model: 'separate' (own backbone) or 'shared_head' (head on the actor)
    merged_rollout: bool = False       # a dense copy of the policy, LoRA merged, samples the rollouts
    merged_reward: bool = False        # four-model: the reward LoRA merged into its own base (one head, no adapter);
                                       # multi-adapter: into the merged_rollout copy, no memory of its own
    nf4_dequantize_once: bool = False  # multi-adapter, CPU: each 4-bit layer keeps its weight dequantized
    nf4_compute_dtype: str = "auto"    # the 4-bit layers' compute dtype ('auto' = weight_dtype)
    onednn_matmuls: bool = False       # CPU: frozen fp32 weights also held reordered for oneDNN

    def validate(self) -> "MemorySettings":

        for name in ("weight_dtype", "adapter_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ConfigError(f"{name} must be one of {sorted(DTYPE_BYTES)}, got {getattr(self, name)!r}")
        if self.optimizer not in OPTIMIZER_STATE_FACTOR:
            raise ConfigError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_FACTOR)}, got {self.optimizer!r}")
        if self.nf4_compute_dtype not in NF4_COMPUTE_DTYPES:
            raise ConfigError(f"nf4_compute_dtype must be one of {NF4_COMPUTE_DTYPES}, got {self.nf4_compute_dtype!r}")
        if self.critic not in ("separate", "shared_head"):
            raise ConfigError(f"critic must be 'separate' or 'shared_head', got {self.critic!r}")
        if self.value_mode not in ("shared", "adapter"):
            raise ConfigError(f"value_mode must be 'shared' or 'adapter', got {self.value_mode!r}")
        for name in ("policy_targets", "value_targets", "reward_targets"):
            unknown = set(getattr(self, name)) - set(ALL_LINEAR)
            if unknown:
                raise ConfigError(f"{name}: unknown module(s) {sorted(unknown)}; choose from {ALL_LINEAR}")
        return self

    @classmethod
    def from_ppo_config(cls, config, *, reward_lora_r: int, reward_targets, weight_dtype: str = "float32",
                        optimizer: str = "adamw", prompt_length: int = 0) -> "MemorySettings":
        """The recipe of a `PPOConfig`: LoRA rank `actor_lora_r` for policy and value (as both engines build
        them), the reward adapter's own rank and targets, batch and sequence lengths of the run."""
        targets = tuple(config.lora_target_modules)
        return cls(weight_dtype=weight_dtype, load_in_4bit=config.load_in_4bit, double_quant=config.double_quant,
                   policy_lora_r=config.actor_lora_r, value_lora_r=config.actor_lora_r, reward_lora_r=reward_lora_r,
                   policy_targets=targets, value_targets=targets, reward_targets=tuple(reward_targets),
                   value_mode=config.value_mode, optimizer=optimizer,
                   gradient_checkpointing=config.gradient_checkpointing, critic=config.critic,
                   merged_rollout=config.merged_rollout,
                   merged_reward=config.merged_reward,
                   nf4_dequantize_once=config.nf4_dequantize_once, nf4_compute_dtype=config.nf4_compute_dtype,
                   onednn_matmuls=config.onednn_matmuls,
                   forward_batch_size=min(config.forward_batch_size, config.batch_size),
                   micro_batch_size=config.micro_batch_size, prompt_length=prompt_length or config.max_prompt_length,
                   response_length=config.max_new_tokens)


def saved_lora_recipe(adapter_dir) -> tuple[int, tuple[str, ...]] | None:
    """`(rank, target modules)` of a saved LoRA adapter (its adapter_config.json), or None if there is none."""
    path = pathlib.Path(adapter_dir) / "adapter_config.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return saved["r"], tuple(m for m in ALL_LINEAR if m in saved["target_modules"])




def linear_weight_bytes(d_in: int, d_out: int, s: MemorySettings) -> int:
    """One linear layer's weight: `weight_dtype`, or NF4 (packed nibbles + absmax + code tables)."""
    n = d_in * d_out
    if not s.load_in_4bit:
        return n * DTYPE_BYTES[s.weight_dtype]
    blocks = math.ceil(n / s.quant_blocksize)
    if s.double_quant:  # absmax as 8-bit codes, one fp32 offset, fp32 scales per 256 of them, an 8-bit code table
        constants = blocks + 4 + 4 * math.ceil(blocks / DOUBLE_QUANT_BLOCK) + DOUBLE_QUANT_CODE_BYTES
    else:
        constants = 4 * blocks
    return (n + 1) // 2 + constants + NF4_CODE_BYTES


def lora_params(shape: ModelShape, r: int, targets) -> int:
    """LoRA parameters in one decoder layer: r · (d_in + d_out) per targeted linear layer."""
    return sum(r * (a + b) for name, (a, b) in shape.linear_shapes().items() if name in targets)


def layer_weight_bytes(shape: ModelShape, s: MemorySettings) -> int:
    """One decoder layer of the base: its seven linear layers and two RMSNorm weights."""
    linears = sum(linear_weight_bytes(a, b, s) for a, b in shape.linear_shapes().values())
    return linears + 2 * shape.hidden_size * DTYPE_BYTES[s.weight_dtype]


def base_weight_bytes(shape: ModelShape, s: MemorySettings, lm_head: bool = True, buffers: bool = True) -> int:
    """A whole base: embeddings, layers, final norm, the LM head (a critic or reward backbone has none)
    and the rotary-frequency buffers (two fp32 vectors of d_head / 2, not parameters)."""
    wb = DTYPE_BYTES[s.weight_dtype]
    head = shape.vocab_size * shape.hidden_size * wb if lm_head and not shape.tie_word_embeddings else 0
    rotary = 2 * (shape.dim_head // 2) * 4 if buffers else 0
    return (shape.vocab_size * shape.hidden_size * wb + shape.num_layers * layer_weight_bytes(shape, s)
            + shape.hidden_size * wb + head + rotary)


def optimizer_bytes(trainable_bytes: int, n_trainable: int, optimizer: str) -> int:
    if optimizer == "adamw_8bit":  # two uint8 moments + an fp32 scale per block of 256 for each
        return 2 * (n_trainable + 4 * math.ceil(n_trainable / 256))
    return int(OPTIMIZER_STATE_FACTOR[optimizer] * trainable_bytes)


def kv_cache_bytes(shape: ModelShape, batch: int, tokens: int, bytes_per_value: int) -> int:
    r"""Bytes of the KV cache with `batch` sequences of `tokens` tokens each in it.

    .. math:: 2 \cdot L \cdot B \cdot T \cdot n_{kv} \cdot d_{head} \cdot \text{bytes}

    Keys and values (the 2) of every layer and token, for the key/value heads only: with grouped-query attention
    `n_kv` is smaller than the number of query heads. Taught in chapter 15.
    """
    return 2 * shape.num_layers * batch * tokens * shape.kv_heads * shape.dim_head * bytes_per_value


def activation_bytes(shape: ModelShape, s: MemorySettings) -> dict[str, int]:
    """KV cache of one sampling batch and the largest logits tensor (fp32) of one forward."""
    wb = DTYPE_BYTES[s.weight_dtype]
    tokens = s.prompt_length + s.response_length
    kv = kv_cache_bytes(shape, s.forward_batch_size, tokens, wb)
    rows = max(s.forward_batch_size, s.micro_batch_size)
    return {"kv_cache": kv, "logits": rows * (s.response_length + 1) * shape.vocab_size * 4}


def layer_activation_values(shape: ModelShape, r: int, targets) -> int:
    """Values one decoder layer saves for the backward, per token (see `forward_activation_bytes`)."""
    h, i, n = shape.hidden_size, shape.intermediate_size, shape.num_heads
    if r == 0:  # every weight trains: each linear's input and each norm's normalised values are kept
        return 10 * h + 4 * i + n + 2
    values = 7 * h + 3 * i + n + 2  # what a backward must cross a frozen layer with
    values += r * sum(t in targets for t in ALL_LINEAR)  # the input of each LoRA B
    values += h if {"gate_proj", "up_proj"} & set(targets) else 0  # the MLP's normalised input, for their A
    values += i if "down_proj" in targets else 0  # SiLU(gate)·up, for down's A
    return values


def forward_activation_bytes(shape: ModelShape, s: MemorySettings, r: int, targets, *, lm_logits: bool,
                             value_head: bool) -> int:
    """Bytes autograd keeps for the backward of one training forward: `micro_batch_size` rows of P + R tokens,
    one model (the policy, or a critic / value adapter), called as the engine calls it (attention mask and
    position ids from the mask).

    Counted from what torch 2.13 saves for a Llama layer with sdpa attention (`saved_tensor_bytes` measures
    it exactly), per token and decoder layer, in the compute dtype:

      - a frozen layer that gradients must cross: 7h + 3i + n_heads + 2 (the norms' inputs and scales, q and k
        after RoPE, v, the attention output and its per-head log-sum-exp, the MLP's gate, up and SiLU outputs);
      - each LoRA target adds r (the input of its B); gate/up add h (their A's input), down adds i;
      - full fine-tuning (r = 0): 10h + 4i + n_heads + 2;
      - the padding mask the attention keeps: T values (a batch with padding, the usual case).

    Exact for target sets that include q_proj (every recipe in the book); others save a little less in layer 0.
    Outside the layers: RoPE's cos and sin (2 · d_head) and a value head's input (h). The final norm's input
    takes the place of layer 0's, which comes from the frozen embedding and is not kept. Full fine-tuning adds
    layer 0's input and the final norm's normalised values (2h + 1), the token ids (8 B) and the LM head's
    input at the R + 1 positions it is applied to. The log-softmax over the R response positions keeps its fp32
    logits (B·R·V·4), the int64 labels and fp32 log-sum-exp (B·R·12).

    With gradient checkpointing (`marlhf_edu.ppo.checkpointing`) each layer keeps only its input, layer 0's
    included (L·h per token), plus the final norm's input and 1/rms (h + 1); the mask and RoPE tables stay
    alive through the checkpoint, not as saved tensors (one copy per forward, not per layer, and not counted
    here). One layer's activations exist again while it is recomputed in the backward: `recompute_bytes`, part
    of `MemoryPlan.peak`.
    """
    ab, h, L = DTYPE_BYTES[s.weight_dtype], shape.hidden_size, shape.num_layers
    rows, R = s.micro_batch_size, s.response_length
    tokens = s.prompt_length + s.response_length
    if s.gradient_checkpointing:
        per_token = L * h + h + 1 + (h if r == 0 else 0)  # + the final norm's normalised values when it trains
    else:
        per_token = L * (layer_activation_values(shape, r, targets) + tokens) + 2 * shape.dim_head
        per_token += 2 * h + 1 if r == 0 else 0
    per_token += h if value_head else 0
    nbytes = rows * tokens * (per_token * ab + (8 if r == 0 else 0))
    if r == 0 and lm_logits:
        nbytes += rows * (R + 1) * h * ab  # the LM head's input (its weight trains)
    if lm_logits:
        nbytes += rows * R * (shape.vocab_size * 4 + 12)
    return nbytes


def recompute_bytes(shape: ModelShape, s: MemorySettings, r: int, targets) -> int:
    """With gradient checkpointing: the activations of the one decoder layer being recomputed in the backward
    (`micro_batch_size` rows of P + R tokens, see `forward_activation_bytes`); 0 without it."""
    if not s.gradient_checkpointing:
        return 0
    tokens = s.prompt_length + s.response_length
    values = layer_activation_values(shape, r, targets) + tokens
    return s.micro_batch_size * tokens * values * DTYPE_BYTES[s.weight_dtype]




def merged_rollout_bytes(shape: ModelShape, s: MemorySettings) -> int:
    """The dense sampling copy of `merged_rollout` (`marlhf_edu.ppo.merged_rollout`): every weight of the model
    in the compute dtype, however the base is stored (an NF4 base is dequantized into it); 0 when off."""
    return base_weight_bytes(shape, replace(s, load_in_4bit=False)) if s.merged_rollout else 0


def dequantized_once_bytes(shape: ModelShape, s: MemorySettings) -> tuple[int, int]:
    """`nf4_dequantize_once` (`marlhf_edu.loading.quantization.dequantize_once`): every 4-bit linear weight again,
    dense in the layers' compute dtype, beside its NF4 form. `(whole model, one decoder layer)`; 0 when off."""
    if not (s.nf4_dequantize_once and s.load_in_4bit):
        return 0, 0
    dtype = s.weight_dtype if s.nf4_compute_dtype == "auto" else s.nf4_compute_dtype
    layer = sum(a * b for a, b in shape.linear_shapes().values()) * DTYPE_BYTES[dtype]
    return shape.num_layers * layer, layer


def onednn_bytes(shape: ModelShape, s: MemorySettings, engine: str = "multi-adapter") -> tuple[int, int]:
    """`onednn_matmuls` (`marlhf_edu.loading.onednn`): the frozen fp32 weights held again, reordered for oneDNN.
    `(whole model, one decoder layer)`; 0 when off. Either engine: the `merged_rollout` copy's linear weights and
    head once (it has no backward).

    multi-adapter: the base's linear weights twice (W, and Wᵀ for the input gradient), which with an NF4 base
    replace `nf4_dequantize_once`'s dense copy (so once more than it); the LM head twice. With an NF4 base the
    plan's "4-bit layers dequantized once" line still counts the first of the two reordered copies (W), this term
    the second (Wᵀ): the sum is what the layers hold.

    four-model: the reference's linear weights and LM head, the reward model's linear weights (its LoRA's too,
    unless merged) and score head, each once (no gradient flows through either); the actor and critic keep their
    own products."""
    if engine not in ("multi-adapter", "four-model"):
        raise ValueError(f"onednn_bytes: engine must be 'multi-adapter' or 'four-model', got {engine!r}")
    if not s.onednn_matmuls:
        return 0, 0
    linear = sum(a * b for a, b in shape.linear_shapes().values()) * DTYPE_BYTES["float32"]
    head = shape.vocab_size * shape.hidden_size * DTYPE_BYTES["float32"]
    # a fully trained four-model actor has no merged copy (`plan_four_model` plans none)
    has_copy = s.merged_rollout and (engine == "multi-adapter" or s.policy_lora_r > 0)
    copy_layer, copy_head = (linear, head) if has_copy else (0, 0)
    if engine == "four-model":
        reward_lora = 0 if s.merged_reward else lora_params(shape, s.reward_lora_r, s.reward_targets)
        layer = 2 * linear + reward_lora * DTYPE_BYTES["float32"] + copy_layer
        return shape.num_layers * layer + head + shape.hidden_size * DTYPE_BYTES["float32"] + copy_head, layer
    layer = linear * (1 if s.load_in_4bit and s.nf4_dequantize_once else 2) + copy_layer
    return shape.num_layers * layer + 2 * head + copy_head, layer


def _add_rollout_copy(parts: dict, per_model: dict, per_layer: dict, shape: ModelShape, s: MemorySettings) -> None:
    copy = merged_rollout_bytes(shape, s)
    if copy:
        parts["weights"] += copy
        per_layer["weights"] += layer_weight_bytes(shape, replace(s, load_in_4bit=False))
        per_model["rollout copy (merged)"] = copy


def _add_reordered(parts: dict, per_model: dict, per_layer: dict, reordered: int, reordered_layer: int) -> None:
    if reordered:
        parts["weights"] += reordered
        per_layer["weights"] += reordered_layer
        per_model["weights reordered for oneDNN"] = reordered


PARTS = ("weights", "adapters", "gradients", "optimizer", "kv_cache", "logits", "activations")
STATE_PARTS = ("weights", "adapters", "gradients", "optimizer")


@dataclass
class MemoryPlan:
    """Planned bytes of one architecture under one recipe."""

    architecture: str
    shape: ModelShape
    settings: MemorySettings
    parts: dict[str, int]                          # PARTS → bytes
    per_model: dict[str, int]                      # weights + adapters held by each role
    per_layer: dict[str, int] = field(default_factory=dict)  # STATE_PARTS of one decoder layer
    trainable_params: int = 0
    activations_checkpointed: int = 0              # activations + recompute had the layers been checkpointed
    recompute: int = 0                             # one layer recomputed in the backward (checkpointing only)

    @property
    def model_state(self) -> int:
        """Weights + adapters + gradients + optimizer: what stays allocated for the whole run."""
        return sum(self.parts[k] for k in STATE_PARTS)

    @property
    def total(self) -> int:
        """Every part added up. An upper bound: the rollout's KV cache and the update's activations never coexist."""
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        """Model state plus the larger working set: sampling (KV cache + logits) or one micro-batch of the update
        (its saved activations, the layer being recomputed when checkpointing, and the fp32 gradient of its response
        log-softmax, the largest tensor of the backward)."""
        s = self.settings
        backward = s.micro_batch_size * s.response_length * self.shape.vocab_size * 4
        return self.model_state + max(self.parts["kv_cache"] + self.parts["logits"],
                                      self.parts["activations"] + self.recompute + backward)


def _trainable(parts: dict, per_layer: dict, trainable_bytes: int, layer_trainable_bytes: int, n: int, n_layer: int,
               s: MemorySettings) -> None:
    parts["gradients"], per_layer["gradients"] = trainable_bytes, layer_trainable_bytes
    parts["optimizer"] = optimizer_bytes(trainable_bytes, n, s.optimizer)
    per_layer["optimizer"] = optimizer_bytes(layer_trainable_bytes, n_layer, s.optimizer)


def _update_activations(shape: ModelShape, s: MemorySettings, forwards) -> dict:
    """Activations of one update micro-batch: `forwards` lists each model's training forward as
    (rank, targets, lm_logits, value_head). Returns the `MemoryPlan` fields: `activations` (saved, as configured),
    `recompute` (the largest layer recomputed in the backward, one at a time) and `activations_checkpointed`
    (saved + recompute with checkpointing, for comparison)."""
    def saved(settings):
        return sum(forward_activation_bytes(shape, settings, r, t, lm_logits=lm, value_head=v) for r, t, lm, v in forwards)

    def recompute(settings):
        return max(recompute_bytes(shape, settings, r, t) for r, t, _, _ in forwards)

    ckpt = replace(s, gradient_checkpointing=True)
    return {"activations": saved(s), "recompute": recompute(s),
            "activations_checkpointed": saved(ckpt) + recompute(ckpt)}


def plan_four_model(shape: ModelShape, s: MemorySettings) -> MemoryPlan:
    """Actor, critic (backbone + value head), reference and reward model (backbone + LoRA + score head, or with
    `merged_reward` backbone + head), each on its own copy of the base."""

    s.validate()
    if s.load_in_4bit and (s.policy_lora_r == 0 or s.value_lora_r == 0):
        raise ConfigError("a 4-bit model cannot be trained in full: set policy and value LoRA ranks > 0")
    wb, ab, h = DTYPE_BYTES[s.weight_dtype], DTYPE_BYTES[s.adapter_dtype], shape.hidden_size
    full_lm, backbone = base_weight_bytes(shape, s), base_weight_bytes(shape, s, lm_head=False)
    layer = layer_weight_bytes(shape, s)
    lora = {role: lora_params(shape, r, t) for role, r, t in (("policy", s.policy_lora_r, s.policy_targets),
                                                              ("value", s.value_lora_r, s.value_targets),
                                                              ("reward", s.reward_lora_r, s.reward_targets))}
    value_head = (h + 1) * 4                      # nn.Linear(h, 1) in fp32
    reward_heads = 2 * h * wb                     # the score head and peft's trainable copy (modules_to_save)
    if s.merged_reward:  # merge_and_unload: W + BA in the base, the trained head copy replaces the original
        if s.load_in_4bit:
            raise ConfigError("merged_reward merges the reward LoRA into dense weights; a 4-bit base cannot hold it")
        lora["reward"], reward_heads = 0, h * wb
    shared = s.critic == "shared_head"  # a value head on the actor: no critic backbone, no value LoRA
    if shared:
        lora["value"] = 0
    adapters_layer = sum(lora.values()) * ab
    per_model = {"actor": full_lm + shape.num_layers * lora["policy"] * ab,
                 "critic": (0 if shared else backbone + shape.num_layers * lora["value"] * ab) + value_head,
                 "reference": full_lm,
                 "reward": backbone + shape.num_layers * lora["reward"] * ab + reward_heads}
    parts = {"weights": 2 * full_lm + (1 if shared else 2) * backbone,
             "adapters": shape.num_layers * adapters_layer + value_head + reward_heads}
    per_layer = {"weights": (3 if shared else 4) * layer, "adapters": adapters_layer}
    # trainable: each of actor and critic trains its LoRA, or (rank 0) every weight it has
    n, n_layer, nbytes, nbytes_layer = 0, 0, 0, 0
    roles = (("policy", s.policy_lora_r, base_weight_bytes(shape, s, buffers=False)),) + (() if shared else (
        ("value", s.value_lora_r, base_weight_bytes(shape, s, lm_head=False, buffers=False)),))
    for role, r, model_bytes in roles:
        if r > 0:
            n += shape.num_layers * lora[role]; n_layer += lora[role]
            nbytes += shape.num_layers * lora[role] * ab; nbytes_layer += lora[role] * ab
        else:
            n += model_bytes // wb; n_layer += layer // wb
            nbytes += model_bytes; nbytes_layer += layer
    n += h + 1; nbytes += value_head
    _trainable(parts, per_layer, nbytes, nbytes_layer, n, n_layer, s)
    parts.update(activation_bytes(shape, s))
    forwards = ([(s.policy_lora_r, s.policy_targets, True, True)] if shared else
                [(s.policy_lora_r, s.policy_targets, True, False), (s.value_lora_r, s.value_targets, False, True)])
    act = _update_activations(shape, s, forwards)
    parts["activations"] = act.pop("activations")
    if s.policy_lora_r > 0:  # a fully trained actor already samples from dense weights (the engine refuses both)
        _add_rollout_copy(parts, per_model, per_layer, shape, s)
    _add_reordered(parts, per_model, per_layer, *onednn_bytes(shape, s, "four-model"))
    return MemoryPlan("four-model", shape, s, parts, per_model, per_layer, n, **act)


def plan_multi_adapter(shape: ModelShape, s: MemorySettings) -> MemoryPlan:
    """One base; `policy` LoRA (+ `value` LoRA in adapter mode) trainable, `reward` LoRA and score head frozen,
    the reference = the base with adapters disabled (no bytes of its own)."""

    s.validate()
    if s.policy_lora_r <= 0 or (s.value_mode == "adapter" and s.value_lora_r <= 0):
        raise ConfigError("multi-adapter PPO trains LoRA adapters: policy (and, in adapter mode, value) rank must be > 0")
    ab, h = DTYPE_BYTES[s.adapter_dtype], shape.hidden_size
    base, layer = base_weight_bytes(shape, s), layer_weight_bytes(shape, s)
    policy = lora_params(shape, s.policy_lora_r, s.policy_targets)
    value = lora_params(shape, s.value_lora_r, s.value_targets) if s.value_mode == "adapter" else 0
    reward = lora_params(shape, s.reward_lora_r, s.reward_targets)
    value_head, reward_head = (h + 1) * 4, h * 4
    per_model = {"base (and reference)": base, "policy": shape.num_layers * policy * ab,
                 "value": shape.num_layers * value * ab + value_head,
                 "reward": shape.num_layers * reward * ab + reward_head}
    parts = {"weights": base, "adapters": shape.num_layers * (policy + value + reward) * ab + value_head + reward_head}
    per_layer = {"weights": layer, "adapters": (policy + value + reward) * ab}
    n_layer = policy + value
    n = shape.num_layers * n_layer + h + 1
    _trainable(parts, per_layer, shape.num_layers * n_layer * ab + value_head, n_layer * ab, n, n_layer, s)
    parts.update(activation_bytes(shape, s))
    shared = s.value_mode == "shared"
    forwards = [(s.policy_lora_r, s.policy_targets, True, shared)]
    if not shared:  # the value adapter's own forward
        forwards.append((s.value_lora_r, s.value_targets, False, True))
    act = _update_activations(shape, s, forwards)
    parts["activations"] = act.pop("activations")
    _add_rollout_copy(parts, per_model, per_layer, shape, s)
    dense, dense_layer = dequantized_once_bytes(shape, s)
    if dense:
        parts["weights"] += dense
        per_layer["weights"] += dense_layer
        per_model["4-bit layers dequantized once"] = dense
    _add_reordered(parts, per_model, per_layer, *onednn_bytes(shape, s))
    return MemoryPlan(f"MA-PPO ({s.value_mode})", shape, s, parts, per_model, per_layer, n, **act)


def plan_lora_ppo(shape: ModelShape, s: MemorySettings) -> MemoryPlan:
    """LoRA PPO as trl 0.11 with a peft model, and MA-RLHF's own LoRA PPO, run it: one policy base carrying the
    trainable `policy` LoRA and a value head on its last hidden state, the reference = that base with the
    adapter disabled, and the reward model as a second model (its own copy of the base, LoRA and score head).

    The fair baseline for MA-PPO: it already shares the policy's base with the reference; MA-PPO's one
    further saving is the reward model's base.
    """

    s.validate()
    if s.policy_lora_r <= 0:
        raise ConfigError("LoRA PPO trains a LoRA adapter: the policy rank must be > 0")
    wb, ab, h = DTYPE_BYTES[s.weight_dtype], DTYPE_BYTES[s.adapter_dtype], shape.hidden_size
    full_lm, backbone = base_weight_bytes(shape, s), base_weight_bytes(shape, s, lm_head=False)
    layer = layer_weight_bytes(shape, s)
    policy = lora_params(shape, s.policy_lora_r, s.policy_targets)
    reward = lora_params(shape, s.reward_lora_r, s.reward_targets)
    value_head = (h + 1) * 4                      # nn.Linear(h, 1) in fp32, on the policy's hidden state
    reward_heads = 2 * h * wb                     # the score head and peft's trainable copy (modules_to_save)
    per_model = {"policy base (and reference)": full_lm + shape.num_layers * policy * ab + value_head,
                 "reward": backbone + shape.num_layers * reward * ab + reward_heads}
    parts = {"weights": full_lm + backbone,
             "adapters": shape.num_layers * (policy + reward) * ab + value_head + reward_heads}
    per_layer = {"weights": 2 * layer, "adapters": (policy + reward) * ab}
    _trainable(parts, per_layer, shape.num_layers * policy * ab + value_head, policy * ab,
               shape.num_layers * policy + h + 1, policy, s)
    parts.update(activation_bytes(shape, s))
    act = _update_activations(shape, s, [(s.policy_lora_r, s.policy_targets, True, True)])
    parts["activations"] = act.pop("activations")
    _add_rollout_copy(parts, per_model, per_layer, shape, s)
    return MemoryPlan("LoRA PPO", shape, s, parts, per_model, per_layer, shape.num_layers * policy + h + 1, **act)


def plan_grpo_lora(shape: ModelShape, s: MemorySettings) -> MemoryPlan:
    """GRPO-LoRA: one base with the trainable `policy` LoRA, the reference = the base with the adapter disabled,
    and the frozen `reward` LoRA and score head on the same base (as MA-PPO holds them). No critic: MA-PPO in
    adapter mode less the value adapter, its head, their gradients and optimizer state and the value forward.
    `forward_batch_size` counts answers (prompts x group size). Taught in chapter 12."""

    s.validate()
    if s.policy_lora_r <= 0:
        raise ConfigError("GRPO-LoRA trains a LoRA adapter: the policy rank must be > 0")
    ab, h = DTYPE_BYTES[s.adapter_dtype], shape.hidden_size
    base, layer = base_weight_bytes(shape, s), layer_weight_bytes(shape, s)
    policy = lora_params(shape, s.policy_lora_r, s.policy_targets)
    reward = lora_params(shape, s.reward_lora_r, s.reward_targets)
    reward_head = h * 4
    per_model = {"base (and reference)": base, "policy": shape.num_layers * policy * ab,
                 "reward": shape.num_layers * reward * ab + reward_head}
    parts = {"weights": base, "adapters": shape.num_layers * (policy + reward) * ab + reward_head}
    per_layer = {"weights": layer, "adapters": (policy + reward) * ab}
    n = shape.num_layers * policy
    _trainable(parts, per_layer, n * ab, policy * ab, n, policy, s)
    parts.update(activation_bytes(shape, s))
    act = _update_activations(shape, s, [(s.policy_lora_r, s.policy_targets, True, False)])
    parts["activations"] = act.pop("activations")
    return MemoryPlan("GRPO-LoRA", shape, s, parts, per_model, per_layer, n, **act)


def plan_dpo_lora(shape: ModelShape, s: MemorySettings) -> MemoryPlan:
    """DPO with a LoRA: one base with the trainable `policy` LoRA, the reference = the base with the adapter
    disabled; no reward model and no sampling (no KV cache). A micro-batch of `micro_batch_size` rows is half
    chosen, half rejected answers, of `prompt_length + response_length` tokens. Taught in chapter 12."""

    s.validate()
    if s.policy_lora_r <= 0:
        raise ConfigError("DPO with a LoRA trains a LoRA adapter: the policy rank must be > 0")
    ab = DTYPE_BYTES[s.adapter_dtype]
    base, layer = base_weight_bytes(shape, s), layer_weight_bytes(shape, s)
    policy = lora_params(shape, s.policy_lora_r, s.policy_targets)
    per_model = {"base (and reference)": base, "policy": shape.num_layers * policy * ab}
    parts = {"weights": base, "adapters": shape.num_layers * policy * ab}
    per_layer = {"weights": layer, "adapters": policy * ab}
    n = shape.num_layers * policy
    _trainable(parts, per_layer, n * ab, policy * ab, n, policy, s)
    parts.update(activation_bytes(shape, s))
    parts["kv_cache"] = 0  # DPO never samples
    act = _update_activations(shape, s, [(s.policy_lora_r, s.policy_targets, True, False)])
    parts["activations"] = act.pop("activations")
    return MemoryPlan("DPO-LoRA", shape, s, parts, per_model, per_layer, n, **act)


def multi_adapter_settings(s: MemorySettings) -> MemorySettings:
    """`s` as `ma-ppo` builds it: rank 0 (full fine-tuning) becomes the default adapter rank."""
    return replace(s, policy_lora_r=s.policy_lora_r or DEFAULT_ADAPTER_RANK,
                   value_lora_r=s.value_lora_r or DEFAULT_ADAPTER_RANK)


def plan_both(shape: ModelShape, s: MemorySettings, lora_baseline: bool = False) -> dict[str, MemoryPlan]:
    """Four-model PPO and MA-PPO in both value modes under one recipe. With rank 0 (full fine-tuning,
    which MA-PPO cannot do) MA-PPO is planned with the rank `ma-ppo` builds then. `lora_baseline` adds
    `plan_lora_ppo` ("LoRA PPO", reference = disabled adapter) as the second column."""
    ma = multi_adapter_settings(s)
    plans = {"four-model": plan_four_model(shape, s)}
    if lora_baseline:
        plans["LoRA PPO"] = plan_lora_ppo(shape, ma)
    plans["MA-PPO shared"] = plan_multi_adapter(shape, replace(ma, value_mode="shared"))
    plans["MA-PPO adapter"] = plan_multi_adapter(shape, replace(ma, value_mode="adapter"))
    return plans


def _fmt(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def memory_table(plans: dict[str, MemoryPlan]) -> str:
    """A side-by-side text table: one column per plan, one row per part, the model state and its ratio to the
    first column's."""
    labels = list(plans)
    width = max(14, *(len(x) + 2 for x in labels))
    rows = [f"{'':22s}" + "".join(f"{x:>{width}s}" for x in labels)]
    for part in PARTS:
        rows.append(f"{part:22s}" + "".join(f"{_fmt(p.parts[part]):>{width}s}" for p in plans.values()))
        if part == "optimizer":
            rows.append(f"{'= model state':22s}" + "".join(f"{_fmt(p.model_state):>{width}s}" for p in plans.values()))
    rows.append(f"{'= peak':22s}" + "".join(f"{_fmt(p.peak):>{width}s}" for p in plans.values()))
    if any(p.settings.gradient_checkpointing for p in plans.values()):
        rows.append(f"{'(+ layer recomputed)':22s}" + "".join(f"{_fmt(p.recompute):>{width}s}" for p in plans.values()))
    else:
        rows.append(f"{'activations, ckpt':22s}" + "".join(f"{_fmt(p.activations_checkpointed):>{width}s}"
                                                          for p in plans.values()))
    for baseline in [label for label in labels if label in ("four-model", "LoRA PPO")] or labels[:1]:
        first = plans[baseline].model_state
        rows.append(f"{'÷ ' + baseline:22s}" + "".join(f"{p.model_state / first:>{width}.3f}" for p in plans.values()))
    rows.append(f"{'per layer (state)':22s}" + "".join(
        f"{_fmt(sum(p.per_layer[k] for k in STATE_PARTS)):>{width}s}" for p in plans.values()))
    rows.append(f"{'trainable params':22s}" + "".join(f"{p.trainable_params:>{width},d}" for p in plans.values()))
    return "\n".join(rows)
