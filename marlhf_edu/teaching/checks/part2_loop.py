"""Checkers for the exercises of the book's second part, The loop (chapters 07–10).

- chapter 07: `check_pku_preference`, a PKU-SafeRLHF row as (chosen, rejected, margin), safety first
- chapter 08: `check_position_ids`, position ids from an attention mask, whatever the padding
- chapter 09: `check_response_mask`, the response mask: tokens up to and including the first EOS
- chapter 10: `check_nf4_bytes`, the bytes bitsandbytes holds for one NF4 linear weight
"""

from __future__ import annotations

from typing import Callable

import torch

from marlhf_edu.data.formats import pku_saferlhf_to_preference
from marlhf_edu.data.template import format_completion
from marlhf_edu.math.scoring import position_ids_from_mask
from marlhf_edu.memory.plan import MemorySettings, linear_weight_bytes
from marlhf_edu.ppo.trainer import response_mask_from_ids
from marlhf_edu.teaching.grading import CheckReport, _compare, _learner, _padded_mask, _run, _withholds


@_withholds("marlhf_edu.data.formats.pku_saferlhf_to_preference")
def check_pku_preference(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(row) -> (chosen, rejected, margin)` on PKU-SafeRLHF rows. Chapter 07's exercise.

    Covers the four safety cases (only 0 safe, only 1 safe, both safe, both
    unsafe) with `better_response_id` and `safer_response_id` pointing both ways,
    against `pku_saferlhf_to_preference` (responses compared as raw text).
    `seed` changes the response texts.
    """
    fn = _learner(fn, check_pku_preference)
    words = ["zero", "one"] if seed == 0 else [f"reply {seed}-{i}" for i in (0, 1)]

    def case(safe0, safe1, better, safer):
        row = {"prompt": "q", "response_0": f"answer {words[0]}", "response_1": f"answer {words[1]}",
               "is_response_0_safe": safe0, "is_response_1_safe": safe1,
               "better_response_id": better, "safer_response_id": safer}
        label = f"safe=({safe0}, {safe1}), better={better}, safer={safer}"

        def run():
            ref = pku_saferlhf_to_preference(row)
            names = {format_completion(row[k]): row[k] for k in ("response_0", "response_1")}
            want = (names[ref["chosen"]], names[ref["rejected"]], ref["margin"])
            got = fn(dict(row))
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                return f"{label}: expected a tuple (chosen, rejected, margin)"
            if (got[0], got[1]) != want[:2]:
                return f"{label}: chose {got[0]!r} over {got[1]!r}, expected {want[0]!r} over {want[1]!r}"
            if float(got[2]) != want[2]:
                return f"{label}: margin {got[2]}, expected {want[2]}"
            return None
        return label, run

    return _run("check_pku_preference", seed=seed,
                cases=[case(s0, s1, b, s) for s0, s1 in ((True, False), (False, True), (True, True), (False, False))
                       for b, s in ((0, 1), (1, 0))])


@_withholds("marlhf_edu.math.scoring.position_ids_from_mask")
def check_position_ids(fn: Callable, seed: int = 7) -> CheckReport:
    """Check `fn(attention_mask) -> position_ids` (B, T): real tokens numbered 0, 1, … whatever the padding.

    Only real tokens are compared (what a model puts at padded positions is
    irrelevant). Chapter 08's exercise.
    """
    fn = _learner(fn, check_position_ids)
    gen = torch.Generator().manual_seed(seed)

    def case(label, mask):
        def run():
            expected = position_ids_from_mask(mask)
            got = fn(mask.clone())
            if not isinstance(got, torch.Tensor) or got.shape != mask.shape:
                return f"{label}: expected a tensor of shape {tuple(mask.shape)}"
            real = mask.bool()
            return _compare(label + " (real tokens)", got[real].double(), expected[real].double(), 0, 0)
        return label, run

    return _run("check_position_ids", seed=seed, cases=[
        case("no padding", torch.ones(3, 6, dtype=torch.long)),
        case("right padding", _padded_mask(gen, 4, 7).long()),
        case("left padding", _padded_mask(gen, 4, 7, left=True).long()),
        case("single real token", torch.tensor([[0, 0, 0, 1], [1, 0, 0, 0]])),
    ])


@_withholds("marlhf_edu.ppo.trainer.response_mask_from_ids")
def check_response_mask(fn: Callable, seed: int = 8) -> CheckReport:
    """Check `fn(response_ids, eos_token_id) -> mask` (B, R): tokens up to and including the first EOS.

    Chapter 09's exercise; compared with `marlhf_edu.ppo.response_mask_from_ids`.
    """
    fn = _learner(fn, check_response_mask)
    eos, pad = 2, 3

    def case(label, ids):
        def run():
            expected = response_mask_from_ids(ids, eos)
            got = fn(ids.clone(), eos)
            if not isinstance(got, torch.Tensor) or got.shape != ids.shape:
                return f"{label}: expected a tensor of shape {tuple(ids.shape)}"
            return _compare(label, got.double(), expected.double(), 0, 0)
        return label, run

    gen = torch.Generator().manual_seed(seed)
    random_ids = torch.randint(0, 12, (6, 9), generator=gen)
    return _run("check_response_mask", seed=seed, cases=[
        case("EOS then padding", torch.tensor([[5, 6, eos, pad, pad], [5, 6, 7, eos, pad]])),
        case("no EOS (hit the length limit)", torch.tensor([[5, 6, 7, 8, 9]])),
        case("EOS as the first token", torch.tensor([[eos, pad, pad, pad]])),
        case("a second EOS after the first", torch.tensor([[5, eos, 7, eos, 8]])),
        case("pad sampled before EOS", torch.tensor([[5, pad, 6, eos, pad]])),
        case("random ids", random_ids),
    ])


@_withholds("marlhf_edu.memory.plan.linear_weight_bytes")
def check_nf4_bytes(fn: Callable, seed: int = 0) -> CheckReport:
    """Check `fn(d_in, d_out, double_quant) -> int`: the bytes bitsandbytes holds for one NF4 linear weight.

    Chapter 10's exercise; compared with `marlhf_edu.memory.plan.linear_weight_bytes`
    (blocks of 64, the 16-entry fp32 NF4 code table; with double quantization the
    absmax as bytes, an fp32 offset, fp32 scales per 256 absmax values and a
    256-entry fp32 code table), which itself matches measured storages exactly.
    A non-zero `seed` adds three random shapes.
    """
    fn = _learner(fn, check_nf4_bytes)

    def case(label, d_in, d_out, double_quant):
        def run():
            expected = linear_weight_bytes(d_in, d_out, MemorySettings(load_in_4bit=True, double_quant=double_quant))
            got = fn(d_in, d_out, double_quant)
            if not isinstance(got, int) or got != expected:
                return f"{label}: got {got!r}, expected {expected} bytes"
            return None
        return label, run

    cases = [
        case("tiny q_proj 192×192, plain", 192, 192, False),
        case("tiny q_proj 192×192, double quant", 192, 192, True),
        case("Llama-2-7B up_proj 4096×11008, plain", 4096, 11008, False),
        case("Llama-2-7B up_proj 4096×11008, double quant", 4096, 11008, True),
        case("a partial last block (10×10), double quant", 10, 10, True),
        case("an odd number of weights (7×9): one byte holds the last nibble", 7, 9, False),
        case("more than 256 blocks but not a multiple (4096×5), double quant", 4096, 5, True),
    ]
    if seed:
        gen = torch.Generator().manual_seed(seed)
        for i in range(3):
            d_in, d_out = (int(d) for d in torch.randint(1, 5000, (2,), generator=gen))
            cases.append(case(f"random shape {d_in}×{d_out}, {'double quant' if i % 2 else 'plain'}", d_in, d_out, bool(i % 2)))
    return _run("check_nf4_bytes", seed=seed, cases=cases)
