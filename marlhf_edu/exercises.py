"""Checkers for the chapters' exercises.

Each `check_…` runs the learner's function and the package's reference on the
same random and edge-case inputs and reports, case by case, where behaviour
differs. It never reads the learner's source: any correct implementation
passes. The report is truthy when every case passes, so a classroom test can
simply `assert check_gae_advantages(my_gae)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from marlhf_edu.gae import gae_advantages
from marlhf_edu.kl import kl_penalty
from marlhf_edu.logprobs import logprobs_from_logits
from marlhf_edu.masked import masked_mean
from marlhf_edu.ppo_objective import policy_loss
from marlhf_edu.reward import pairwise_reward_loss


@dataclass
class CheckReport:
    """Outcome of one `check_…` call; truthy iff every case passed."""

    name: str
    cases: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return not self.failures

    def __repr__(self) -> str:
        if not self.failures:
            return f"PASS {self.name}: all {len(self.cases)} cases agree with the reference"
        lines = [f"FAIL {self.name}: {len(self.failures)} of {len(self.cases)} cases disagree"]
        lines += [f"  - {f}" for f in self.failures]
        return "\n".join(lines)


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _compare(label: str, got, expected: torch.Tensor, atol: float, rtol: float) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{label}: expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"{label}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    got = got.detach().double()
    expected = expected.detach().double()
    if torch.isnan(got).any():
        return f"{label}: result contains NaN"
    bad = ~torch.isclose(got, expected, atol=atol, rtol=rtol)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0].tolist())
        at = f" at index {idx}" if got.dim() else ""
        return f"{label}: got {got[idx].item():.6g}{at}, expected {expected[idx].item():.6g}"
    return None


def _run(name: str, cases: list[tuple[str, Callable[[], str | None]]]) -> CheckReport:
    report = CheckReport(name)
    for label, case in cases:
        report.cases.append(label)
        try:
            problem = case()
        except Exception as err:  # a learner's bug must become a report line, not a crash
            problem = f"{label}: raised {type(err).__name__}: {err}"
        if problem:
            report.failures.append(problem)
    return report


def _padded_mask(gen: torch.Generator, B: int, T: int, left: bool = False) -> torch.Tensor:
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return mask.flip(1) if left else mask


def check_masked_mean(fn: Callable) -> CheckReport:
    """Check `fn(values, mask) -> scalar` against `masked_mean`. Chapter 00's exercise."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=gen)

    def case(label, values, mask, atol=1e-6):
        return label, lambda: _compare(label, _first_tensor(fn(values.clone(), mask.clone())), masked_mean(values, mask), atol, 1e-5)

    right = _padded_mask(gen, 4, 7)
    garbage = torch.where(right, x, torch.full_like(x, 1e6))
    nan_pad = torch.where(right, x, torch.full_like(x, float("nan")))
    return _run("check_masked_mean", [
        case("all tokens valid", x, torch.ones(4, 7)),
        case("right padding (float mask)", x, right.float()),
        case("left padding (bool mask)", x, _padded_mask(gen, 4, 7, left=True)),
        case("padding holds 1e6", garbage, right.float()),
        case("padding holds NaN", nan_pad, right.float()),
        case("one valid token", x, torch.zeros(4, 7).index_put_((torch.tensor([2]), torch.tensor([3])), torch.tensor(1.0))),
    ])


def check_pairwise_reward_loss(fn: Callable) -> CheckReport:
    """Check `fn(chosen, rejected, margin=None) -> scalar`. Chapter 01's exercise."""
    gen = torch.Generator().manual_seed(1)
    c, r = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    margin = torch.randint(0, 4, (16,), generator=gen).float()

    def case(label, chosen, rejected, m=None):
        def run():
            got = fn(chosen, rejected) if m is None else fn(chosen, rejected, m)
            return _compare(label, _first_tensor(got), pairwise_reward_loss(chosen, rejected, m), 1e-5, 1e-5)
        return label, run

    return _run("check_pairwise_reward_loss", [
        case("random scores", c, r),
        case("equal scores give log 2", c, c.clone()),
        case("with margins", c, r, margin),
        case("rejected far above chosen (stability)", torch.full((4,), -200.0), torch.full((4,), 200.0)),
        case("chosen far above rejected", torch.full((4,), 200.0), torch.full((4,), -200.0)),
    ])


def check_logprobs_from_logits(fn: Callable) -> CheckReport:
    """Check `fn(logits, labels) -> (B, T)` log-probs. Chapter 02's exercise."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 5), generator=gen)

    def case(label, z, y, atol=1e-5):
        return label, lambda: _compare(label, fn(z.clone(), y.clone()), logprobs_from_logits(z, y), atol, 1e-5)

    return _run("check_logprobs_from_logits", [
        case("random logits", logits, labels),
        case("large logits (overflow of a naive softmax)", logits * 1000.0, labels, atol=1e-2),
        case("one-token batch", logits[:1, :1], labels[:1, :1]),
        case("bf16 logits", logits.bfloat16(), labels, atol=2e-2),
    ])


def check_kl_penalty(fn: Callable, kind: str = "k3") -> CheckReport:
    """Check a learner's per-token KL estimator `fn(logprobs, ref_logprobs)` of one `kind`.

    Chapter 03's exercise uses k3. Near d = 0 the tolerance is absolute 1e-8,
    which a naive fp32 `exp(d) - 1 - d` misses.
    """
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 6, generator=gen) * 5
    ref = logp + torch.randn(4, 6, generator=gen)

    def case(label, a, b, atol=1e-6):
        def run():
            got = fn(a, b)
            problem = _compare(label, got, kl_penalty(a, b, kind), atol, 1e-4)
            if problem is None and kind == "k3" and bool((got < 0).any()):
                problem = f"{label}: k3 must never be negative, got {got.min().item():.3g}"
            return problem
        return label, run

    tiny = logp + torch.linspace(-1e-3, 1e-3, 24).view(4, 6)
    return _run(f"check_kl_penalty[{kind}]", [
        case("random log-probs", logp, ref),
        case("policy equals reference", logp, logp.clone()),
        case("tiny differences (|d| <= 1e-3)", logp, tiny, atol=1e-8),
        case("large differences", logp, logp + 8.0),
    ])


def check_gae_advantages(fn: Callable) -> CheckReport:
    """Check `fn(values, rewards, mask, gamma, lam) -> (advantages, returns)`. Chapter 04's exercise."""
    gen = torch.Generator().manual_seed(4)
    v, r = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    right = _padded_mask(gen, 3, 8)

    def case(label, values, rewards, mask, gamma=1.0, lam=0.95):
        def run():
            got = fn(values.clone(), rewards.clone(), mask.clone(), gamma, lam)
            adv, ret = gae_advantages(values, rewards, mask, gamma, lam)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                return f"{label}: expected a tuple (advantages, returns)"
            return _compare(f"{label} (advantages)", got[0], adv, 1e-5, 1e-5) or \
                _compare(f"{label} (returns)", got[1], ret, 1e-5, 1e-5)
        return label, run

    return _run("check_gae_advantages", [
        case("no padding", v, r, torch.ones(3, 8)),
        case("right padding", v, r, right.float()),
        case("padding holds garbage", torch.where(right, v, 1e3), torch.where(right, r, -1e3), right.float()),
        case("lambda = 0 (TD residual)", v, r, right.float(), 0.9, 0.0),
        case("gamma = lambda = 1 (reward-to-go)", v, r, right.float(), 1.0, 1.0),
        case("gamma = 0.9, lambda = 0.8", v, r, right.float(), 0.9, 0.8),
    ])


def check_policy_loss(fn: Callable) -> CheckReport:
    """Check `fn(logprobs, old_logprobs, advantages, mask, cliprange) -> loss` (or `(loss, stats)`).

    Compares the loss value and its gradient with respect to `logprobs`, so a
    min/max mix-up that happens to give the right value still fails.
    Chapter 05's exercise.
    """
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 6, generator=gen) * 3
    adv = torch.randn(4, 6, generator=gen)
    mask = _padded_mask(gen, 4, 6).float()

    def case(label, shift):
        def run():
            new = (old + shift).clone().requires_grad_(True)
            ref_new = (old + shift).clone().requires_grad_(True)
            got = _first_tensor(fn(new, old.clone(), adv.clone(), mask.clone(), 0.2))
            expected, _ = policy_loss(ref_new, old, adv, mask, 0.2)
            problem = _compare(f"{label} (loss)", got, expected, 1e-5, 1e-5)
            if problem:
                return problem
            got.backward()
            expected.backward()
            if new.grad is None:
                return f"{label}: the loss does not depend on logprobs (no gradient)"
            return _compare(f"{label} (gradient)", new.grad, ref_new.grad, 1e-6, 1e-5)
        return label, run

    return _run("check_policy_loss", [
        case("ratio exactly 1", torch.zeros(4, 6)),
        case("small policy change", 0.05 * torch.randn(4, 6, generator=gen)),
        case("large policy change (clip active)", 0.6 * torch.randn(4, 6, generator=gen)),
        case("garbage in padding", torch.where(mask.bool(), 0.1, 50.0)),
    ])


def check_pku_preference(fn: Callable) -> CheckReport:
    """Check `fn(row) -> (chosen, rejected, margin)` on PKU-SafeRLHF rows. Chapter 06's exercise.

    Covers the four safety cases (only 0 safe, only 1 safe, both safe, both
    unsafe) with `better_response_id` and `safer_response_id` pointing both ways,
    against `pku_saferlhf_to_preference` (responses compared as raw text).
    """
    from marlhf_edu.data.formats import pku_saferlhf_to_preference
    from marlhf_edu.data.template import format_completion

    def case(safe0, safe1, better, safer):
        row = {"prompt": "q", "response_0": "answer zero", "response_1": "answer one",
               "is_response_0_safe": safe0, "is_response_1_safe": safe1,
               "better_response_id": better, "safer_response_id": safer}
        label = f"safe=({safe0}, {safe1}), better={better}, safer={safer}"

        def run():
            got = fn(dict(row))
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                return f"{label}: expected a tuple (chosen, rejected, margin)"
            ref = pku_saferlhf_to_preference(row)
            names = {format_completion(row[k]): row[k] for k in ("response_0", "response_1")}
            want = (names[ref["chosen"]], names[ref["rejected"]], ref["margin"])
            if (got[0], got[1]) != want[:2]:
                return f"{label}: chose {got[0]!r} over {got[1]!r}, expected {want[0]!r} over {want[1]!r}"
            if float(got[2]) != want[2]:
                return f"{label}: margin {got[2]}, expected {want[2]}"
            return None
        return label, run

    return _run("check_pku_preference", [case(s0, s1, b, s) for s0, s1 in ((True, False), (False, True), (True, True),
                                                                           (False, False)) for b, s in ((0, 1), (1, 0))])


def check_position_ids(fn: Callable) -> CheckReport:
    """Check `fn(attention_mask) -> position_ids` (B, T): real tokens numbered 0, 1, … whatever the padding.

    Only real tokens are compared (what a model puts at padded positions is
    irrelevant). Chapter 07's exercise.
    """
    from marlhf_edu.scoring import position_ids_from_mask

    gen = torch.Generator().manual_seed(7)

    def case(label, mask):
        def run():
            got = fn(mask.clone())
            if not isinstance(got, torch.Tensor) or got.shape != mask.shape:
                return f"{label}: expected a tensor of shape {tuple(mask.shape)}"
            real = mask.bool()
            return _compare(label + " (real tokens)", got[real].double(), position_ids_from_mask(mask)[real].double(), 0, 0)
        return label, run

    return _run("check_position_ids", [
        case("no padding", torch.ones(3, 6, dtype=torch.long)),
        case("right padding", _padded_mask(gen, 4, 7).long()),
        case("left padding", _padded_mask(gen, 4, 7, left=True).long()),
        case("single real token", torch.tensor([[0, 0, 0, 1], [1, 0, 0, 0]])),
    ])


def check_response_mask(fn: Callable) -> CheckReport:
    """Check `fn(response_ids, eos_token_id) -> mask` (B, R): tokens up to and including the first EOS.

    Chapter 08's exercise; compared with `marlhf_edu.ppo.response_mask_from_ids`.
    """
    from marlhf_edu.ppo.trainer import response_mask_from_ids

    eos, pad = 2, 3

    def case(label, ids):
        def run():
            got = fn(ids.clone(), eos)
            if not isinstance(got, torch.Tensor) or got.shape != ids.shape:
                return f"{label}: expected a tensor of shape {tuple(ids.shape)}"
            return _compare(label, got.double(), response_mask_from_ids(ids, eos).double(), 0, 0)
        return label, run

    gen = torch.Generator().manual_seed(8)
    random_ids = torch.randint(0, 12, (6, 9), generator=gen)
    return _run("check_response_mask", [
        case("EOS then padding", torch.tensor([[5, 6, eos, pad, pad], [5, 6, 7, eos, pad]])),
        case("no EOS (hit the length limit)", torch.tensor([[5, 6, 7, 8, 9]])),
        case("EOS as the first token", torch.tensor([[eos, pad, pad, pad]])),
        case("a second EOS after the first", torch.tensor([[5, eos, 7, eos, 8]])),
        case("pad sampled before EOS", torch.tensor([[5, pad, 6, eos, pad]])),
        case("random ids", random_ids),
    ])


def check_nf4_bytes(fn: Callable) -> CheckReport:
    """Check `fn(d_in, d_out, double_quant) -> int`: the bytes bitsandbytes holds for one NF4 linear weight.

    Chapter 09's exercise; compared with `marlhf_edu.memory.plan.linear_weight_bytes`
    (blocks of 64, the 16-entry fp32 NF4 code table; with double quantization the
    absmax as bytes, an fp32 offset, fp32 scales per 256 absmax values and a
    256-entry fp32 code table), which itself matches measured storages exactly.
    """
    from marlhf_edu.memory.plan import MemorySettings, linear_weight_bytes

    def case(label, d_in, d_out, double_quant):
        def run():
            got = fn(d_in, d_out, double_quant)
            expected = linear_weight_bytes(d_in, d_out, MemorySettings(load_in_4bit=True, double_quant=double_quant))
            if not isinstance(got, int) or got != expected:
                return f"{label}: got {got!r}, expected {expected} bytes"
            return None
        return label, run

    return _run("check_nf4_bytes", [
        case("tiny q_proj 192×192, plain", 192, 192, False),
        case("tiny q_proj 192×192, double quant", 192, 192, True),
        case("Llama-2-7B up_proj 4096×11008, plain", 4096, 11008, False),
        case("Llama-2-7B up_proj 4096×11008, double quant", 4096, 11008, True),
        case("a partial last block (10×10), double quant", 10, 10, True),
        case("an odd number of weights (7×9): one byte holds the last nibble", 7, 9, False),
        case("more than 256 blocks but not a multiple (4096×5), double quant", 4096, 5, True),
    ])
