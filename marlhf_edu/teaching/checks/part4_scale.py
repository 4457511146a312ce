"""Checkers for the exercises of the book's fourth part, Real model and scale (chapters 13–15).

- chapter 13: `check_dequantize_q4_1`, float32 weights from GGUF Q4_1 blocks
- chapter 14: `check_global_whiten`, advantage whitening over a batch split across ranks
- chapter 15: `check_kv_cache_bytes`, the bytes of a KV cache
"""

from __future__ import annotations

from typing import Callable

import torch

from marlhf_edu.loading.gguf_blocks import dequantize_q4_1
from marlhf_edu.math.masked import masked_whiten
from marlhf_edu.memory.plan import LLAMA_2_7B, ModelShape, kv_cache_bytes
from marlhf_edu.teaching.grading import (CheckReport, _compare, _learner, _padded_mask, _resolve, _run, _withholds,
                                         withheld)


@_withholds("marlhf_edu.loading.gguf_blocks.dequantize_q4_1", "gguf.quants.Q4_1.dequantize_blocks")
def check_dequantize_q4_1(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(raw) -> np.ndarray`: float32 weights of GGUF Q4_1 data (uint8, shape (..., n_blocks · 20)).

    Chapter 13's exercise; compared exactly with `marlhf_edu.loading.gguf_blocks.dequantize_q4_1`, itself equal to the
    `gguf` package's dequantizer (d and m are fp16 at bytes 0–3; byte j of the 16 code bytes holds weight j in its
    low nibble and weight j + 16 in its high one). Blocks come from `gguf`'s own quantizer. A non-zero `seed`
    draws other random weights. `gguf`'s Q4_1 dequantizer is withheld with ours (`Q4_1.dequantize_blocks`, which
    `gguf.quants.dequantize` and `Q4_1.dequantize` call).
    """
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    fn = _learner(fn, check_dequantize_q4_1)
    rng = np.random.default_rng(seed + 13)

    def case(label, weights):
        raw = quantize(np.asarray(weights, dtype=np.float32), GGMLQuantizationType.Q4_1)

        def run():
            expected = dequantize_q4_1(raw)
            got = fn(raw.copy())
            if not isinstance(got, np.ndarray):
                return f"{label}: expected a numpy array, got {type(got).__name__}"
            if got.shape != expected.shape:
                return f"{label}: shape {got.shape}, expected {expected.shape}"
            bad = np.flatnonzero(~np.isclose(got.astype(np.float64), expected, rtol=0, atol=1e-6))
            if bad.size:
                i = int(bad[0])
                return f"{label}: weight {i} (block {i // 32}, position {i % 32}) is {got.flat[i]!r}, expected {expected.flat[i]!r}"
            return None
        return label, run

    ramp = np.linspace(-1.0, 2.0, 32)
    return _run("check_dequantize_q4_1", seed=seed, cases=[
        case("one block, a ramp from -1 to 2 (low nibbles first, then high)", ramp),
        case("one block, the ramp reversed", ramp[::-1].copy()),
        case("one block, all weights equal (d = 0)", np.full(32, 0.25)),
        case("one block, only negative weights (m < 0)", -np.abs(rng.standard_normal(32)) - 1),
        case("a row of 4 blocks", rng.standard_normal(128)),
        case("a 3 × 64 matrix (each row its own blocks)", rng.standard_normal((3, 64))),
        case("a 576 × 96 matrix, SmolLM2's row width scale", 0.05 * rng.standard_normal((576, 96))),
    ])


def run_ranks(fn: Callable, values: list[torch.Tensor], masks: list[torch.Tensor], timeout: float = 5.0) -> list:
    """Call `fn(values[r], masks[r], all_reduce)` for every rank r at once, each in its own thread, as data
    parallelism runs one process a rank: a rank sees its own rows only, and `all_reduce(t)` returns the sum of `t`
    over the ranks (like `torch.distributed.all_reduce` with SUM, returning the sum instead of writing it into
    `t`). Every rank must call it as often as the others, with tensors of one shape. Returns each rank's result;
    raises the first rank's error (a `ValueError` saying so when the ranks' calls did not match)."""
    import threading

    world = len(values)
    barrier = threading.Barrier(world, timeout=timeout)
    slots, results, errors, stranded = [None] * world, [None] * world, [None] * world, [False] * world

    def rank_main(rank):
        def all_reduce(t):
            slots[rank] = torch.as_tensor(t).detach().clone()
            barrier.wait()  # every rank has put its tensor in
            shapes = {tuple(x.shape) for x in slots}
            total = None if len(shapes) > 1 else torch.stack(slots).sum(0)  # ranks 0, 1, ... in order: one result
            barrier.wait()  # every rank has read the others' before any slot is written again
            if total is None:
                raise ValueError(f"all_reduce got tensors of shapes {sorted(shapes)} on different ranks: every "
                                 "rank must reduce a tensor of one shape")
            return total

        try:
            results[rank] = fn(values[rank], masks[rank], all_reduce)
        except threading.BrokenBarrierError:  # another rank failed, or the ranks' calls did not match
            stranded[rank] = True
            barrier.abort()
        except Exception as err:  # noqa: BLE001 - the learner's error, reported as the case's line
            errors[rank] = err
            barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    raised = [e for e in errors if e is not None]
    if raised:  # a rank's own error, not the others' waiting it broke off
        raise raised[0]
    if any(stranded):
        raise ValueError("the ranks called all_reduce a different number of times (a rank waited for the others): "
                         "every rank must call it as often, in the same order")
    return results


@_withholds("marlhf_edu.math.masked.masked_whiten", "marlhf_edu.math.masked.masked_var")
def check_global_whiten(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(values, mask, all_reduce) -> Tensor`: advantage whitening over a batch split across ranks.

    Chapter 14's exercise. `fn` runs on every rank at once (`run_ranks`: a thread a rank), with rank r's (b_r, R)
    advantages and response mask and `all_reduce(t)`, the sum of `t` over the ranks; it returns rank r's (b_r, R)
    advantages, equal to `marlhf_edu.math.masked.masked_whiten` of the whole batch (the ranks' rows
    concatenated) cut back into the ranks' rows: the mean over every selected token of every rank, the unbiased
    variance with the global count, zeros where the mask is 0. A rank sees only its own rows, so the statistics
    must travel through `all_reduce`. A non-zero `seed` draws other cases.
    """
    withhold = tuple(_resolve(path) for path in check_global_whiten.withholds)
    gen = torch.Generator().manual_seed(seed + 14)

    def case(label, values, masks):
        def run():
            with withheld(*withhold):  # once around all the ranks' threads (swapping code per thread would race)
                got = run_ranks(fn, [v.clone() for v in values], [m.clone() for m in masks])
            expected = masked_whiten(torch.cat(values), torch.cat(masks)).split([len(v) for v in values])
            for rank, (g, e) in enumerate(zip(got, expected)):
                problem = _compare(f"{label}, rank {rank}", g, e, 1e-5, 1e-5)
                if problem:
                    return problem
            return None
        return label, run

    easy, hard = torch.tensor([[2.0, 3.0, 4.0]]), torch.tensor([[-4.0, -3.0, -2.0]])
    full = torch.ones(1, 3, dtype=torch.bool)
    return _run("check_global_whiten", seed=seed, cases=[
        case("one rank: plain whitening", [torch.tensor([[1.0, 2.0, 3.0, 6.0]])], [torch.ones(1, 4, dtype=torch.bool)]),
        case("2 ranks, one easy prompt and one hard: the ranks' means differ", [easy, hard], [full, full]),
        case("2 ranks with 3 rows and 1 row: weigh each rank by its tokens",
             [torch.randn(3, 5, generator=gen) + 1, torch.randn(1, 5, generator=gen) - 2],
             [torch.ones(3, 5, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool)]),
        case("2 ranks, equal rows, different response lengths (count tokens, not rows)",
             [torch.randn(4, 6, generator=gen) * 2, torch.randn(4, 6, generator=gen) + 3],
             [_padded_mask(gen, 4, 6), torch.tensor([[1, 0, 0, 0, 0, 0]] * 4, dtype=torch.bool)]),
        case("4 ranks of 4 responses of up to 8 tokens, padding holds garbage",
             [torch.randn(4, 8, generator=gen) * (r + 1) + r for r in range(4)],
             [_padded_mask(gen, 4, 8) for _ in range(4)]),
    ])


@_withholds("marlhf_edu.memory.plan.kv_cache_bytes")
def check_kv_cache_bytes(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(shape, batch, tokens, bytes_per_value) -> int`: the bytes of a KV cache.

    Chapter 15's exercise; compared exactly with `marlhf_edu.memory.plan.kv_cache_bytes` on Llama-2-7B, a model
    with grouped-query attention (8 key/value heads to 32 query heads, as Llama-3-8B), SmolLM2-135M's shape (3 to
    9) and random shapes. A non-zero `seed` draws other random shapes.
    """
    import random

    fn = _learner(fn, check_kv_cache_bytes)
    rng = random.Random(seed + 15)
    gqa = ModelShape("gqa-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                     num_heads=32, num_kv_heads=8)
    smol = ModelShape("smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, tie_word_embeddings=True)

    def case(label, shape, batch, tokens, nbytes):
        def run():
            got, expected = fn(shape, batch, tokens, nbytes), kv_cache_bytes(shape, batch, tokens, nbytes)
            if not isinstance(got, (int, float)) or got != expected:
                return f"{label}: got {got!r}, expected {expected:,} bytes"
            return None
        return label, run

    heads = rng.choice([4, 8, 16])
    odd = ModelShape("random", vocab_size=1000, hidden_size=heads * 64, intermediate_size=512,
                     num_layers=rng.randint(2, 12), num_heads=heads, num_kv_heads=heads // rng.choice([1, 2, 4]),
                     head_dim=rng.choice([0, 32, 96]))
    return _run("check_kv_cache_bytes", seed=seed, cases=[
        case("Llama-2-7B, one sequence of one token, bf16", LLAMA_2_7B, 1, 1, 2),
        case("Llama-2-7B, the 7B recipe's sampling batch: 16 x (64 + 256) tokens, bf16", LLAMA_2_7B, 16, 320, 2),
        case("grouped-query attention: 8 key/value heads for 32 query heads", gqa, 8, 1024, 2),
        case("SmolLM2-135M (3 key/value heads for 9), fp32", smol, 16, 112, 4),
        case("a random shape (its head width may differ from hidden / heads)", odd, rng.randint(1, 9), rng.randint(1, 99), 2),
    ])
