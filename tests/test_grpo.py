"""GRPO's group-relative advantage and loss written in the package, and trl's GRPOTrainer checked against them."""

import random
import tempfile
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from marlhf_edu.math.grpo import group_relative_advantages, grpo_loss
from marlhf_edu.math.kl import kl_penalty


def test_group_relative_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0])
    a = group_relative_advantages(r, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()  # Bessel: sqrt(0.25) = 0.5
    assert torch.allclose(a[:4], (torch.tensor([0.75, -0.25, -0.25, -0.25])) / (std + 1e-4))
    assert torch.equal(a[4:], torch.zeros(4))  # equal rewards in a group: no signal, not NaN
    assert torch.allclose(group_relative_advantages(r, 4, scale="none")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert torch.allclose(group_relative_advantages(r, 4, scale="batch"), (r - r.view(-1, 4).mean(-1).repeat_interleave(4)) / (r.std() + 1e-4))
    with pytest.raises(ValueError, match="groups of 3"):
        group_relative_advantages(r, 3)
    with pytest.raises(ValueError, match="scale"):
        group_relative_advantages(r, 4, scale="std")


def test_grpo_loss_at_the_old_policy_is_minus_the_mean_advantage():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] * 6]).bool()
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    assert grpo_loss(lp, lp, None, adv, mask).item() == pytest.approx(-adv.mean().item())
    # 'bnpo' weighs the advantages by length
    assert grpo_loss(lp, lp, None, adv, mask, aggregation="bnpo").item() == pytest.approx(
        -(adv * mask.sum(-1)).sum().item() / mask.sum().item())
    # the KL term: beta times k3 per token, averaged like the rest
    ref = lp - 0.3
    kl = kl_penalty(lp, ref, "k3")
    expected = -adv.mean() + 0.1 * (torch.where(mask, kl, 0.0).sum(-1) / mask.sum(-1)).mean()
    assert grpo_loss(lp, lp, ref, adv, mask, beta=0.1).item() == pytest.approx(expected.item())
    # garbage in padding cannot leak
    dirty = torch.where(mask, lp, torch.tensor(float("nan")))
    assert grpo_loss(dirty, lp, ref, adv, mask, beta=0.1).item() == pytest.approx(expected.item())
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp, None, adv, mask, beta=0.1)


def _expected_kl_gradient(weighted: bool, seed: int = 0):
    """E_{y ~ π_old}[∇ grpo_loss's KL term] on one-token answers over 30 tokens, with π_old = π, exactly."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(30, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(30, generator=g, dtype=torch.float64), -1)
    logp = torch.log_softmax(logits, -1)
    one = torch.ones(1, 1, dtype=torch.bool)
    terms = torch.stack([grpo_loss(logp[y].view(1, 1), logp[y].detach().view(1, 1), ref[y].view(1, 1),
                                   torch.zeros(1, dtype=torch.float64), one, beta=1.0,
                                   kl_importance_weighted=weighted) for y in range(30)])
    (logp.exp().detach() * terms).sum().backward(retain_graph=True)  # each answer weighted by how often π_old samples it
    reverse = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits, retain_graph=True)[0]
    forward = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), logits)[0]
    return logits.grad, reverse, forward


@pytest.mark.parametrize("seed", [0, 1])
def test_the_ratio_weight_turns_k3s_gradient_from_forward_to_reverse_kl(seed):
    # at ρ = 1 the weight's value is 1 but its gradient is ∇log π: with it, E[∇] = ∇KL(π‖π_ref) (reverse);
    # without it (DeepSeekMath's k3), E[∇] = ∇KL(π_ref‖π) (forward)
    weighted, reverse, forward = _expected_kl_gradient(True, seed)
    plain, _, _ = _expected_kl_gradient(False, seed)
    assert (weighted - reverse).norm() < 1e-12 < 1e-2 < (weighted - forward).norm()
    assert (plain - forward).norm() < 1e-12 < 1e-2 < (plain - reverse).norm()


def test_grpo_loss_clips_like_ppo():
    old = torch.zeros(1, 1)
    up = torch.full((1, 1), 0.5, requires_grad=True)  # ratio e^0.5 = 1.65 > 1.2
    grpo_loss(up, old, None, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool)).backward()
    assert up.grad.item() == 0.0  # positive advantage beyond 1 + epsilon: no gradient
    down = torch.full((1, 1), 0.5, requires_grad=True)
    grpo_loss(down, old, None, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool)).backward()
    assert down.grad.item() == pytest.approx(torch.exp(torch.tensor(0.5)).item())  # negative: the unclipped term


def test_trl_grpo_with_lora_matches_the_package():
    """What trl's GRPOTrainer does on our behalf, pinned, with a LoRA policy on the tiny SFT model: advantages
    are rewards standardised within groups of num_generations; the reference is the disabled adapter; the loss is
    the clipped surrogate plus beta * ratio * k3. trl's configs default to bf16 autocast even on CPU, which
    changes log-probs by ~1e-2; the book turns it off (bf16=False), and the last check shows why."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from marlhf_edu.data.toyworld import ToyWorld
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.ppo.backends import sequence_logprobs
    from marlhf_edu.teaching.book import quietly

    assert GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True).bf16 is True  # trl's default, on CPU too
    torch.manual_seed(0)
    rng, given = random.Random(0), []

    def reward(completions, **_):
        given.extend(rng.gauss(0, 1) for _ in completions)
        return given[-len(completions):]

    with quietly():
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(SFT_DIR, dtype=torch.float32), reward_funcs=reward,
            train_dataset=Dataset.from_list([{"prompt": p.prompt} for p in ToyWorld().train_prompts[:16]]),
            processing_class=load_tokenizer(),
            args=GRPOConfig(output_dir=tempfile.mkdtemp(), beta=0.04, num_generations=4, per_device_train_batch_size=8,
                            max_completion_length=12, loss_type="grpo", bf16=False, report_to=[], use_cpu=True,
                            disable_tqdm=True),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    policy = trainer.model
    assert trainer.accelerator.mixed_precision == "no"
    with torch.no_grad():  # move the fresh adapter away from the reference
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    policy.eval()
    with quietly():
        out = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert torch.allclose(out["advantages"], group_relative_advantages(torch.tensor(given), 4), atol=1e-6)

    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    C, mask = out["completion_ids"].shape[1], out["completion_mask"].bool()

    def logprobs():  # the PPO engine's own per-token log-probs of the last C tokens
        return sequence_logprobs(policy, ids, att, C, 1.0)[0]

    with torch.no_grad(), policy.disable_adapter():
        ref = logprobs()
    assert (ref - out["ref_per_token_logps"])[mask].abs().max() < 1e-5  # the reference is the disabled adapter
    lp = logprobs()
    assert (lp.detach() - ref)[mask].abs().max() > 1e-3  # and the policy really differs from it
    g = torch.Generator().manual_seed(1)  # an older policy and a farther reference, so clip and KL both act
    inputs = {**out, "old_per_token_logps": lp.detach() + 0.3 * torch.randn(lp.shape, generator=g),
              "ref_per_token_logps": lp.detach() - 0.5 * torch.rand(lp.shape, generator=g)}
    with torch.no_grad():
        trl_loss = trainer._compute_loss(policy, inputs).item()
    ours = grpo_loss(lp, inputs["old_per_token_logps"], inputs["ref_per_token_logps"], out["advantages"], mask,
                     epsilon=0.2, beta=0.04)
    assert trl_loss == pytest.approx(ours.item(), abs=1e-6)
    assert abs(grpo_loss(lp, inputs["old_per_token_logps"], inputs["ref_per_token_logps"], out["advantages"], mask,
                         beta=0.04, kl_importance_weighted=False).item() - trl_loss) > 1e-6


def _dr_grpo_batch():
    """Four answers of 2, 7, 4 and 5 tokens, right-padded to T = 7: lengths differ, so normalisers differ."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([2, 7, 4, 5])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    lp = -torch.rand(4, 7, generator=g, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(4, 7, generator=g, dtype=torch.float64)  # some ratios beyond 1 ± 0.2: clip acts
    ref = lp - 0.5 * torch.rand(4, 7, generator=g, dtype=torch.float64)
    adv = group_relative_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), 4, scale="none")
    return lp, old, ref, adv, mask, lengths


def test_dr_grpo_divides_the_token_sum_by_a_constant():
    lp, _, _, adv, mask, lengths = _dr_grpo_batch()
    # at the old policy every token's loss is -A_b: the sum is -Σ_b A_b |o_b|, over B L = 4 × 10
    ours = grpo_loss(lp, lp, None, adv, mask, aggregation="dr_grpo", max_length=10)
    assert ours.item() == pytest.approx(-(adv * lengths).sum().item() / 40, abs=1e-15)
    default = grpo_loss(lp, lp, None, adv, mask)
    assert default.item() == pytest.approx(-adv.mean().item(), abs=1e-15)
    assert abs(ours.item() - default.item()) > 0.04  # different lengths: the normalisers disagree (0.05 vs 0)
    # each token's gradient weight: -A_b / (B L) under dr_grpo, whatever |o_b|; -A_b / (B |o_b|) under grpo
    for aggregation, kw, per_answer in (("dr_grpo", {"max_length": 10}, torch.full((4,), 40.0, dtype=torch.float64)),
                                        ("grpo", {}, 4.0 * lengths.double())):
        x = lp.clone().requires_grad_(True)
        grpo_loss(x, lp, None, adv, mask, aggregation=aggregation, **kw).backward()
        expected = torch.where(mask, (-adv / per_answer)[:, None].expand(4, 7), 0.0)
        assert torch.allclose(x.grad, expected, rtol=0, atol=1e-15)
    # all answers as long as the limit: every normaliser is the same
    full = torch.ones(4, 10, dtype=torch.bool)
    lp10 = -torch.rand(4, 10, dtype=torch.float64)
    assert grpo_loss(lp10, lp10, None, adv, full, aggregation="dr_grpo", max_length=10).item() == pytest.approx(
        grpo_loss(lp10, lp10, None, adv, full).item(), abs=1e-15)
    with pytest.raises(ValueError, match="needs `max_length`"):
        grpo_loss(lp, lp, None, adv, mask, aggregation="dr_grpo")
    with pytest.raises(ValueError, match="7 tokens, more than `max_length` = 6"):
        grpo_loss(lp, lp, None, adv, mask, aggregation="dr_grpo", max_length=6)
    with pytest.raises(ValueError, match="only used by aggregation 'dr_grpo'"):
        grpo_loss(lp, lp, None, adv, mask, max_length=10)


def _trl_compute_loss(loss_type, logprobs, old_logprobs, ref_logprobs, advantages, mask, beta, max_completion_length):
    """trl 1.16's own `GRPOTrainer._compute_loss` on given log-probs, with no model: a stand-in `self` holds the
    attributes `GRPOTrainer.__init__` sets from the config (trl/trainer/grpo_trainer.py, lines 782-983), and
    returns `logprobs` as the model's per-token log-probs. Eval mode, so no gradient-accumulation division."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), loss_type=loss_type, beta=beta,
                      max_completion_length=max_completion_length, bf16=False, use_cpu=True, report_to=[])
    stub = SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, max_completion_length=args.max_completion_length,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, off_policy_mask_threshold=args.off_policy_mask_threshold,
        top_entropy_quantile=args.top_entropy_quantile, use_vllm=args.use_vllm, aux_loss_enabled=False,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        model=SimpleNamespace(training=False), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=SimpleNamespace(gather=lambda t: t, reduce=lambda t, reduction: t),  # one process
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None))
    B, T = mask.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": old_logprobs, "ref_per_token_logps": ref_logprobs}
    return GRPOTrainer._compute_loss(stub, None, inputs)


@pytest.mark.parametrize("loss_type, ours", [("dr_grpo", {"aggregation": "dr_grpo", "max_length": 12}),
                                             ("grpo", {}), ("bnpo", {"aggregation": "bnpo"})])
def test_trl_loss_types_match_the_package(loss_type, ours):
    """trl's loss and its gradient per token log-prob, for its `loss_type`s that the package has. The answers
    are padded to T = 7 < max_completion_length = 12: dr_grpo divides by B × 12, not by B × T."""
    lp, old, ref, adv, mask, _ = _dr_grpo_batch()
    x, y = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    theirs = _trl_compute_loss(loss_type, x, old, ref, adv, mask, beta=0.04, max_completion_length=12)
    mine = grpo_loss(y, old, ref, adv, mask, beta=0.04, **ours)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-12, abs=1e-15)
    theirs.backward(), mine.backward()
    assert torch.allclose(torch.where(mask, x.grad, 0.0), y.grad, rtol=0, atol=1e-12)  # float64 rounding apart
