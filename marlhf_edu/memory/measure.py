"""Measuring memory.

- `run_isolated` runs one function in a fresh Python process and reports the
  growth of the process's peak resident memory during that call: a clean,
  allocator-independent reading on CPU, where torch has no memory statistics.
- `model_state_bytes` / `state_bytes_by_kind` count the bytes of the distinct
  tensor storages that models and an optimizer hold (weights, 4-bit
  quantization constants, adapters, gradients, optimizer moments): exact, on
  any device. The planner (`marlhf_edu.memory.plan`) is checked against them.
- `cuda_peak_bytes` reads the CUDA caching allocator's peak over one call.

Taught in chapter 02 (log-prob memory), chapter 09 (four models) and chapter 10 (one base, many adapters).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from marlhf_edu.loading.onednn import onednn_weights
from marlhf_edu.loading.quantization import dequantized_weights
from marlhf_edu.math.logprobs import logprobs_from_logits
from marlhf_edu.math.scoring import position_ids_from_mask


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux's VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_peak() -> None:
    """Hand freed heap pages back to the OS and restart the peak count from the current RSS.

    Without this, memory freed earlier but still resident is silently reused by
    the measured call and its allocations never show up in the peak.
    """
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def logprob_workload(method: str, batch: int, tokens: int, vocab: int) -> int:
    """Allocate (B, T, V) fp32 logits, then return the peak-RSS growth of one log-prob call.

    `method` is "naive" (log_softmax + gather) or "chunked" (`logprobs_from_logits`).
    Meant to run in a fresh process through `run_isolated`.
    """
    import torch

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, tokens, vocab, generator=gen)
    labels = torch.randint(0, vocab, (batch, tokens), generator=gen)
    # warm the kernels on a small input so one-off allocations do not count
    logprobs_from_logits(logits[:1, :1], labels[:1, :1])
    torch.log_softmax(logits[:1, :1], -1)
    _reset_peak()
    before = _peak_rss_bytes()
    if method == "naive":
        out = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    elif method == "chunked":
        out = logprobs_from_logits(logits, labels)
    else:
        raise ValueError(f"unknown method {method!r}; use 'naive' or 'chunked'")
    del out
    return _peak_rss_bytes() - before


def run_isolated(target: str, **kwargs) -> int:
    """Call `module:function(**kwargs)` in a fresh interpreter and return its (int) result.

    A fresh process matters: peak RSS is a high-water mark, so earlier work in
    the calling process would hide the call's own peak.
    """
    module, func = target.split(":")
    code = (
        "import json, sys, importlib\n"
        f"fn = getattr(importlib.import_module({module!r}), {func!r})\n"
        "print(json.dumps(fn(**json.loads(sys.argv[1]))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run_isolated({target}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])




def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: a tensor shared by two modules (a tied
    embedding, one base under several adapters) counts once."""
    return _count(tensors, set())


def _count(tensors, seen: set) -> int:
    """Bytes of the storages in `tensors` not yet in `seen` (which is updated)."""
    total = 0
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        if t.is_mkldnn:  # a weight reordered for oneDNN (`loading.onednn`): opaque, no storage to ask
            if ("mkldnn", id(t)) not in seen:
                seen.add(("mkldnn", id(t)))
                total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        key = (storage.device.type, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def quant_state_tensors(param):
    """The tensors a bitsandbytes 4-bit weight keeps beside its packed bytes: the per-block absmax,
    the code table, and with double quantization the offset and the absmax's own absmax and code.
    They hang off `param.quant_state`, so `parameters()` and `buffers()` never see them."""
    state = getattr(param, "quant_state", None)
    while state is not None:
        yield from (getattr(state, k, None) for k in ("absmax", "code", "offset"))
        state = getattr(state, "state2", None)


def _module_tensors(module):
    for p in module.parameters():
        yield p
        yield from quant_state_tensors(p)
    yield from module.buffers()
    yield from dequantized_weights(module)  # nf4_dequantize_once: the dense copies its 4-bit layers keep
    yield from onednn_weights(module)  # onednn_matmuls: the reordered copies its plain linear layers keep


def _optimizer_tensors(optimizer, params=None):
    for p, state in optimizer.state.items():
        if params is None or p in params:
            yield from (v for v in state.values() if hasattr(v, "untyped_storage") and v.dim() > 0)


def model_state_bytes(models: dict, optimizer=None) -> dict[str, int]:
    """Measured bytes held by each model (parameters, buffers, 4-bit constants), gradients and optimizer states.

    `models`: `{name: nn.Module}`. A storage already counted under an earlier
    name is not counted again, so the total is what the process really holds.
    Taught in chapter 09 (four models) and chapter 10 (one base, many adapters).
    """
    out, seen = {}, set()
    for name, module in models.items():
        out[name] = _count(_module_tensors(module), seen)
    params = [p for m in models.values() for p in m.parameters()]
    out["gradients"] = storage_bytes(p.grad for p in params if p.grad is not None)
    out["optimizer"] = storage_bytes(_optimizer_tensors(optimizer)) if optimizer is not None else 0
    out["total"] = sum(out.values())
    return out


#: Parameter names that belong to adapters and heads rather than to a base model's weights.
ADAPTER_MARKERS = ("lora_", "value_head", "reward_head", "modules_to_save", "score.")


def is_adapter_parameter(name: str) -> bool:
    """True for LoRA matrices, value/score heads and peft's saved module copies; False for base weights."""
    return any(marker in name for marker in ADAPTER_MARKERS)


def state_bytes_by_kind(models: dict, optimizer=None) -> dict[str, int]:
    """Measured model state split the way the planner splits it:
    `weights` (base models, frozen or fully trained), `adapters` (LoRA and heads), `gradients`, `optimizer`.

    Pass `{name: module}`; a name is prefixed to its parameters' names. A bare `nn.Linear` counts as a
    head (adapters) under any name. Pass a single transformer layer
    to measure one layer; optimizer states count only for the parameters passed.
    """
    from torch import nn

    seen, out = set(), {"weights": 0, "adapters": 0}
    params = []
    for prefix, module in models.items():
        bare_head = isinstance(module, nn.Linear)  # e.g. `critic: shared_head`'s value head, passed as "critic"
        for name, p in module.named_parameters():
            kind = "adapters" if bare_head or is_adapter_parameter(f"{prefix}.{name}") else "weights"
            out[kind] += _count([p, *quant_state_tensors(p)], seen)
            params.append(p)
        out["weights"] += _count(module.buffers(), seen)
        out["weights"] += _count(dequantized_weights(module), seen)
        out["weights"] += _count(onednn_weights(module), seen)
    out["gradients"] = storage_bytes(p.grad for p in params if p.grad is not None)
    out["optimizer"] = storage_bytes(_optimizer_tensors(optimizer, set(params))) if optimizer is not None else 0
    out["total"] = sum(out.values())
    return out


def cuda_peak_bytes(fn, *args, device=None, **kwargs):
    """Run `fn(*args, **kwargs)` and return `(result, peak)`: the CUDA caching allocator's peak bytes
    allocated during the call, above what was allocated before it."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - before


def saved_tensor_bytes(fn, *modules):
    """Run `fn()` and return `(result, bytes)`: the distinct storages autograd saves for the backward pass
    during the call, not counting the parameters, buffers and 4-bit constants of `modules` (they are model
    state, already counted). These are the activations a backward needs: exact, and the same on every CPU
    and GPU, unlike a peak of the allocator or of the process.
    """
    import torch

    seen, total = set(), 0
    for module in modules:
        _count(_module_tensors(module), seen)  # model state: marked as seen, not counted

    def pack(t):
        nonlocal total
        total += _count([t], seen)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, total




def decoder_layers(module):
    """The `ModuleList` of decoder layers inside `module` (a causal LM, a backbone, a peft wrapper), or None."""
    from torch import nn

    for name, child in module.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(child, nn.ModuleList):
            return child
    return None


def layer_state_bytes(models: dict, optimizer=None, index: int = 0) -> dict[str, int]:
    """`state_bytes_by_kind` of decoder layer `index` of every model that has layers (adapters inside it included)."""
    layers = {name: layers[index] for name, m in models.items() if (layers := decoder_layers(m)) is not None}
    return state_bytes_by_kind(layers, optimizer)


def cache_bytes(past_key_values) -> int:
    """Bytes of a KV cache (a transformers `Cache` or legacy tuples of (key, value) per layer)."""
    tensors = []
    for layer in getattr(past_key_values, "layers", past_key_values):
        tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)] if hasattr(layer, "keys") else list(layer)
    return storage_bytes(tensors)


def widest_rows(attention_mask, n_response: int, k: int):
    """Indices of `k` rows of a (B, P + R) batch, the row with the longest prompt and the row with the longest answer
    first (one row: the one with the most tokens)."""
    import torch

    P = attention_mask.shape[1] - n_response
    if k == 1:
        first = [int(attention_mask.sum(dim=1).argmax())]
    else:
        first = [int(attention_mask[:, :P].sum(dim=1).argmax()), int(attention_mask[:, P:].sum(dim=1).argmax())]
    order = list(dict.fromkeys(first + list(range(attention_mask.shape[0]))))
    return torch.tensor(order[:k], device=attention_mask.device)


def spanning_rollout(rollout, rows):
    """`rollout` with row `rows[0]` given the answer of row `rows[1]` (token ids, masks and every per-answer tensor):
    with the longest prompt and the longest answer (`widest_rows`) that row spans the batch's width P + R even in
    the packed layout the update reads (`ppo.used_columns.packed`), the planner's case. Only its memory means
    anything: its old log-probs belong to another prompt."""
    import dataclasses

    if len(rows) < 2 or int(rows[0]) == int(rows[1]):
        return rollout
    a, b = int(rows[0]), int(rows[1])
    R = rollout.n_response
    changed = {}
    for field in dataclasses.fields(rollout):
        x = getattr(rollout, field.name)
        if not (hasattr(x, "dim") and x.dim() == 2):
            continue
        x = x.clone()
        x[a, -R:] = x[b, -R:]
        changed[field.name] = x
    return dataclasses.replace(rollout, **changed)


def ppo_memory(trainer, rows: int | None = None) -> dict[str, dict[str, int]]:
    """Measure a `PPOTrainer`'s memory where model state peaks: inside an update, after a backward.

    Runs one PPO step first when none has run (AdamW creates its moments at the
    first step), then, on `rows` rollouts (default `forward_batch_size`): a
    forward with the KV cache on (its bytes), the policy's response logits (their
    bytes), and a backward of the policy's log-probs and values (so gradients
    exist) before counting; the bytes autograd saved for that backward are the update's activations
    (`saved_tensor_bytes`). Returns `{"model": state_bytes_by_kind,
    "layer": layer_state_bytes, "activations": {"kv_cache", "logits", "activations"}, "shape":
    {"rows", "prompt_length", "response_length"}}` (the shape measured, to plan
    with); the gradients are freed again afterwards.
    """
    import torch

    cfg, be = trainer.config, trainer.backend
    if trainer.step_index == 0:
        trainer.step()
    rollout = trainer.rollout(trainer.batch_prompts(trainer.step_index)[: rows or cfg.forward_batch_size])
    ids, mask = rollout.input_ids, rollout.attention_mask
    n_response = rollout.response_mask.shape[1]
    with torch.no_grad():
        out = be.policy_model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                              use_cache=True, logits_to_keep=n_response + 1)
        activations = {"kv_cache": cache_bytes(out.past_key_values), "logits": out.logits.float().nbytes}
        del out
    # one micro-batch, as `PPOTrainer.update` runs one; the update packs a micro-batch's rows (`used_columns`), so
    # one of them joins the longest prompt to the longest answer: as wide as the batch, the planner's case
    micro = widest_rows(mask, n_response, cfg.micro_batch_size)
    spanning = spanning_rollout(rollout, micro)
    (loss, _), activations["activations"] = saved_tensor_bytes(lambda: trainer.micro_batch_loss(spanning, micro),
                                                               *be.models().values())
    loss.backward()
    out = {"model": state_bytes_by_kind(be.models(), trainer.optimizer),
           "layer": layer_state_bytes(be.models(), trainer.optimizer), "activations": activations,
           "shape": {"rows": ids.shape[0], "prompt_length": ids.shape[1] - n_response, "response_length": n_response}}
    trainer.optimizer.zero_grad(set_to_none=True)
    return out
