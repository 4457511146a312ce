"""The DPO loss written in the package, and trl's DPOTrainer with a LoRA policy checked against it."""

import math
import tempfile

import pytest
import torch

from marlhf_edu.math.dpo import completion_logprobs, dpo_loss


def test_dpo_loss_by_hand():
    # one pair: chosen log-ratio 1.0 - 0.5 = 0.5, rejected -1.0 - (-0.5) = -0.5, beta 0.1 -> -log sigmoid(0.1)
    loss, chosen, rejected = dpo_loss(torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([0.5]),
                                      torch.tensor([-0.5]), beta=0.1)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.1))))
    assert chosen.item() == pytest.approx(0.05) and rejected.item() == pytest.approx(-0.05)
    # policy == reference: every pair contributes log 2, whatever the log-probs
    lp = torch.randn(5)
    assert dpo_loss(lp, lp - 3, lp, lp - 3)[0].item() == pytest.approx(math.log(2))
    # a huge margin stays finite and near 0; a huge wrong margin grows linearly, not to inf
    assert dpo_loss(torch.tensor([1e4]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]))[0].item() < 1e-6
    assert dpo_loss(torch.tensor([-1e4]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]))[0].item() \
        == pytest.approx(1e3)


def test_dpo_loss_gradient_raises_chosen_and_lowers_rejected():
    c, r = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    dpo_loss(c, r, torch.zeros(3), torch.zeros(3), beta=0.5)[0].backward()
    assert (c.grad < 0).all() and (r.grad > 0).all()  # descent raises log pi(chosen), lowers log pi(rejected)
    assert torch.allclose(c.grad, -r.grad) and c.grad[0].item() == pytest.approx(-0.5 * 0.5 / 3)


def test_dpo_loss_errors():
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=0)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        dpo_loss(*(torch.zeros(2, 3),) * 4)


def test_trl_dpo_with_lora_matches_the_package_and_uses_the_disabled_adapter_as_reference():
    """What trl's DPOTrainer does on our behalf, pinned: with a peft policy and no ref_model, the reference is
    the same model with its adapter disabled, log-probs are summed over the completion tokens, and the loss is
    the sigmoid DPO loss. A change in any of the three changes the number."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from marlhf_edu.data.toyworld import ToyWorld
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.teaching.book import quietly

    torch.manual_seed(0)
    with quietly():
        model = AutoModelForCausalLM.from_pretrained(SFT_DIR, dtype=torch.float32)
        trainer = DPOTrainer(
            model=model, train_dataset=ToyWorld().preference_dataset().select(range(8)),
            processing_class=load_tokenizer(),
            args=DPOConfig(output_dir=tempfile.mkdtemp(), beta=0.1, per_device_train_batch_size=4, report_to=[], bf16=False,
                           use_cpu=True, disable_tqdm=True),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    policy = trainer.model
    with torch.no_grad():  # a fresh adapter is the reference exactly (B = 0); move it so the test means something
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    batch = next(iter(trainer.get_train_dataloader()))
    policy.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(policy, batch).item()
        args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        pol = completion_logprobs(policy, *args)
        with policy.disable_adapter():
            ref = completion_logprobs(policy, *args)
    (pc, pr), (rc, rr) = pol.chunk(2), ref.chunk(2)  # trl's batch: all chosen, then all rejected
    ours, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert abs(ours.item() - math.log(2)) > 1e-3  # the policy really differs from the reference
    assert trl_loss == pytest.approx(ours.item(), abs=1e-5)


def test_tokenize_preference_pairs_splits_as_trl_prepares_its_training_data():
    """Chapter 12 scores held-out pairs with the ids trl trains on, without trl's private preparation: the
    package's tokenisation must equal what DPOTrainer stores in its (public) `train_dataset`, EOS included."""
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from marlhf_edu.data.toyworld import ToyWorld
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.math.dpo import tokenize_preference_pairs
    from marlhf_edu.teaching.book import quietly

    tok = load_tokenizer()
    pairs = ToyWorld().preference_dataset().select(range(12)).to_list()
    pairs[0] = {**pairs[0], "chosen": pairs[0]["chosen"] + tok.eos_token}  # already ends with EOS: not doubled
    from datasets import Dataset

    with quietly():
        trainer = DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(SFT_DIR, dtype=torch.float32),
            train_dataset=Dataset.from_list(pairs), processing_class=tok,
            args=DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], bf16=False, use_cpu=True, disable_tqdm=True))
    ours = tokenize_preference_pairs(pairs, tok)
    assert len(trainer.train_dataset) == len(ours)
    for row, mine in zip(trainer.train_dataset, ours):
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert row[key] == mine[key], key
    assert ours[0]["chosen_ids"][-1] == tok.eos_token_id and ours[0]["chosen_ids"][-2] != tok.eos_token_id
    assert all(r["rejected_ids"][-1] == tok.eos_token_id for r in ours)
    with pytest.raises(ValueError, match="pair 1 needs text under"):
        tokenize_preference_pairs([pairs[0], {"prompt": "x", "chosen": "y"}], tok)
