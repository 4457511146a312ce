"""4-bit NF4 bases that load the same way everywhere and stay trainable on every CPU.

One trap lives here. bitsandbytes (0.49 and later) has a CPU inference fast
path. On a CPU with AVX512-BF16, the first time a `Linear4bit` runs in eval
mode on an input that does not require grad (every rollout, every reward or
reference pass), it **repacks its weight in place** into a CPU-only layout:

- `quant_state.packing_format_for_cpu = True`;
- the absmax scales are cast to bf16, and double quantization is undone;
- from then on `matmul_4bit` calls `gemv_4bit`, which has no backward.

Nothing raises. A LoRA adapter on top of such a layer still gets a gradient
from its own branch, but every gradient that has to flow *through* the frozen
4-bit weight to reach earlier layers is cut. Measured on an AMD EPYC with
AVX512-BF16 (torch 2.13.0+cpu, bitsandbytes 0.50.2, the tiny MA-PPO backend):
after one no-grad rollout the norm of the policy gradient of
`layers.0.mlp.gate_proj.lora_B` was 0.0 instead of 28.06, and
`layers.0.mlp.down_proj.lora_B` 10.15 instead of 20.23. MA-PPO keeps its
models in eval mode (no dropout, so re-computed log-probs equal the rollout's),
which is exactly when the repacking fires. The repacking also changes the
numbers a 4-bit model computes (bf16 scales and kernels) and the bytes it holds.

`keep_nf4_trainable` switches the fast path off on every `Linear4bit` of a
model, before its first forward. Every 4-bit model the package builds goes
through it: `load_nf4`, the multi-adapter backend, the SFT and reward stages,
`load_sft_model`/`load_reward_model`. On CPUs without AVX512-BF16 (and on GPUs)
it changes nothing. The same family of trap as peft's `set_adapter` (chapter
10): a library fast path that changes what trains, silently.

Taught in chapter 10.
"""

from __future__ import annotations

import logging
import sys
import types

import torch

from marlhf_edu.loading.onednn import OneDNNWeight, frozen_linear

#: bitsandbytes logs this notice on import on AVX512-BF16 CPUs when the optional `kernels` package (which
#: would download a kernel from the hub) is missing. The book never uses that kernel, see above.
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


def quiet_bitsandbytes_cpu_notice() -> None:
    """Silence bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" log line.

    It is printed on import on AVX512-BF16 CPUs, concerns only the repacked inference path that
    `keep_nf4_trainable` turns off, and would otherwise land in stored notebook outputs on some CPUs
    and not others. Only that one logger is raised to ERROR; every other bitsandbytes message stays.
    """
    logging.getLogger(_BNB_CPU_LOGGER).setLevel(logging.ERROR)


#: `nf4_loading_kwargs`'s compute dtypes: "auto" is bf16 on CUDA and fp32 on the CPU.
NF4_COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


def nf4_loading_kwargs(device: str, double_quant: bool = True, compute_dtype: str = "auto") -> dict:
    """`from_pretrained` arguments for an NF4 base on `device`: compute in bf16 on CUDA, fp32 on CPU
    (most CPUs have no fast bf16), the whole model on that one device.

    On CUDA the parts that stay unquantized (embeddings, norms, lm_head: the residual stream) are loaded in bf16
    whatever the checkpoint says: transformers 5 loads `dtype="auto"`, the checkpoint's own dtype, which is float16
    for Llama-2-7b-hf, and a float16 residual stream with no loss scaling is not the recipe. On CPU the
    checkpoint's dtype is kept (the book's CPU checkpoints are fp32; the 7B-shaped smoke model is bf16).

    `compute_dtype` "float32" computes in fp32 on CUDA too, with an fp32 residual stream, as a CPU run does (a
    small model, or a comparison with a CPU run); "bfloat16" on the CPU sets only the 4-bit layers' compute dtype."""
    from transformers import BitsAndBytesConfig

    if compute_dtype not in NF4_COMPUTE_DTYPES:
        raise ValueError(f"nf4 compute_dtype must be one of {NF4_COMPUTE_DTYPES}, got {compute_dtype!r}")
    cuda = device.startswith("cuda")
    if compute_dtype == "auto":
        compute = torch.bfloat16 if cuda else torch.float32
    else:
        compute = getattr(torch, compute_dtype)
    kwargs = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                        bnb_4bit_use_double_quant=double_quant,
                                                        bnb_4bit_compute_dtype=compute),
              "device_map": {"": device}}
    if cuda:
        kwargs["dtype"] = compute
    return kwargs


def is_cpu_repacked(module) -> bool:
    """True when a `Linear4bit`'s weight has been converted to bitsandbytes' CPU inference layout."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def keep_nf4_trainable(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' CPU inference repacking on every `Linear4bit` of `model`; return how many.

    Call it right after loading, before the first forward. A model with no 4-bit layers is left alone
    (returns 0). A layer that was already repacked cannot be restored exactly (its scales were rounded to
    bf16), so it is an error: reload the model and guard it first.
    """
    if "bitsandbytes" not in sys.modules:  # nothing 4-bit can exist before bitsandbytes is imported
        return 0
    import bitsandbytes as bnb

    guarded = 0
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            if is_cpu_repacked(module):
                raise RuntimeError(
                    f"{name}: bitsandbytes already repacked this 4-bit weight for CPU inference (bf16 scales, no "
                    "backward). Reload the model and call keep_nf4_trainable before its first forward.")
            module.support_avx512bf16_for_cpu = False
            guarded += 1
    return guarded


def dequantize_as_bitsandbytes(weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense (out, in) weight a `Linear4bit`'s matmul uses, computed as bitsandbytes 0.50 computes it on the CPU
    (`gemm_4bit`'s default implementation): a double-quantized absmax is restored in fp32 first, then the 4-bit
    codes are scaled and cast to `dtype`."""
    state = weight.quant_state
    absmax = state.absmax
    if state.nested:
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
            state.absmax, state.state2.absmax, state.state2.code, state.state2.blocksize, torch.float32) + state.offset
    return torch.ops.bitsandbytes.dequantize_4bit.default(weight.data.view(-1, 1), absmax, state.blocksize,
                                                         state.quant_type, state.shape, dtype)


def _forward_dequantized_once(self, x: torch.Tensor) -> torch.Tensor:
    """`Linear4bit.forward` (bitsandbytes 0.50) with the dequantized weight kept from one call to the next.

    The same operations as bitsandbytes' CPU path, x → compute dtype, F.linear(x, W), → x's dtype, so outputs and
    the gradient to x (autograd's x-gradient of F.linear, W·g) are bit-identical (not so with `onednn`, whose
    reordered W and Wᵀ give the same function summed in another order); the weight is dequantized again
    only when it changed: a new parameter object (peft's merge into a 4-bit layer makes one), new storage, an
    in-place write to the parameter (its version counter), another compute dtype. A write through `weight.data`
    bypasses the version counter and is not seen; nothing in the package writes a frozen base."""
    weight = self.weight
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = self.bias
    if bias is not None:
        if bias.dtype != x.dtype:
            bias.data = bias.data.to(x.dtype)
        bias = bias.to(self.compute_dtype)
    onednn = self.__dict__.get("_onednn", False) and x.dtype == torch.float32 and x.device.type == "cpu"
    key = (id(weight), weight.data_ptr(), weight._version, x.dtype, onednn)
    cached = self.__dict__.get("_dequantized")
    if cached is None or cached[0] != key:
        dense = dequantize_as_bitsandbytes(weight, x.dtype)
        cached = (key, OneDNNWeight(dense) if onednn else dense)
        self.__dict__["_dequantized"] = cached
    if onednn:  # reordered for oneDNN (`loading.onednn`): the same function, rounded in another order
        return frozen_linear(x, cached[1], bias).to(inp_dtype)
    return torch.nn.functional.linear(x, cached[1], bias).to(inp_dtype)


def dequantize_once(model: torch.nn.Module, onednn: bool = False) -> int:
    """CPU, NF4 base: every `Linear4bit` of `model` dequantizes its frozen weight once and keeps it; returns how many.

    bitsandbytes dequantizes a 4-bit weight on every call (on the CPU, `gemm_4bit` = dequantize, then a dense
    matmul) and again in the backward: a fresh (out, in) tensor each time. The base of a LoRA run never changes, so
    one dense copy per layer serves every rollout, reference, reward and training forward; each layer then runs
    the very operations bitsandbytes runs, so outputs and gradients are bit-identical (a test pins it against
    bitsandbytes' own forward). The price is QLoRA's memory saving: the layers' weights in the compute dtype
    (SmolLM2-135M: 106 M weights, 212 MB in bf16, 425 MB in fp32) beside the 4-bit ones. A CPU feature: on a GPU,
    bitsandbytes' kernels are not this sequence and the memory is what QLoRA is for (the config refuses it).
    Also guards every layer as `keep_nf4_trainable` does. The config switch is `nf4_dequantize_once`; chapter 09.

    `onednn=True` (the config's `onednn_matmuls`): an fp32 layer keeps its weight reordered for oneDNN instead,
    twice (W for the forward, Wᵀ for the input gradient; `loading.onednn`), and is not bit-identical to
    bitsandbytes: the same function, summed in another order.
    """
    guarded = keep_nf4_trainable(model)
    if not guarded:
        return 0
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            if getattr(module.weight, "quant_state", None) is None:
                raise RuntimeError("dequantize_once: a Linear4bit without a quant_state (not quantized yet)")
            module.forward = types.MethodType(_forward_dequantized_once, module)
            module.__dict__["_onednn"] = onednn
    return guarded


def dequantized_weights(model: torch.nn.Module):
    """The dense weights `dequantize_once` layers of `model` hold now (each made at its layer's first call): what the
    memory measurement counts beside parameters and buffers."""
    for module in model.modules():
        kept = module.__dict__.get("_dequantized")
        if kept is not None:
            yield from kept[1].tensors() if isinstance(kept[1], OneDNNWeight) else (kept[1],)


def load_nf4(model_class, path, device: str = "cpu", double_quant: bool = True, **kwargs):
    """`model_class.from_pretrained(path)` as an NF4 base on `device`, guarded by `keep_nf4_trainable`."""
    model = model_class.from_pretrained(str(path), **nf4_loading_kwargs(device, double_quant), **kwargs)
    keep_nf4_trainable(model)
    return model


def keep_trainable_dtype(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Cast every trainable parameter that is not `dtype` back to it; returns how many were cast.

    trl's `SFTTrainer` and `RewardTrainer` (1.16) cast the trainable parameters of a quantized model to bf16
    when they wrap it (the QLoRA paper's recipe), whatever `bf16` says. With fp32 compute (our CPU configs) a
    bf16 score head then meets fp32 hidden states outside the trainer, and bf16 adapters round every update.
    Called right after the trainer is built (its optimizer is created later, from these parameters); the
    SFT and reward stages call it for every LoRA run whatever the compute dtype (on a GPU, bf16 entries of an
    adapter or score head would mostly not move at lr 2e-5) and for fp32 runs. Taught in chapter 13.
    """
    cast = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
            cast += 1
    return cast
