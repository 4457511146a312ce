"""Rollouts from merged weights: sample from a dense copy of the policy with its LoRA folded in.

A LoRA policy on an NF4 base pays twice on every generated token: each `Linear4bit` dequantizes its weight
before its matmul, and each targeted layer adds the adapter's two small matmuls, x·Aᵀ·Bᵀ·s. Generation runs
the model once per new token, so both costs are paid R times per rollout. A dense copy whose weights are

    W = dequant(W_base) + s · B·A        (s = lora_alpha / r; `LoraLayer.get_delta_weight`)

computes the same function with one plain matmul per layer. `MergedPolicy` holds that copy, in the base's
compute dtype (fp32 on CPU, bf16 on CUDA), and samples from it; the PPO log-probs, values and gradients still
come from the training path (adapter on the base), so the ratio is exactly 1 at the first minibatch and every
equivalence test of the engine holds (`PPOConfig.old_logprobs: sampler` instead keeps the copy's own log-probs and
values as the old ones: a CPU option, the ratio then 1 up to the rounding the gap below measures). The two paths
agree up to floating-point rounding (`tests/test_rollout_speedups.py` states the tolerance).

π_sampler, the log-probability each token was drawn with, is recorded while the copy samples (`SampledLogprobs`):
log softmax(z / T) of the very logits `generate` drew from, so the gap the engine logs and the weights of
truncated importance sampling (`tis_cap`) compare the policy with the sampler as it ran (its decode, its batch,
its rounding), and no second forward pass over the copy is needed.

The copy is rebuilt from the base after every update, never patched incrementally: subtracting the old
delta and adding the new would let rounding accumulate over a run, and re-dequantizing costs one pass over the
weights, not one per token. It is never merged into the base itself either: merging into a 4-bit base is lossy,
and the base is also the reference model.

Cost: one dense copy of the model, parameters × bytes of the compute dtype (`memory.plan_memory`'s
`merged_rollout` term). Taught in chapter 09; the config switch is `merged_rollout`.

A static KV cache (`cache="static"`, the config's `rollout_cache`) makes the copy sample in fixed shapes: one
cache of (rows, prompt width + new tokens) per layer allocated up front instead of one that grows each token,
so on CUDA transformers' `generate` compiles the one-token decode step (`torch.compile`, mode
"reduce-overhead": CUDA graphs). An eager decode step of a 32-layer Llama is about a thousand small operations,
each launched from Python; replayed as one graph, their launch cost disappears. The copy's weights are refreshed
in place (`copy_`), so a recorded graph reads the new weights (by design; not checked on a GPU). On a CPU
nothing is compiled and the static cache gives the dynamic one's tokens (`tests/test_rollout_speedups.py`).
Taught in chapter 15.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from marlhf_edu.loading.onednn import onednn_weights, use_onednn
from marlhf_edu.math.logprobs import entropy_from_logits
from marlhf_edu.ppo.token_draw import inverse_cdf_draw


def dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight of a linear layer as a dense tensor: an NF4 `Linear4bit` dequantized, else as is."""
    weight = layer.weight
    if weight.__class__.__name__ == "Params4bit":
        import bitsandbytes as bnb

        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).to(dtype)
    if weight.__class__.__name__ == "Int8Params":
        raise NotImplementedError("merged_rollout supports dense and NF4/FP4 bases, not 8-bit ones")
    return weight.detach().to(dtype)


def merged_linear_weight(module: nn.Module, adapter: str, dtype: torch.dtype) -> torch.Tensor:
    """W of `module` with adapter `adapter` folded in when it is a LoRA layer carrying that adapter."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer):
        return dense_weight(module, dtype)
    if module.merged:
        raise RuntimeError("the policy's adapter is merged into the base; merged_rollout needs it unmerged")
    if adapter in module.use_dora and module.use_dora[adapter]:
        raise NotImplementedError("merged_rollout does not support DoRA adapters")
    weight = dense_weight(module.get_base_layer(), dtype)
    if adapter in module.lora_A:
        weight = weight + module.get_delta_weight(adapter).to(dtype)
    return weight


class SampledLogprobs:
    r"""A `generate` logits processor that records log π_sampler(y_t) of every token the sampler draws.

    .. math:: \log\pi_{\text{sampler}}(y_t) = \log\operatorname{softmax}(z_t / T)_{y_t}

    `z_t` are the logits at decode step t as `generate` hands them to its sampling warpers (transformers puts a
    user's processors after its own, before temperature, top-k and top-p), so top-k/top-p truncation is not in
    the number: π_train has none either. At step t the processor sees the ids up to y_{t−1}, so it picks the
    previous step's log-prob and keeps one (B, V) fp32 row of log-probs at a time, never the (B, R, V) logits.
    `finish(sequences)` picks the last token's and returns (B, R) fp32, R = the new tokens (a finished row's pad
    tokens get the log-prob of pad; the response mask drops them).

    With `entropy=True` it also keeps the entropy H_t = −Σ_v p_v log p_v of each step's distribution, (B, R) fp32 in
    `entropy` after `finish`: what the rollout's policy forward would log (`PPOConfig.old_logprobs: sampler`).

    With `draw=True` it also draws each token itself from those log-probs (`token_draw.inverse_cdf_draw`) and
    returns scores of 0 for the drawn token and −inf elsewhere: `generate` must then run greedy
    (`do_sample=False`, no warpers), and its argmax is the draw (`PPOConfig.token_draw: inverse_cdf`).
    """

    def __init__(self, temperature: float, entropy: bool = False, draw: bool = False):
        self.temperature = temperature
        self.draw = draw
        self._pending = None  # (B, V) log-probs of the step whose token is not yet drawn
        self._picked = []
        self._entropy = [] if entropy else None
        self.entropy = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self._picked.append(self._pending.gather(1, input_ids[:, -1:]))
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        p = None
        if self._entropy is not None:
            # −Σ p·log p from the log-probs just made, as one (1, V)·(V, 1) product per row: 1.7 ms a decode step at
            # SmolLM2's 16 × 49,152 against 4.8 ms for entropy_from_logits, which recomputes the softmax (this AMD
            # EPYC; 48 steps a rollout). A token masked to −inf makes 0·(−inf) = NaN here: those rows take
            # entropy_from_logits, which counts it as 0
            p = self._pending.exp()
            h = -torch.bmm(p[:, None, :], self._pending[:, :, None]).view(-1, 1)
            if not torch.isfinite(h).all():
                h = entropy_from_logits(scores.float()[:, None] / self.temperature)
            self._entropy.append(h)
        if self.draw:
            drawn = inverse_cdf_draw(self._pending.exp() if p is None else p)
            return torch.full_like(scores, float("-inf")).scatter_(1, drawn[:, None], 0.0)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self._picked.append(self._pending.gather(1, sequences[:, -1:]))
            self._pending = None
        empty = torch.zeros(sequences.shape[0], 0, device=sequences.device)
        if self._entropy is not None:
            self.entropy = torch.cat(self._entropy, dim=1) if self._entropy else empty
        return torch.cat(self._picked, dim=1) if self._picked else empty


class MergedPolicy:
    """A dense causal LM equal to `peft_model`'s base with adapter `adapter` merged, for sampling only.

    `refresh()` after the adapter changed; `stale` says whether it must be refreshed before the next sample.
    `cache`: "dynamic" (transformers' default) or "static" (see the module docstring).

    `refresh(other)` merges another adapter of the same base instead (multi-adapter PPO's `merged_reward` scores
    with the frozen reward adapter merged into this copy between two samples); `holds` names the adapter merged
    in now, and the copy is stale for sampling until the policy is merged back.
    """

    def __init__(self, peft_model, adapter: str, dtype: torch.dtype | None = None, cache: str = "dynamic",
                 onednn: bool = False):
        if cache not in ("dynamic", "static"):
            raise ValueError(f"cache must be 'dynamic' or 'static', got {cache!r}")
        from transformers import AutoModelForCausalLM

        base = peft_model.get_base_model()
        quantization = getattr(base.config, "quantization_config", None)
        if dtype is None:
            compute = getattr(quantization, "bnb_4bit_compute_dtype", None) if quantization is not None else None
            if isinstance(compute, str):
                compute = getattr(torch, compute)
            dtype = compute or next(p for p in base.parameters() if p.is_floating_point()).dtype
        config = copy.deepcopy(base.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the copy is dense
        device = next(base.parameters()).device
        self.peft_model, self.adapter, self.dtype = peft_model, adapter, dtype
        from transformers.initialization import no_init_weights

        # built on the target device without random initialisation (every weight is copied in by `refresh`; at 7B a
        # random init would take minutes); no_init_weights also skips the tying of embeddings and LM head that
        # post-init does, so tie them as `from_config` would
        with torch.device(device), no_init_weights():
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.model.tie_weights()
        self.model.eval().requires_grad_(False)
        if onednn:  # fp32 on a CPU: every linear product through oneDNN, weights reordered again after each refresh
            use_onednn(self.model, backward=False)
        self.model.generation_config = copy.deepcopy(base.generation_config)
        self.cache = cache
        if cache == "static":  # every `generate` on the copy allocates a static cache (and compiles on CUDA)
            self.model.generation_config.cache_implementation = "static"
        self.stale = True
        self.refresh()

    @torch.no_grad()
    def refresh(self, adapter: str | None = None) -> None:
        """Copy every weight of the base into the dense model, dequantized, with `adapter`'s delta added (the
        policy's by default)."""
        adapter = adapter or self.adapter
        base = self.peft_model.get_base_model()
        source = dict(base.named_modules())
        linear = set()
        for name, module in self.model.named_modules():
            if isinstance(module, nn.Linear):
                if name not in source:
                    raise KeyError(f"merged_rollout: the base has no module {name!r}")
                module.weight.copy_(merged_linear_weight(source[name], adapter, self.dtype))
                layer = source[name].get_base_layer() if hasattr(source[name], "get_base_layer") else source[name]
                bias = getattr(layer, "bias", None)
                if (bias is None) != (module.bias is None):
                    raise ValueError(f"merged_rollout: {name!r} has a bias in one model and not in the other")
                if module.bias is not None:
                    module.bias.copy_(bias.detach())
                linear.add(name)
        base_params = dict(base.named_parameters())
        for name, param in self.model.named_parameters():
            owner = name.rsplit(".", 1)[0]
            if owner in linear:
                continue
            if name not in base_params:
                raise KeyError(f"merged_rollout: the base has no parameter {name!r}")
            param.copy_(base_params[name].detach().to(self.dtype))
        self.holds = adapter
        self.stale = adapter != self.adapter

    def nbytes(self) -> int:
        """Bytes the dense copy holds: parameters (tied ones once), buffers (RoPE's frequencies) and, with
        `onednn`, the weights reordered for oneDNN (made at the first sample after each refresh)."""
        seen = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values()) + sum(t.numel() * t.element_size() for t in onednn_weights(self.model))
