"""Checkers for the silent-bug problem sets (notebooks/problems/).

Each problem set hands the learner functions that run without error and give
plausible numbers, but are wrong. The learner writes the fixed function; a
`check_fix_…` here runs it on the cases that expose the bug and compares with
the behaviour the book relies on. Like `marlhf_edu.teaching.exercises`, checkers never
read source code, return a `CheckReport` (graded cells pass it to `exercises.grade`), take
`seed=` for hidden tests, and withhold the package functions that would answer
the problem outright.

  p1_math            chapters 00-06: shift, KL sign, GAE through padding, whitening order, whitening statistics
  p2_loop            chapters 07-09: score at a pad, pad = EOS labels, score position, temperature, value positions
  p3_multi_adapter   chapter 10: set_adapter, the reference, LoRA merge scaling, LoRA initialisation
"""

from __future__ import annotations

from typing import Callable

import torch

from marlhf_edu.math.gae import gae_advantages
from marlhf_edu.math.kl import token_level_rewards
from marlhf_edu.math.logprobs import logprobs_from_logits
from marlhf_edu.math.masked import last_valid_index, masked_whiten
from marlhf_edu.teaching.checks.part1_math import check_gae_advantages, check_tempered_logprobs
from marlhf_edu.teaching.grading import CheckReport, _compare, _learner, _padded_mask, _run, _withholds


def _renamed(report: CheckReport, name: str) -> CheckReport:
    report.name = name
    return report





@_withholds("marlhf_edu.math.logprobs.logprobs_from_logits", "marlhf_edu.ppo.backends.response_logprobs")
def check_fix_shift(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(logits, input_ids) -> (B, T-1)`: the log-prob of each next token (logits at t score token t+1)."""
    fn = _learner(fn, check_fix_shift)
    gen = torch.Generator().manual_seed(seed)

    def case(label, B, T, V):
        logits = torch.randn(B, T, V, generator=gen) * 2
        ids = torch.randint(0, V, (B, T), generator=gen)

        def run():
            expected = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
            return _compare(label, fn(logits.clone(), ids.clone()), expected, 1e-5, 1e-5)
        return label, run

    return _run("check_fix_shift", seed=seed, cases=[case("a batch of 3", 3, 6, 11), case("one sequence of 2 tokens", 1, 2, 5),
                                    case("a larger vocabulary", 2, 5, 257)])


@_withholds("marlhf_edu.math.kl.token_level_rewards", "marlhf_edu.math.kl.kl_penalty")
def check_fix_kl_sign(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(scores, logprobs, ref_logprobs, mask, beta) -> (B, T)`: −β·k1 per token plus the score at the last one."""
    fn = _learner(fn, check_fix_kl_sign)
    gen = torch.Generator().manual_seed(seed)

    def case(label, beta, shift):
        mask = _padded_mask(gen, 4, 7)
        logp = -torch.rand(4, 7, generator=gen) * 3
        ref = logp + shift * torch.randn(4, 7, generator=gen)
        scores = torch.randn(4, generator=gen)

        def run():
            expected = token_level_rewards(scores, logp, ref, mask, beta)[0]
            got = fn(scores.clone(), logp.clone(), ref.clone(), mask.clone(), beta)
            return _compare(label, torch.where(mask, got, 0.0) if isinstance(got, torch.Tensor) else got, expected,
                            1e-6, 1e-5)
        return label, run

    return _run("check_fix_kl_sign", seed=seed, cases=[case("beta 0.1", 0.1, 0.5), case("beta 0.5, policy far from reference", 0.5, 2.0),
                                      case("beta 0 (score only)", 0.0, 1.0)])


def check_fix_gae_padding(fn: Callable, seed: int = 4) -> CheckReport:
    """`fn(values, rewards, mask, gamma, lam) -> (advantages, returns)`: padding is terminal."""
    return _renamed(check_gae_advantages(fn, seed=seed), "check_fix_gae_padding")


@_withholds()
def check_fix_whiten_order(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(values, rewards, mask, gamma, lam) -> (advantages, returns)`: whitened advantages, returns from raw ones.

    Only real tokens are compared.
    """
    gen = torch.Generator().manual_seed(seed)

    def case(label, scale):
        mask = _padded_mask(gen, 4, 8)
        values, rewards = torch.randn(4, 8, generator=gen), scale * torch.randn(4, 8, generator=gen)

        def run():
            adv, ret = gae_advantages(values, rewards, mask, 1.0, 0.95)
            got = fn(values.clone(), rewards.clone(), mask.clone(), 1.0, 0.95)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                return f"{label}: expected a tuple (advantages, returns)"
            return _compare(f"{label} (advantages)", got[0][mask], masked_whiten(adv, mask)[mask], 1e-5, 1e-5) or \
                _compare(f"{label} (returns)", got[1][mask], ret[mask], 1e-5, 1e-5)
        return label, run

    return _run("check_fix_whiten_order", seed=seed, cases=[case("rewards of scale 1", 1.0), case("rewards of scale 10", 10.0)])


@_withholds("marlhf_edu.math.masked.masked_whiten", "marlhf_edu.math.masked.masked_var")
def check_fix_whiten_stats(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(values, mask) -> (B, T)`: whitened with the mean and unbiased variance of the real entries only."""
    fn = _learner(fn, check_fix_whiten_stats)
    gen = torch.Generator().manual_seed(seed)

    def case(label, B, T, pad_value):
        mask = _padded_mask(gen, B, T)
        values = torch.where(mask, 3 + 2 * torch.randn(B, T, generator=gen), pad_value)

        def run():
            got = fn(values.clone(), mask.clone())
            return _compare(label, got[mask] if isinstance(got, torch.Tensor) else got, masked_whiten(values, mask)[mask],
                            1e-5, 1e-5)
        return label, run

    return _run("check_fix_whiten_stats", seed=seed, cases=[case("zeros in the padding", 4, 9, 0.0), case("garbage in the padding", 4, 9, 50.0),
                                           case("mostly padding", 6, 20, 0.0)])





@_withholds("marlhf_edu.math.masked.last_valid_index", "marlhf_edu.math.scoring.sequence_scores")
def check_fix_score_position(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(per_position_scores, attention_mask) -> (B,)`: the score at each row's last real token, either padding side."""
    fn = _learner(fn, check_fix_score_position)
    gen = torch.Generator().manual_seed(seed)

    def case(label, mask):
        scores = torch.randn(*mask.shape, generator=gen)

        def run():
            expected = scores[torch.arange(mask.shape[0]), last_valid_index(mask.bool())]
            return _compare(label, fn(scores.clone(), mask.clone()), expected, 0, 0)
        return label, run

    return _run("check_fix_score_position", seed=seed, cases=[
        case("right padding", _padded_mask(gen, 5, 8).long()),
        case("no padding", torch.ones(3, 6, dtype=torch.long)),
        case("left padding", _padded_mask(gen, 5, 8, left=True).long()),
        case("one real token", torch.tensor([[1, 0, 0, 0], [0, 0, 0, 1]])),
    ])


@_withholds()
def check_fix_pad_eos(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(input_ids, attention_mask, prompt_lengths, pad_token_id) -> labels`: -100 on prompt and padding only.

    The EOS that ends each answer keeps its label even when the tokenizer's pad id equals its EOS id.
    """
    gen = torch.Generator().manual_seed(seed)
    eos = 2

    def case(label, pad_id, left):
        mask = _padded_mask(gen, 4, 9, left=left).long()
        ids = torch.randint(4, 20, (4, 9), generator=gen)
        last = last_valid_index(mask.bool())
        ids[torch.arange(4), last] = eos  # every answer ends with EOS
        ids = torch.where(mask.bool(), ids, pad_id)
        first = (mask.cumsum(1) == 1).long().argmax(1)
        prompt_lengths = first + torch.randint(1, 3, (4,), generator=gen)  # prompt counted from the row's start
        positions = torch.arange(9)[None, :]

        def run():
            expected = torch.where(mask.bool() & (positions >= prompt_lengths[:, None]), ids, -100)
            got = fn(ids.clone(), mask.clone(), prompt_lengths.clone(), pad_id)
            return _compare(label, got.double() if isinstance(got, torch.Tensor) else got, expected.double(), 0, 0)
        return label, run

    return _run("check_fix_pad_eos", seed=seed, cases=[case("pad id differs from EOS", 0, False), case("pad id equals EOS", eos, False),
                                      case("pad id equals EOS, left padding", eos, True)])


@_withholds("marlhf_edu.math.kl.token_level_rewards", "marlhf_edu.math.masked.last_valid_index")
def check_fix_score_lands(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(scores, kls, mask, beta) -> (B, T)`: −β·KL per real token, plus each row's score on its last real token."""
    fn = _learner(fn, check_fix_score_lands)
    gen = torch.Generator().manual_seed(seed)

    def case(label, mask):
        B, T = mask.shape
        kls = torch.rand(B, T, generator=gen)
        scores = torch.randn(B, generator=gen)

        def run():
            m = mask.bool()
            expected = torch.where(m, -0.1 * kls, 0.0)
            expected[torch.arange(B), last_valid_index(m)] += scores
            got = fn(scores.clone(), kls.clone(), mask.clone(), 0.1)
            return _compare(label, torch.where(m, got, 0.0) if isinstance(got, torch.Tensor) else got, expected, 1e-6, 1e-6)
        return label, run

    return _run("check_fix_score_lands", seed=seed, cases=[case("no padding", torch.ones(3, 6)), case("right padding", _padded_mask(gen, 5, 8).float()),
                                          case("one real token", torch.tensor([[1.0, 0, 0], [1, 1, 0]]))])


def check_fix_sampling_temperature(fn: Callable, seed: int = 2) -> CheckReport:
    """`fn(logits, response_ids, temperature) -> (B, R)`: log-probs under the distribution that sampled."""
    return _renamed(check_tempered_logprobs(fn, seed=seed), "check_fix_sampling_temperature")


@_withholds("marlhf_edu.ppo.backends.response_values")
def check_fix_value_positions(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(values_all, n_response) -> (B, R)`: the value of the state *before* each response token.

    `values_all` (B, L) is the critic's output at every position of prompt + response; the state before
    response token j is position L − R − 1 + j, the same position whose logits scored that token.
    """
    fn = _learner(fn, check_fix_value_positions)
    gen = torch.Generator().manual_seed(seed)

    def case(label, B, L, R):
        values = torch.randn(B, L, generator=gen)

        def run():
            return _compare(label, fn(values.clone(), R), values[:, L - R - 1:L - 1], 0, 0)
        return label, run

    return _run("check_fix_value_positions", seed=seed, cases=[case("4 response tokens after 6", 2, 10, 4), case("one response token", 3, 5, 1),
                                              case("a one-token prompt", 2, 8, 7)])





def tiny_peft_model(seed: int = 0, lora_b: float = 0.0):
    """A 1-layer Llama with LoRA adapters `policy`, `value` (trainable) and `reward` (frozen); `policy` active.

    `lora_b` > 0 fills every LoRA B with noise of that size so adapters change the output (a trained state).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(config).eval(), lora, adapter_name="policy")
    model.add_adapter("value", lora)
    model.add_adapter("reward", lora)
    for name, p in model.named_parameters():
        if lora_b and "lora_B" in name:
            with torch.no_grad():
                p.normal_(0, lora_b)
        p.requires_grad_("lora_" in name and (".policy." in name or ".value." in name))
    model.set_adapter("policy")
    for name, p in model.named_parameters():  # set_adapter freezes `value`: the state the engine keeps
        p.requires_grad_("lora_" in name and (".policy." in name or ".value." in name))
    return model


def _trainable_adapters(model) -> set[str]:
    found = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            found.add(next((a for a in ("policy", "value", "reward") if f".{a}." in name), "base"))
    return found


@_withholds()
def check_fix_switch(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(model, name)`: make adapter `name` active while `policy` and `value` both stay trainable (reward frozen)."""
    def case(label, sequence):
        def run():
            model = tiny_peft_model(seed)
            for name in sequence:
                fn(model, name)
                if model.active_adapter != name:
                    return f"{label}: active adapter is {model.active_adapter!r} after switching to {name!r}"
                trainable = _trainable_adapters(model)
                if trainable != {"policy", "value"}:
                    return f"{label}: after switching to {name!r} the trainable adapters are {sorted(trainable)}, " \
                           "expected ['policy', 'value']"
            return None
        return label, run

    return _run("check_fix_switch", seed=seed, cases=[case("to value", ["value"]), case("to value and back", ["value", "policy"]),
                                     case("to reward and back", ["reward", "policy"])])


@_withholds()
def check_fix_reference(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(model, input_ids) -> (B, T-1)`: next-token log-probs of the base with every adapter disabled.

    Afterwards the model must be as it was: `policy` active and applied.
    """
    def case(label, B, T):
        def run():
            model = tiny_peft_model(seed, lora_b=0.5)
            ids = torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(seed + T))
            with torch.no_grad():
                policy_before = model(input_ids=ids).logits
                with model.disable_adapter():
                    base = model(input_ids=ids).logits
            expected = logprobs_from_logits(base[:, :-1], ids[:, 1:])
            problem = _compare(label, fn(model, ids.clone()), expected, 1e-5, 1e-5)
            if problem:
                return problem
            with torch.no_grad():
                if not torch.allclose(model(input_ids=ids).logits, policy_before):
                    return f"{label}: the policy's output changed after computing the reference"
            return None
        return label, run

    return _run("check_fix_reference", seed=seed, cases=[case("two sequences of 6", 2, 6), case("one sequence of 3", 1, 3)])


@_withholds()
def check_fix_merge(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(weight, lora_A, lora_B, alpha, r) -> weight'`: the merged weight peft's `merge_and_unload` produces."""
    from peft import LoraConfig, get_peft_model

    def case(label, d_in, d_out, r, alpha):
        def run():
            torch.manual_seed(seed)
            base = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False))
            model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=["0"]))
            layer = model.base_model.model[0]
            with torch.no_grad():
                layer.lora_B["default"].weight.normal_()
            weight = layer.base_layer.weight.detach().clone()
            A, B = layer.lora_A["default"].weight.detach().clone(), layer.lora_B["default"].weight.detach().clone()
            expected = model.merge_and_unload()[0].weight.detach()
            return _compare(label, fn(weight, A, B, alpha, r), expected, 1e-5, 1e-5)
        return label, run

    return _run("check_fix_merge", seed=seed, cases=[case("r = 4, alpha = 8", 6, 5, 4, 8), case("r = 16, alpha = 16", 12, 8, 16, 16),
                                    case("r = 8, alpha = 32", 7, 9, 8, 32)])


@_withholds()
def check_fix_lora_init(fn: Callable, seed: int = 0) -> CheckReport:
    """`fn(d_in, d_out, r, generator) -> (A, B)`: A (r, d_in) random, B (d_out, r) zero, so W + BA = W at step 0."""
    def case(label, d_in, d_out, r):
        def run():
            got = fn(d_in, d_out, r, torch.Generator().manual_seed(seed))
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                return f"{label}: expected a tuple (A, B)"
            A, B = got
            if tuple(A.shape) != (r, d_in) or tuple(B.shape) != (d_out, r):
                return f"{label}: shapes A {tuple(A.shape)}, B {tuple(B.shape)}; expected {(r, d_in)} and {(d_out, r)}"
            if not torch.equal(B, torch.zeros_like(B)):
                return f"{label}: B is not zero, so the policy differs from the reference before any update"
            if torch.equal(A, torch.zeros_like(A)):
                return f"{label}: A is zero too, so no gradient ever reaches B (and A's gradient is B·… = 0)"
            return None
        return label, run

    return _run("check_fix_lora_init", seed=seed, cases=[case("64 → 64, r = 8", 64, 64, 8), case("16 → 32, r = 4", 16, 32, 4)])
