"""Forwards over the columns a chunk of rows uses (`marlhf_edu.ppo.used_columns`), and the rollout that sorts each
chunk's rows by length before cutting: every row's old log-probs, values, reference log-probs and score must still be
its own, equal to a forward over the whole padded batch up to rounding."""

from __future__ import annotations

import pytest
import torch
from conftest import build_trainer

from marlhf_edu.math.scoring import append_missing_eos
from marlhf_edu.ppo import FourModelBackend
from marlhf_edu.ppo import trainer as trainer_module
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
from marlhf_edu.ppo.trainer import cuts_policy_forwards, splits_no_grad_forwards
from marlhf_edu.ppo.used_columns import packed, pad_columns, right_aligned, unpacked

SMALL = dict(batch_size=8, mini_batch_size=4, micro_batch_size=2, forward_batch_size=8, max_new_tokens=12,
             actor_lora_r=8, actor_lora_alpha=16, device="cpu", eval_repeats=0, learning_rate=1e-3)
#: fp32 rounding of the same rows computed in batches of other shapes (measured below 2e-6 on the tiny model)
TOLERANCE = 1e-4


def test_packed_rows_hold_each_prompt_and_response_together():
    # P = 5 prompt columns (left-padded), R = 4 response columns (masked after EOS)
    ids = torch.tensor([[0, 0, 11, 12, 13, 21, 22, 0, 0],
                        [0, 0, 0, 14, 15, 23, 0, 0, 0],
                        [16, 17, 18, 19, 20, 24, 25, 26, 27]])
    mask = (ids != 0).long()
    got_ids, got_mask, r, lengths = packed(ids, mask, 4)
    assert lengths.tolist() == [2, 1, 4] and r == 4
    # the longest row (5 + 4 tokens) sets the width; the prompt/response layout's cut would keep all 9 columns
    assert got_ids.tolist() == [[0, 0, 0, 0, 11, 12, 13, 21, 22], [0, 0, 0, 0, 0, 0, 14, 15, 23],
                                [16, 17, 18, 19, 20, 24, 25, 26, 27]]
    assert torch.equal(got_mask, (got_ids != 0).long())
    # short rows only: the width is the longest prompt + response, r the longest response
    got_ids, _, r, lengths = packed(ids[:2], mask[:2], 4)
    assert got_ids.tolist() == [[11, 12, 13, 21, 22], [0, 0, 14, 15, 23]] and r == 2
    for bad in (0, 9):
        with pytest.raises(ValueError, match="n_response"):
            packed(ids, mask, bad)


def test_unpacked_moves_each_response_back_to_the_front():
    # row 0 holds 2 response tokens in the last 2 of r = 3 columns, row 1 all 3, row 2 none
    x = torch.tensor([[9.0, 1.0, 2.0], [3.0, 4.0, 5.0], [7.0, 7.0, 7.0]], requires_grad=True)
    out = unpacked(x, torch.tensor([2, 3, 0]), 5)
    assert out.tolist() == [[1.0, 2.0, 0.0, 0.0, 0.0], [3.0, 4.0, 5.0, 0.0, 0.0], [0.0] * 5]
    out.sum().backward()
    assert x.grad.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # none into the prompt's column
    assert unpacked(None, torch.tensor([1]), 3) is None


def test_right_aligned_rows_end_in_the_last_column():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0, 0],
                        [0, 0, 0, 8, 9, 3, 0],
                        [0, 4, 4, 4, 4, 4, 4]])
    mask = (ids != 0).long()
    got_ids, got_mask = right_aligned(ids, mask)
    # 7 columns in the prompt/response layout; right-aligned, the longest row needs 6
    assert got_ids.tolist() == [[0, 0, 0, 5, 6, 7], [0, 0, 0, 8, 9, 3], [4, 4, 4, 4, 4, 4]]
    assert torch.equal(got_mask, (got_ids != 0).long())


def test_pad_columns_gives_back_the_batch_width():
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    out = pad_columns(x, 4)
    assert out.tolist() == [[1.0, 2.0, 0.0, 0.0]]
    out.sum().backward()
    assert x.grad.tolist() == [[1.0, 1.0]]
    assert pad_columns(None, 4) is None and pad_columns(x, 2) is x


@pytest.mark.parametrize("backend_cls", [MultiAdapterBackend, FourModelBackend])
def test_rollout_rows_keep_their_own_forwards(tmp_path, prompts, backend_cls):
    """The rollout sorts each chunk's rows by length and cuts each micro-batch to its columns; each row's results must
    come back to that row: equal, where the mask is 1, to one forward over the whole padded batch."""
    trainer = build_trainer(tmp_path, backend_cls, prompts, SMALL)
    be, cfg = trainer.backend, trainer.config
    widths, real = [], be.policy_forward

    def recording(input_ids, *a, **k):
        widths.append(tuple(input_ids.shape))
        return real(input_ids, *a, **k)

    be.policy_forward = recording
    torch.manual_seed(1)
    r = trainer.rollout(trainer.batch_prompts(0))
    be.policy_forward = real
    B, T = r.input_ids.shape
    R = r.n_response
    lengths = r.attention_mask.sum(1)
    assert len(set(lengths.tolist())) > 2  # rows of different lengths, else nothing here is tested
    assert sum(b * t for b, t in widths) < B * T  # the micro-batches saw fewer columns than the padded batch

    with torch.no_grad():
        logprobs, values, _ = be.policy_forward(r.input_ids, r.attention_mask, R, cfg.temperature)
        ref = be.reference_logprobs(r.input_ids, r.attention_mask, R, cfg.temperature)
        ids, mask = append_missing_eos(r.input_ids, r.attention_mask, r.has_eos, be.tokenizer.eos_token_id,
                                       be.tokenizer.pad_token_id)
        scores = be.scores(ids, mask)
    m = r.response_mask
    for name, got, want in (("logprobs", r.logprobs, logprobs), ("values", r.values, values),
                            ("ref_logprobs", r.ref_logprobs, ref)):
        assert (got[m] - want[m].float()).abs().max() < TOLERANCE, name
    assert (r.raw_scores - scores).abs().max() < TOLERANCE


def test_the_updates_cut_forward_has_the_whole_batchs_gradient(tmp_path, prompts):
    trainer = build_trainer(tmp_path, MultiAdapterBackend, prompts, SMALL)
    be, cfg = trainer.backend, trainer.config
    torch.manual_seed(1)
    r = trainer.rollout(trainer.batch_prompts(0))
    rows = torch.argsort(r.attention_mask.sum(1))[:4]  # the four shortest: columns to cut on both sides
    ids, mask, R = r.input_ids[rows], r.attention_mask[rows], r.n_response
    assert packed(ids, mask, R)[0].shape[1] < ids.shape[1]
    params = [p for group in be.parameter_groups().values() for p in group if p.requires_grad]
    m = r.response_mask[rows]

    def grads(forward):
        for p in params:
            p.grad = None
        lp, v, ent = forward(ids, mask, R)
        (lp[m].sum() + v[m].sum() + ent[m].sum()).backward()
        return lp.detach(), [p.grad.clone() for p in params]

    cut_lp, cut_grads = grads(lambda i, a, n: trainer._policy_forward(i, a, n, with_entropy=True))
    full_lp, full_grads = grads(lambda i, a, n: be.policy_forward(i, a, n, cfg.temperature, with_entropy=True))
    assert cut_lp.shape == full_lp.shape
    assert (cut_lp[m] - full_lp[m]).abs().max() < TOLERANCE
    for a, b in zip(cut_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_policy_forwards_are_cut_only_where_rollout_and_update_stay_alike(tmp_path, prompts, monkeypatch):
    """On a GPU, kernels round by batch shape: with several rows per forward the update's micro-batch (other rows,
    so another cut) would not reproduce the rollout's old log-probs, so the policy keeps the batch's width there.
    One row per forward is cut alike in both; a CPU's fp32 rounds alike enough (the test above)."""
    assert cuts_policy_forwards(2, torch.device("cpu")) and cuts_policy_forwards(1, "cuda")
    assert not cuts_policy_forwards(2, "cuda")
    for cut in (True, False):
        monkeypatch.setattr(trainer_module, "cuts_policy_forwards", lambda micro, device: cut)
        trainer = build_trainer(tmp_path / str(cut), MultiAdapterBackend, prompts, SMALL)
        be = trainer.backend
        widths, real = [], be.policy_forward

        def recording(input_ids, *a, **k):
            widths.append(input_ids.shape[1])
            return real(input_ids, *a, **k)

        be.policy_forward = recording
        torch.manual_seed(1)
        r = trainer.rollout(trainer.batch_prompts(0))
        trainer.update(r)
        assert len(widths) == 2 * 8 // 2  # the rollout's forwards and the update's (one epoch), two rows each
        assert (min(widths) < r.input_ids.shape[1]) == cut


@pytest.mark.parametrize("backend_cls", [MultiAdapterBackend, FourModelBackend])
def test_reward_and_reference_forwards_take_the_policys_rows_on_a_cpu(tmp_path, prompts, monkeypatch, backend_cls):
    """On a CPU the reward model and the reference read the rollout in the policy's micro-batches of the sorted
    chunk, each cut to its columns; a GPU reads whole chunks. Either way each row gets its own score and reference
    log-probs (a forward over the whole padded batch, up to fp32 rounding)."""
    assert splits_no_grad_forwards("cpu") and not splits_no_grad_forwards(torch.device("cuda"))
    for split in (True, False):
        monkeypatch.setattr(trainer_module, "splits_no_grad_forwards", lambda device: split)
        trainer = build_trainer(tmp_path / f"{backend_cls.__name__}{split}", backend_cls, prompts, SMALL)
        be, cfg = trainer.backend, trainer.config
        shapes = {"scores": [], "reference": []}
        real_scores, real_reference = be.scores, be.reference_logprobs

        def scores(input_ids, *a, **k):
            shapes["scores"].append(tuple(input_ids.shape))
            return real_scores(input_ids, *a, **k)

        def reference(input_ids, *a, **k):
            shapes["reference"].append(tuple(input_ids.shape))
            return real_reference(input_ids, *a, **k)

        be.scores, be.reference_logprobs = scores, reference
        torch.manual_seed(1)
        r = trainer.rollout(trainer.batch_prompts(0))
        be.scores, be.reference_logprobs = real_scores, real_reference
        rows = cfg.micro_batch_size if split else cfg.forward_batch_size
        for name, seen in shapes.items():
            assert [b for b, _ in seen] == [rows] * (cfg.batch_size // rows), name
        if split:  # sorted shortest first: the first micro-batch is the narrowest
            assert shapes["reference"][0][1] < shapes["reference"][-1][1]
        R = r.n_response
        with torch.no_grad():
            ref = be.reference_logprobs(r.input_ids, r.attention_mask, R, cfg.temperature)
            ids, mask = append_missing_eos(r.input_ids, r.attention_mask, r.has_eos, be.tokenizer.eos_token_id,
                                           be.tokenizer.pad_token_id)
            want_scores = be.scores(ids, mask)
        m = r.response_mask
        assert (r.ref_logprobs[m] - ref[m].float()).abs().max() < TOLERANCE
        assert (r.raw_scores - want_scores).abs().max() < TOLERANCE
